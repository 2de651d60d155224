"""Embeddings in the engine and their bookkeeping: the sentence-transformers layout read
torch-free, the scheduler's whole-prompt rule for bidirectional models, and the engine's
vectors (``Engine.submit_embed``) against sentence-transformers' ``encode`` on the
tiny-qwen3-embedding and tiny-bert presets in fp32: cosine >= 0.9999 per text, the same shape,
a batch equal to one at a time, a long input pooled over several prefill chunks, and an
embedding beside a decoding request leaving its tokens unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pantheon.core.description import ModelError, read_description
from pantheon.core.embedding import BASE_MODEL, EmbeddingSpec
from pantheon.core.protocol import SamplingParams
from workers.block_manager import BlockManager
from workers.engine import Engine, RequestRejected
from workers.scheduler import Scheduler, Sequence

TEXTS = [
    "hello world",
    "The capital of France is Paris, a city of many bridges and a long river.",
    "a",
    "Vectors for retrieval: similar texts land close together.",
]


@pytest.fixture(scope="module")
def q3(model_factory) -> str:
    return str(model_factory("tiny-qwen3-embedding", dtype="float32"))


@pytest.fixture(scope="module")
def bert(model_factory) -> str:
    return str(model_factory("tiny-bert"))


def _ids(path: str, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    return [tok.encode(t, add_special_tokens=True).ids for t in texts]


def _embed(eng: Engine, prompts: list[list[int]], pooling, normalize: bool) -> list[np.ndarray]:
    base = f"e{eng.steps}-"
    for i, p in enumerate(prompts):
        eng.submit_embed(f"{base}{i}", p, pooling, normalize)
    got = {}
    while eng.has_work():
        eng.step()
        got.update({o.request_id: np.frombuffer(o.vector, "<f4") for o in eng.take_embedded()})
    assert eng.request_tables()["embeds"] == 0 and eng.blocks.num_used == 0
    return [got[f"{base}{i}"] for i in range(len(prompts))]


def _reference(path: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})
    return st.encode(texts, convert_to_numpy=True)


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_sentence_transformers_layout(q3, bert, tmp_path):
    assert read_description(q3).embedding == EmbeddingSpec("last", True, (), max_tokens=4096)
    d = read_description(bert)
    assert d.embedding == EmbeddingSpec("mean", False, None, max_tokens=512) and not d.can_generate
    # an unsupported pooling mode is refused at load, naming the file
    (tmp_path / "config.json").write_text(open(f"{q3}/config.json").read())
    (tmp_path / "modules.json").write_text(
        json.dumps([{"idx": 1, "name": "1", "path": "p", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelError, match="pooling_mode_max_tokens"):
        read_description(tmp_path)


def test_whole_prompts_are_never_split():
    """A bidirectional model's prompt is one chunk: alone in a step past the budget, else with
    others while they fit."""
    sched = Scheduler(BlockManager(64, 4), num_slots=4, prefill_chunk=8, whole_prompts=True)
    for i, n in enumerate((5, 20, 3)):
        sched.add(Sequence(f"s{i}", n, list(range(n)), 1, use_cache=False, embed="mean"))
    plan = sched.schedule(8)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("s0", 5)]  # s1 waits for its own step
    assert plan.sampled() == []  # embeddings are never sampled
    sched.commit(plan)
    sched.finish(plan.prefill[0][0])
    plan = sched.schedule(8)  # first in line, and larger than the budget: alone, whole
    assert [(s.request_id, n) for s, n in plan.prefill] == [("s1", 20)]


@pytest.mark.parametrize("which", ["q3", "bert"])
def test_matches_sentence_transformers_and_batch_equals_one(request, which):
    path = request.getfixturevalue(which)
    spec = read_description(path).embedding
    assert spec is not None
    eng = Engine(path, dtype="float32", cpu_path="fp32", kv_budget_bytes=8 << 20)
    prompts = _ids(path, TEXTS)
    batch = _embed(eng, prompts, spec.pooling, spec.normalize)
    ref = _reference(path, TEXTS)
    for got, want in zip(batch, ref):
        assert got.shape == want.shape
        assert _cos(got, want) >= 0.9999
    for p, b in zip(prompts, batch):
        assert np.allclose(_embed(eng, [p], spec.pooling, spec.normalize)[0], b, atol=1e-5)
    if which == "bert":
        with pytest.raises(RequestRejected, match="only embeds"):
            eng.submit("g", prompts[0], SamplingParams(max_tokens=2))


def test_long_input_pooled_over_chunks_and_beside_decoding(q3):
    """An input longer than a prefill chunk is pooled over several steps (mean and last as in
    one pass), and a decoding request beside embeddings gets the tokens it gets alone."""
    long_text = " ".join(TEXTS * 6)
    prompts = _ids(q3, [long_text])
    one = Engine(q3, dtype="float32", cpu_path="fp32", kv_budget_bytes=8 << 20)
    chunked = Engine(q3, dtype="float32", cpu_path="fp32", kv_budget_bytes=8 << 20, prefill_chunk=16)
    assert len(prompts[0]) > 3 * 16
    for pooling in ("mean", "last"):
        a = _embed(one, prompts, pooling, True)[0]
        b = _embed(chunked, prompts, pooling, True)[0]
        assert np.allclose(a, b, atol=1e-5), pooling
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def decode(eng: Engine, rid: str, with_embeds: bool) -> list[int]:
        eng.submit(rid, prompts[0][:12], params)
        if with_embeds:
            for i, p in enumerate(_ids(q3, TEXTS)):
                eng.submit_embed(f"{rid}-e{i}", p, "last", True)
        toks = []
        while eng.has_work():
            toks += [t.token for t in eng.step() if t.request_id == rid]
        assert len(eng.take_embedded()) == (len(TEXTS) if with_embeds else 0)
        return toks

    assert decode(chunked, "alone", False) == decode(chunked, "beside", True)


def test_base_model_checkpoint(q3, tmp_path):
    """A checkpoint saved from the base model (Qwen3-Embedding's: ``layers.*``, no ``model.``
    prefix) embeds as the preset's own."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(q3, tmp_path, dirs_exist_ok=True)
    weights = load_file(f"{q3}/model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    prompts = _ids(q3, TEXTS[:2])
    a = _embed(Engine(q3, dtype="float32", cpu_path="fp32", kv_budget_bytes=4 << 20), prompts, "last", True)
    b = _embed(
        Engine(str(tmp_path), dtype="float32", cpu_path="fp32", kv_budget_bytes=4 << 20),
        prompts,
        "last",
        True,
    )
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    # saved as sentence-transformers and vLLM name it (the base model's class): an embedding
    # model that does not generate, with its own pooling, else the last token, normalised
    cfg = json.loads((tmp_path / "config.json").read_text())
    for arch in ("Qwen3Model", "Qwen2Model", "LlamaModel", "MistralModel"):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        d = read_description(tmp_path)
        assert not d.can_generate and d.embedding is not None and d.embedding.pooling == "last", arch
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3Model"]}))
    (tmp_path / "modules.json").unlink()
    d = read_description(tmp_path)
    assert d.embedding == BASE_MODEL and not d.can_generate
    c = _embed(
        Engine(str(tmp_path), dtype="float32", cpu_path="fp32", kv_budget_bytes=4 << 20),
        prompts,
        "last",
        True,
    )
    for x, y in zip(a, c):
        assert np.array_equal(x, y)


def test_gguf_pooling_type(tmp_path):
    """A GGUF file's ``<arch>.pooling_type`` (llama.cpp's numbers) says how it embeds."""
    gguf = pytest.importorskip("gguf")
    from pantheon.core.embedding import gguf_embedding
    from pantheon.core.gguf import read_gguf

    for kind, want in ((1, "mean"), (2, "cls"), (3, "last"), (0, None), (4, None)):
        path = tmp_path / f"m{kind}.gguf"
        w = gguf.GGUFWriter(str(path), "qwen3")
        w.add_uint32("qwen3.pooling_type", kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        spec = gguf_embedding(read_gguf(path).meta)
        assert (spec and spec.pooling) == want and (spec is None or spec.normalize)


def test_an_embedding_one_token_short_of_its_prompt_is_prefilled_not_sampled():
    """A chunk that ends one token before an embedding's last leaves it one pending token: it
    is still prompt, prefilled in the next step, never decoded nor sampled (it was: the worker
    died on the sampler it has none of)."""
    sched = Scheduler(BlockManager(64, 4), num_slots=4, prefill_chunk=9)
    for i in range(2):
        sched.add(Sequence(f"s{i}", 5, list(range(5)), 1, use_cache=False, embed="mean"))
    plan = sched.schedule(9)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("s0", 5), ("s1", 4)]
    sched.commit(plan)
    sched.finish(plan.prefill[0][0])
    plan = sched.schedule(9)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("s1", 1)]
    assert plan.decode == [] and plan.sampled() == []


def test_embeddings_across_chunk_slot_and_pool_limits_beside_chat(q3):
    """Embeddings of every length around the prefill chunk, more of them than slots, in a pool
    they fill, beside a decoding chat request: every step runs, every vector is the one its
    input gets alone, the chat's tokens are its own, and nothing is left behind."""
    chunk = 8
    eng = Engine(
        q3, dtype="float32", cpu_path="fp32", kv_budget_bytes=1 << 16, prefill_chunk=chunk, num_slots=3
    )
    eng.budget.per_token_s = None  # the chunk is the whole budget: no measured step shrinks it
    pool = eng.blocks.num_blocks * eng.blocks.block_size
    base = _ids(q3, [" ".join(TEXTS * 20)])[0]
    lengths = sorted({1, 2, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk + 1, pool - 1, pool})
    prompts = [base[:n] if n <= len(base) else (base * (n // len(base) + 1))[:n] for n in lengths]
    alone = [_embed(eng, [p], "last", True)[0] for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng.submit("chat-alone", base[:10], params)
    want = []
    while eng.has_work():
        want += [t.token for t in eng.step()]
    eng.submit("chat", base[:10], params)
    for i, p in enumerate(prompts):
        eng.submit_embed(f"e{i}", p, "last", True)
    got, toks = {}, []
    while eng.has_work():
        toks += [t.token for t in eng.step() if t.request_id == "chat"]
        got.update({o.request_id: np.frombuffer(o.vector, "<f4") for o in eng.take_embedded()})
    assert set(got) == {f"e{i}" for i in range(len(prompts))}
    for i, v in enumerate(alone):
        assert np.allclose(got[f"e{i}"], v, atol=1e-5), lengths[i]
    assert toks == want[: len(toks)] and len(toks) >= 1  # a pool-sized embedding may truncate it
    assert all(v == 0 for k, v in eng.request_tables().items() if k != "grammar_failures")


def test_a_step_that_raises_fails_its_requests_not_the_engine(q3):
    """An exception inside a step ends the requests it ran (``StepFailed`` names them) and the
    engine serves the next requests as before."""
    from workers.errors import StepFailed

    eng = Engine(q3, dtype="float32", cpu_path="fp32", kv_budget_bytes=4 << 20)
    prompt = _ids(q3, TEXTS[:1])[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.submit("before", prompt, params)
    want = []
    while eng.has_work():
        want += [t.token for t in eng.step()]

    def boom(seqs, logits):
        raise RuntimeError("a bug reached by this step")

    eng.on_logits = boom
    eng.submit("a", prompt, params)
    eng.submit_embed("e", prompt, "last", True)
    with pytest.raises(StepFailed) as e:
        eng.step()
    assert set(e.value.request_ids) == {"a", "e"} and isinstance(e.value.cause, RuntimeError)
    assert not eng.has_work() and eng.blocks.num_used == 0
    eng.on_logits = None
    eng.submit("after", prompt, params)
    got = []
    while eng.has_work():
        got += [t.token for t in eng.step()]
    assert got == want
