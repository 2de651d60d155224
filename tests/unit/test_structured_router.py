"""The router's half of structured outputs (pantheon/api/structured.py): what each way of
asking for a constraint becomes, what the grammar accepts (checked with an llguidance matcher
over the bytes of a candidate output), and the 400 every bad one gets, naming its parameter."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from pantheon.api import structured
from pantheon.api.openai import protocol as oa
from pantheon.core.gguf import byte_alphabet
from pantheon.errors import ApiError

MSG = [{"role": "user", "content": "hi"}]


def accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` matches ``text`` exactly, byte by byte (a byte-level tokenizer)."""
    tok = llg.LLTokenizer(_BYTES_TOKENIZER)
    m = llg.LLMatcher(tok, grammar, log_level=0)
    ids = tok.tokenize_bytes(text.encode())
    return m.consume_tokens(ids) and m.is_accepting()


# a byte-level BPE with no merges: one token per byte, so any text tokenizes
_BYTES_TOKENIZER = json.dumps(
    {
        "version": "1.0",
        "added_tokens": [{"id": 256, "content": "<eos>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {c: i for i, c in enumerate(byte_alphabet().values())}, "merges": []},
    }
)  # fmt: skip


def kind_and_grammar(**body):
    return structured.request_grammar(body)


def test_each_way_of_asking_maps_to_its_kind():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert kind_and_grammar() == ("text", None)
    assert kind_and_grammar(response_format={"type": "text"}) == ("text", None)
    for body, kind in [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "json_schema",
        ),
        ({"guided_json": schema}, "json"),
        ({"guided_json": json.dumps(schema)}, "json"),
        ({"guided_regex": "a+"}, "regex"),
        ({"guided_choice": ["a", "b"]}, "choice"),
        ({"guided_grammar": 'start: "x"'}, "grammar"),
        ({"structured_outputs": {"json": schema}}, "json"),
        ({"structured_outputs": {"json_object": True}}, "json_object"),
    ]:
        got, grammar = kind_and_grammar(**body)
        assert got == kind and grammar, body


def test_the_grammars_accept_what_they_should():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    js = structured.json_schema_grammar(schema, "s")
    assert accepts(js, '{"a": 5}') and not accepts(js, '{"a": "5"}')
    assert not accepts(js, '{ "a" : 5 }')  # compact: the separators are ", " and ": " only
    obj = structured.request_grammar({"response_format": {"type": "json_object"}})[1]
    assert obj and accepts(obj, '{"k": [1, {"z": null}]}') and not accepts(obj, "[1]")
    assert accepts(structured.regex_grammar("[0-9]{2}x", "r"), "42x")
    ch = structured.choice_grammar(["red", "blue"], "c")
    assert accepts(ch, "red") and not accepts(ch, "green")
    gb = structured.lark_grammar('root ::= "a" ("b" | "c")', "g")
    assert accepts(gb, "ab") and not accepts(gb, "ad")


def test_tool_grammars_are_the_model_tool_call_format():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    forced = structured.tool_grammar(tools, "f", '<tool_call>\n{"name": "f", "arguments": ')
    assert accepts(forced, '{"x": 1}}\n</tool_call>')
    assert not accepts(forced, '{"y": 1}}\n</tool_call>')
    any_call = structured.tool_grammar(tools, None, "<tool_call>\n")
    assert accepts(any_call, '{"name": "g", "arguments": {}}\n</tool_call>')
    assert not accepts(any_call, '{"name": "h", "arguments": {}}\n</tool_call>')
    no_markup = structured.tool_grammar(tools, None, "")  # the prompt has no <tool_call> yet
    assert accepts(no_markup, '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>')


def test_strict_false_ignores_what_the_engine_does_not_implement():
    odd = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(ApiError):
        structured.json_schema_grammar(odd, "s")
    assert structured.json_schema_grammar(odd, "s", strict=False)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
         "response_format.json_schema.strict"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format.json_schema.schema"),
        ({"guided_json": "{nope"}, "guided_json"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "wat"}}}}, "guided_json"),
        ({"guided_json": {"description": "x" * structured.MAX_GRAMMAR_BYTES}}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a{2,1}"}, "guided_regex"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_choice": [""]}, "guided_choice"),
        ({"guided_choice": ["a"] * (structured.MAX_CHOICES + 1)}, "guided_choice"),
        ({"guided_grammar": "start: ("}, "guided_grammar"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_name_their_param(body, param):
    with pytest.raises(ApiError) as ei:
        oa.parse_chat_request({"messages": MSG, **body})
    assert ei.value.status == 400 and ei.value.param == param, ei.value.message


def test_a_forced_tool_with_bad_parameters_is_a_400_but_auto_is_not():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(ApiError) as ei:
        oa.parse_chat_request({"messages": MSG, "tools": tools, "tool_choice": "required"})
    assert ei.value.param == "tools[0].function.parameters"
    assert oa.parse_chat_request({"messages": MSG, "tools": tools}).grammar is None  # auto: free


def test_the_request_carries_the_grammar_to_the_worker():
    req = oa.parse_chat_request({"messages": MSG, "guided_regex": "a+"})
    p = req.sampling(max_tokens=5, stop_token_ids=[2])
    assert p.grammar == req.grammar and p.grammar_after == []
    plain = oa.parse_chat_request({"messages": MSG}).sampling(max_tokens=5, stop_token_ids=[2])
    assert plain.grammar is None
