"""llama.cpp's own tokenizer suite against ``pantheon.core.gguf_tokenizer``: every vocabulary of
``models/ggml-vocab-*.gguf`` (written by llama.cpp's converter from the Hub's real tokenizers), each
``.inp`` text encoded as ``tests/test-tokenizer-0.cpp`` does (no special tokens added, none parsed
from the text) must give exactly the ids of its ``.out`` line.

The tree is the llama-cpp-python sdist that bench/peer.py pins (``python3 bench/peer.py source``,
which .ci/run runs); without it these tests fail saying so. gpt-4o (gpt-oss) and tekken (Mistral
Nemo, Small 3.x) have no vocabulary in the suite: their split regexes are checked on the suite's
texts against the reference ones, tiktoken's o200k pattern and transformers' Mistral pattern.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pantheon.core.gguf import GGUFError, read_gguf
from pantheon.core.gguf_tokenizer import GPT4O_SPLIT, TEKKEN_SPLIT, tokenizer_json

from helpers.llama_convert import vocab_cases, vocab_suite_dir

# the vocabularies of families Pantheon serves (and a few that are exact for free)
SERVED = [
    "llama-bpe",  # Llama 3.x, DeepSeek-R1-Distill-Llama
    "llama-spm",  # Llama 2, Mistral 7B, SentencePiece Llamas
    "phi-3",  # SentencePiece as well
    "qwen2",  # Qwen2/2.5/3, DeepSeek-R1-Distill-Qwen
    "qwen35",  # Qwen3.5/3.6
    "gemma-4",
    "gpt-2",
    "bert-bge",  # BERT embeddings
    "deepseek-llm",
    "deepseek-coder",
    "command-r",
    "falcon",
    "starcoder",  # the same regexes as smollm
    "refact",
]
# vocabularies refused at load, with the field that says why
REFUSED = {"mpt": "tokenizer.ggml.pre", "nomic-bert-moe": "tokenizer.ggml.model"}


@pytest.fixture(scope="module")
def suite() -> Path:
    return vocab_suite_dir()


def test_every_vocabulary_is_named(suite: Path):
    """A vocabulary the tree adds is either served (exact) or refused here, never left unchecked."""
    have = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in suite.glob("ggml-vocab-*.gguf.inp")}
    assert have <= set(SERVED) | set(REFUSED), sorted(have - set(SERVED) - set(REFUSED))
    assert set(SERVED) <= have


@pytest.mark.parametrize("name", SERVED)
def test_vocabulary_exact(suite: Path, name: str):
    gguf = suite / f"ggml-vocab-{name}.gguf"
    tok = Tokenizer.from_str(tokenizer_json(read_gguf(gguf)))
    tok.encode_special_tokens = True  # test-tokenizer-0 tokenizes with parse_special = false
    want = vocab_cases(gguf)
    got = tok.encode_batch([t for t, _ in want], add_special_tokens=False)
    bad = [(text, ids, g.ids) for (text, ids), g in zip(want, got) if g.ids != ids]
    assert not bad, f"{name}: {len(want) - len(bad)}/{len(want)} exact; first: {bad[0]!r}"


@pytest.mark.parametrize(
    "name,before,after",
    [("llama-spm", [1], []), ("bert-bge", [101], [102]), ("llama-bpe", [128000], []), ("qwen2", [], [])],
)
def test_special_tokens_as_llama_cpp(suite: Path, name: str, before: list[int], after: list[int]):
    """What ``add_special`` adds (BOS for SentencePiece and Llama 3, [CLS] ... [SEP] for BERT,
    nothing for Qwen), and SentencePiece's space before the text after a special token (llama.cpp
    prefixes every text run that follows one)."""
    tok = Tokenizer.from_str(tokenizer_json(read_gguf(suite / f"ggml-vocab-{name}.gguf")))
    plain = tok.encode("Hello world", add_special_tokens=False).ids
    assert tok.encode("Hello world").ids == before + plain + after
    if name == "llama-spm":
        assert tok.encode("</s>Hello world", add_special_tokens=False).ids == [2, *plain]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vocabulary_refused(suite: Path, name: str):
    g = read_gguf(suite / f"ggml-vocab-{name}.gguf")
    field = REFUSED[name]
    with pytest.raises(GGUFError) as e:
        tokenizer_json(g)
    msg = str(e.value)
    assert e.value.kind == "unsupported"
    assert field in msg and repr(g.meta[field]) in msg and "supported:" in msg


def _tiktoken_o200k() -> str:
    """tiktoken's o200k_base pattern (gpt-4o, gpt-oss), without downloading its ranks."""
    from tiktoken_ext import openai_public

    real = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda *a, **k: {}
    try:
        return openai_public.o200k_base()["pat_str"]
    finally:
        openai_public.load_tiktoken_bpe = real


def _transformers_tekken() -> str:
    """The split regex transformers gives Mistral's tekken tokenizers (its ``fix_mistral_regex``)."""
    import inspect
    import re

    from transformers import tokenization_utils_tokenizers as tut

    src = inspect.getsource(tut)
    m = re.search(r'Regex\(\s*r"(\[\^\\r\\n\\p\{L\}\\p\{N\}\]\?\[\\p\{Lu\}.*?)"\s*\)', src)
    assert m, "transformers no longer carries the Mistral regex"
    return m.group(1)


@pytest.mark.parametrize(
    "ours,reference", [(GPT4O_SPLIT, _tiktoken_o200k), (TEKKEN_SPLIT, _transformers_tekken)]
)
def test_split_regex_matches_reference(suite: Path, ours: str, reference):
    """Our Split (Oniguruma, in ``tokenizers``) cuts every suite text where the reference pattern
    (Python's ``regex`` module, the engine tiktoken's pattern is written for) does."""
    import regex
    from tokenizers import pre_tokenizers

    ref = regex.compile(reference())
    split = pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(ours), behavior="isolated")
    texts = sorted(
        {t for p in suite.glob("ggml-vocab-*.gguf.inp") for t, _ in vocab_cases(p.with_suffix(""))}
    )
    for text in texts:
        want, at = [], 0
        for m in ref.finditer(text):
            if m.start() > at:
                want.append(text[at : m.start()])
            want.append(m.group())
            at = m.end()
        if at < len(text):
            want.append(text[at:])
        assert [p for p, _ in split.pre_tokenize_str(text)] == want, text
