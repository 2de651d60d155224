"""A model's ``tokenizer.json`` as the grammar engine (llguidance) should see it. No torch.

llguidance takes every entry of ``added_tokens`` for a special token, written as the bytes
``\\xff[id]`` that no grammar literal matches. But a Qwen (or ChatML) tokenizer adds its markup
tags, ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``, as plain tokens
(``"special": false``): text the model writes and the chat parsers read. Seen as special, a
grammar's literal ``"<tool_call>"`` forces the bytes ``<tool_call>``, the tokenizer spells them
with the added token, and the matcher then refuses the very token its mask allowed. So the plain
added tokens go into the vocabulary as the text they are (their content, byte-level encoded the
way the model's vocabulary stores text), and only the special ones stay special.

The router (``pantheon/api/structured.py``) and the worker (``workers/grammar.py``) both
build their llguidance tokenizer from this and take ``LIMIT_VALUES``, so their masks and limits agree.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# The parser limits of every matcher, the router's probes and the worker's alike: llguidance's
# defaults, with errors that do not quote the grammar (a 60 KB grammar once filled the log).
LIMIT_VALUES: dict[str, Any] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    "verbose_errors": False,
}


def _byte_level(text: str) -> str:
    """``text`` in GPT-2's byte-to-unicode alphabet (what a byte-level BPE vocabulary holds)."""
    from pantheon.core.gguf import byte_alphabet

    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in text.encode("utf-8"))


def grammar_tokenizer_json(tokenizer_json: str) -> str:
    """``tokenizer_json`` with its non-special added tokens moved into the model's vocabulary."""
    try:
        data = _loads(tokenizer_json)
    except ValueError:
        return tokenizer_json
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return tokenizer_json
    model, added = data["model"], data.get("added_tokens")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not isinstance(added, list) or model.get("type") != "BPE":
        return tokenizer_json
    pre = str(data.get("pre_tokenizer")) + str(data.get("decoder"))
    byte_level = "ByteLevel" in pre
    keep = []
    for tok in added:
        if isinstance(tok, dict) and tok.get("special") is False and isinstance(tok.get("content"), str):
            text = tok["content"]
            vocab[_byte_level(text) if byte_level else text] = tok["id"]
        else:
            keep.append(tok)
    if len(keep) == len(added):
        return tokenizer_json
    data["added_tokens"] = keep
    try:
        return msgspec.json.encode(data).decode()
    except UnicodeEncodeError:  # a lone surrogate (from json's decoding: below)
        return json.dumps(data)


def _loads(text: str) -> Any:
    """A tokenizer.json's data: msgspec's decoder (json's took 0.15 s of a Qwen3.5 load's grammar
    vocabulary, 5.5 MB), json's for what msgspec refuses (a lone surrogate's escape)."""
    try:
        return msgspec.json.decode(text)
    except ValueError:
        return json.loads(text)
