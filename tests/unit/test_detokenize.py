"""Incremental detokenization: what comes out piece by piece is what a full decode gives."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from pantheon.chat.detokenize import IncrementalDetokenizer

REPLACEMENT = "\ufffd"

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "Héllo wörld, ça va ? Voilà, déjà vu, naïve café, résumé, Ærøskøbing.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "こんにちは、世界。日本語のテキストです。",
    "Emoji: 🙂 🎉 👍🏽 🇫🇷 — and a zero-width joiner 👩‍💻.",
    "def f(x):\n    return x * 2  # code\n",
    "<think>\nLet me think.\n</think>\n\nThe answer is 42.<|im_end|>",
]

TEXTS = [
    "Héllo wörld! Ça va très bien, merci.",
    "你好，世界！今天天气很好。",
    "混合 text with 日本語 and émojis 🙂🎉👍🏽👩‍💻🇫🇷 at the end 🙂",
    "Unseen: Ωμέγα Ψ ж 한국어 ☃ 𝄞 🦄",
    '<think>\nreasoning\n</think>\n\nanswer <tool_call>\n{"a": 1}\n</tool_call><|im_end|>',
    "   leading spaces and\n\nnewlines\t tabs  ",
]

ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL = ["<|im_end|>", "<|endoftext|>"]


def _add_tokens(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def bytelevel_tokenizer() -> Tokenizer:
    """GPT-2 / Qwen style: byte-level BPE, so non-ASCII characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    return _add_tokens(tok)


def metaspace_tokenizer() -> Tokenizer:
    """Llama 2 / SentencePiece style: ``▁`` for spaces, byte fallback for unseen characters, and a
    decoder that strips the leading space of the first token (so context matters)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], limit_alphabet=40)
    tok.train_from_iterator(CORPUS * 5, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    base = max(vocab.values()) + 1
    for b in range(256):  # byte-fallback pieces, as ordinary vocabulary entries like Llama's
        vocab.setdefault(f"<0x{b:02X}>", base + b)
    return _add_tokens(Tokenizer.from_str(json.dumps(data)))


@pytest.fixture(scope="module", params=["bytelevel", "metaspace", "tiny_model"])
def tokenizer(request) -> Tokenizer:
    if request.param == "bytelevel":
        return bytelevel_tokenizer()
    if request.param == "metaspace":
        return metaspace_tokenizer()
    folder = request.getfixturevalue("tiny_model")
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def stream(tok, ids, *, prompt_ids=None, skip=True) -> list[str]:
    det = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    return [det.push(i) for i in ids] + [det.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_real_texts_round_trip(tokenizer, skip):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces = stream(tokenizer, ids, skip=skip)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == full
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tokenizer, skip):
    rng = random.Random(1234)
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 40))]
        pieces = stream(tokenizer, ids, skip=skip)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == full, ids
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in p for p in pieces)


def test_random_slices_of_real_texts(tokenizer):
    """Random runs of real tokens: starts and ends fall inside characters, never in the output."""
    rng = random.Random(99)
    ids = tokenizer.encode("".join(TEXTS), add_special_tokens=False).ids
    for _ in range(200):
        a = rng.randrange(len(ids))
        b = rng.randrange(a + 1, len(ids) + 1)
        pieces = stream(tokenizer, ids[a:b])
        assert "".join(pieces) == tokenizer.decode(ids[a:b])


def test_split_character_is_emitted_once_whole(tokenizer):
    for ch in ["é", "你", "🙂", "👍🏽", "𝄞", "🦄"]:
        text = f"a{ch}b"
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces = [p for p in stream(tokenizer, ids) if p]
        assert "".join(pieces) == tokenizer.decode(ids)
        # Every piece is whole text: the character appears in exactly one piece.
        assert sum(ch[0] in p for p in pieces) == 1, pieces
        assert not any(REPLACEMENT in p for p in pieces)


def test_some_character_really_is_split():
    """Make sure the tests above exercise the hold-back: some characters span several tokens."""
    tok = bytelevel_tokenizer()
    ids = tok.encode("🦄", add_special_tokens=False).ids
    assert len(ids) > 1
    det = IncrementalDetokenizer(tok)
    assert [det.push(i) for i in ids][:-1] == [""] * (len(ids) - 1)
    det = IncrementalDetokenizer(tok)
    out = [det.push(i) for i in ids]
    assert out[-1] == "🦄"


def test_special_and_added_tokens():
    tok = bytelevel_tokenizer()
    ids = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|>", add_special_tokens=False).ids
    im_end = tok.token_to_id("<|im_end|>")
    assert ids[-1] == im_end
    assert "".join(stream(tok, ids)) == "<think>\nhm\n</think>\n\nok"
    assert "".join(stream(tok, ids, skip=False)) == "<think>\nhm\n</think>\n\nok<|im_end|>"
    det = IncrementalDetokenizer(tok)
    assert det.push(tok.token_to_id("<tool_call>")) == "<tool_call>"
    assert det.push(im_end) == ""


def test_prompt_context(tokenizer):
    prompt = "Voilà le résumé :"
    for cont in [" café naïve", " 你好 🙂", "\n<think>\nx</think>", " ok"]:
        p_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        g_ids = tokenizer.encode(prompt + cont, add_special_tokens=False).ids[len(p_ids) :]
        full = tokenizer.decode(p_ids + g_ids)
        head = tokenizer.decode(p_ids)
        assert full.startswith(head)
        assert "".join(stream(tokenizer, g_ids, prompt_ids=p_ids)) == full[len(head) :]


def test_metaspace_leading_space_needs_context():
    tok = metaspace_tokenizer()
    p_ids = tok.encode("Hello", add_special_tokens=False).ids
    g_ids = tok.encode("Hello world", add_special_tokens=False).ids[len(p_ids) :]
    # Alone, the first output token would lose its leading space; after the prompt it keeps it.
    assert "".join(stream(tok, g_ids, prompt_ids=p_ids)) == " world"


class CountingTokenizer:
    """Wraps a tokenizer and records the longest list of ids it was asked to decode."""

    def __init__(self, inner):
        self.inner = inner
        self.longest = 0
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self):
        return self.inner.get_added_tokens_decoder()


def test_cost_per_token_is_constant():
    tok = bytelevel_tokenizer()
    counting = CountingTokenizer(tok)
    text = " ".join(TEXTS) * 40
    ids = tok.encode(text, add_special_tokens=False).ids
    im_end = tok.token_to_id("<|im_end|>")
    ids = ids + [im_end] * 500  # a run of skipped special tokens must not grow the window either
    det = IncrementalDetokenizer(counting, prompt_ids=ids[:100])
    out = "".join(det.push(i) for i in ids) + det.flush()
    assert out == tok.decode(ids)
    assert len(ids) > 2000
    assert counting.longest <= 16
    assert counting.calls <= 2 * len(ids) + 3
