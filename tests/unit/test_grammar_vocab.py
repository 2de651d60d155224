"""The grammar engine sees a tokenizer's plain added tokens (Qwen's ``<tool_call>``) as text:
otherwise a grammar's literal ``<tool_call>`` is spelled with the added token, which llguidance
then refuses (pantheon/core/grammar_vocab.py)."""

from __future__ import annotations

import json

import llguidance as llg

from pantheon.api import structured
from pantheon.core.grammar_vocab import grammar_tokenizer_json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]


def test_a_required_xml_call_runs_on_a_tokenizer_with_added_tags(model_factory):
    raw = (model_factory("tiny-qwen3.5") / "tokenizer.json").read_text()
    plain = {t["content"]: t["id"] for t in json.loads(raw)["added_tokens"] if t["special"] is False}
    assert "<tool_call>" in plain and "</tool_call>" in plain
    grammar = structured.tool_grammar(TOOLS, None, "", "xml")

    def probe(text: str) -> str:
        tok = llg.LLTokenizer(text, n_vocab=4032, eos_token=3993)
        return structured.probe(tok, grammar, [3993])

    assert "doesn't satisfy the grammar" in probe(raw)  # what llguidance does with them as they are
    assert probe(grammar_tokenizer_json(raw)) == ""
    moved = json.loads(grammar_tokenizer_json(raw))
    assert {t["content"] for t in moved["added_tokens"]}.isdisjoint(plain)  # special ones stay
    assert all(moved["model"]["vocab"][c] == i for c, i in plain.items() if c.isascii())


def test_anything_else_is_left_as_it_is():
    assert grammar_tokenizer_json("not json") == "not json"
    wordpiece = json.dumps({"model": {"type": "WordPiece", "vocab": {}}, "added_tokens": []})
    assert grammar_tokenizer_json(wordpiece) == wordpiece


def test_a_tokenizer_json_with_a_lone_surrogate_is_read_as_json_reads_it():
    """A tokenizer.json may escape a lone surrogate (a byte-level vocabulary written by Python's
    json), which the fast decoder refuses: it is read and written by json's instead, its plain
    added tokens moved all the same."""
    raw = json.dumps(
        {
            "model": {"type": "BPE", "vocab": {"a": 0, "\ud83d": 1}, "merges": []},
            "pre_tokenizer": None,
            "decoder": None,
            "added_tokens": [{"id": 2, "content": "<x>", "special": False}],
        }
    )
    moved = json.loads(grammar_tokenizer_json(raw))
    assert moved["model"]["vocab"] == {"a": 0, "\ud83d": 1, "<x>": 2} and moved["added_tokens"] == []
