"""Real vocabularies end to end: llama.cpp's ``models/ggml-vocab-*.gguf`` (written by its converter
from the Hub's tokenizers) in files Pantheon loads and serves.

- Qwen3.5, served: ``make-model --vocab ggml-vocab-qwen35.gguf`` on the ``tiny-qwen3.5-text``
  preset's random weights (hidden size 64: the 151,936-row embedding stays 39 MB), converted by
  llama.cpp's own converter, its ``tokenizer.*`` metadata then exactly the suite file's
  (``helpers.llama_convert.with_vocab``) with Qwen3.5's real chat template (../shared/specs). A
  real ``pantheon serve`` loads it; a chat's ``usage.prompt_tokens`` and ``/tokenize`` give the ids
  the suite's tokenizer gives on the prompt transformers renders from that template.
- Llama 3 (llama-bpe), SentencePiece (llama-spm), Gemma 4 and Qwen3.5, at load: the router's
  ``ModelAssets`` of the vocabulary's GGUF and of a ``make-model --vocab`` folder encode every
  suite text as llama.cpp does.

tests/unit/test_gguf_vocab_suite.py checks the tokenizers themselves on the whole suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from makemodel import text_config
from pantheon.core.gguf import read_gguf
from pantheon.core.gguf_tokenizer import tokenizer_json
from pantheon.models.assets import ModelAssets

from helpers.llama_convert import convert, vocab_cases, vocab_suite_dir, with_vocab
from helpers.paths import need_specs
from helpers.serve import Server

# Decomposed Vietnamese (combining marks: where Qwen3.5's split differs from Qwen2's), code, CJK
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {
        "role": "user",
        "content": "Cu\u031b\u0309a Vie\u0323\u0302t?  def f(x):\n\treturn x**2  # 数字 12345 🦙",
    },
]


@pytest.fixture(scope="module")
def suite() -> Path:
    return vocab_suite_dir()


# ---------------------------------------------------------------- load time


@pytest.mark.parametrize(
    "name,preset",
    [
        ("llama-bpe", "tiny-llama"),
        ("llama-spm", "tiny-llama"),
        ("gemma-4", "tiny-gemma4"),
        ("qwen35", "tiny-qwen3.5-text"),
    ],
)
def test_assets_encode_as_llama_cpp(suite, model_factory, name, preset):
    """The router's tokenizer of the vocabulary's GGUF, and of a ``make-model --vocab`` folder, give
    llama.cpp's ids on every suite text (none holds a special token's text)."""
    gguf = suite / f"ggml-vocab-{name}.gguf"
    # float32 for Qwen3.5: the served test's folder, made once
    folder = model_factory(preset, vocab=str(gguf), **({"dtype": "float32"} if name == "qwen35" else {}))
    config = text_config(json.loads((folder / "config.json").read_text()))
    assert config["vocab_size"] == len(read_gguf(gguf).meta["tokenizer.ggml.tokens"])
    for assets in (ModelAssets(gguf), ModelAssets(folder)):
        bad = [(t, ids) for t, ids in vocab_cases(gguf) if assets.encode(t) != ids]
        assert not bad, f"{name} ({assets.path}): first of {len(bad)}: {bad[0]!r}"


# ---------------------------------------------------------------- Qwen3.5 served


@pytest.fixture(scope="module")
def qwen35(suite, model_factory, tmp_path_factory):
    """(the GGUF file, its vocabulary, the template) for a real-vocabulary Qwen3.5, made once."""
    template = (need_specs() / "qwen3.5-4B.chat_template.jinja").read_text(encoding="utf-8")
    vocab = suite / "ggml-vocab-qwen35.gguf"
    folder = model_factory("tiny-qwen3.5-text", dtype="float32", vocab=str(vocab))
    out = tmp_path_factory.mktemp("qwen35-real-vocab")
    converted = convert(folder, out / "converted.gguf", "f32")
    path = with_vocab(converted, vocab, out / "Qwen3.5-real-vocab.gguf", chat_template=template)
    converted.unlink()
    return path, vocab, template


@pytest.mark.slow
def test_qwen35_real_vocab_serves(qwen35, tmp_path):
    import httpx
    from openai import OpenAI
    from transformers import PreTrainedTokenizerFast

    path, vocab, template = qwen35
    g, v = read_gguf(path), read_gguf(vocab)
    assert g.arch == "qwen35"
    assert len(g.meta["tokenizer.ggml.tokens"]) == len(v.meta["tokenizer.ggml.tokens"]) == 151936
    assert {k: x for k, x in g.meta.items() if k.startswith("tokenizer.ggml.")} == {
        k: x for k, x in v.meta.items() if k.startswith("tokenizer.ggml.")
    }
    assert g.meta["tokenizer.ggml.pre"] == "qwen35"
    # what the suite's tokenizer gives on the prompt transformers renders from the real template
    ours = Tokenizer.from_str(tokenizer_json(v))
    text = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json(v))
    ).apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and "<|im_start|>assistant" in text
    want = ours.encode(text, add_special_tokens=False).ids
    assert ours.token_to_id("<|im_start|>") in want  # the markers are single special tokens

    s = Server(
        ["--model", str(path), "--name", "q35", "--dies", "cpu:0", "--cpu-dies", "1"], tmp_path / "serve.log"
    )
    try:
        s.wait_ready(("q35",))
        r = httpx.post(s.url + "/tokenize", json={"model": "q35", "messages": MESSAGES}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want
        client = OpenAI(base_url=s.url + "/v1", api_key="none")
        chat = client.chat.completions.create(model="q35", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.prompt_tokens == len(want)
        assert chat.choices[0].finish_reason in ("length", "stop")
    finally:
        s.stop()
