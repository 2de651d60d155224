"""The emitter: channels, tool calls and stop strings, independent of how the text is split."""

from __future__ import annotations

import json
import random

import pytest

from pantheon.chat.emitter import MAX_STOP, Delta, Emitter, finish_reason, join_deltas
from pantheon.chat.tools import (
    ParsedToolCall,
    ToolChoiceError,
    new_call_id,
    parse_tool_block,
    resolve_tool_choice,
)

from helpers.parsers import CALL_ID, run_parser


def run(chunks, **kw):
    """Feed ``chunks``; return (joined result without ids, emitter, all deltas)."""
    kw.setdefault("reasoning", True)
    return run_parser(Emitter, chunks, **kw)


def whole(text, **kw):
    return run([text], **kw)[0]


def chunkings(text, rng, n=30):
    yield list(text)  # char by char
    for _ in range(n):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 8))))
            if len(text) > 1
            else []
        )
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def assert_split_invariant(text, **kw):
    rng = random.Random(hash(text) & 0xFFFF)
    want, em_whole, _ = run([text], **kw)
    for chunks in chunkings(text, rng):
        got, em, _ = run(chunks, **kw)
        assert got == want, chunks
        assert em.stopped == em_whole.stopped
    # Every split point into two pieces.
    for i in range(len(text) + 1):
        got, _, _ = run([text[:i], text[i:]], **kw)
        assert got == want, i
    return want, em_whole


CORPUS = [
    "<think>\nLet me think about ça.\n</think>\n\nThe answer is 42 🙂.",
    "Plain answer, no thinking at all. <thi <tool <tool_ca done",
    "  <think>x</think>y",
    "<think>\n\n</think>\n\nEmpty thoughts.",
    '<think>a</think>Sure.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>\n',
    "Text <tool_call>{not json}</tool_call> more text",
    'Unclosed <tool_call>{"name": "f", "arguments": {"k": "v"}}',
    'Unclosed bad <tool_call>{"name": ',
    "你好<think>not at start</think>世界 <<tool_call>>",
    "<think>reasoning with STOP inside</think>content END here",
    "ends with partial marker <tool_ca",
    "ends in reasoning <think",
]

CONFIGS = [
    {},
    {"think_open": True},
    {"reasoning": False},
    {"tools_enabled": False},
    {"stop": ["STOP"]},
    {"stop": ["END", "42", "\n\n"]},
    {"stop": ["<tool", "ça"]},
    {"stop": ["</think>"]},
    {"stop": ["aa", "a", "re", "ere"]},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: json.dumps(c))
@pytest.mark.parametrize("text", CORPUS)
def test_any_split_gives_the_same_output(text, config):
    assert_split_invariant(text, **config)


def test_random_texts_split_invariant():
    rng = random.Random(7)
    atoms = [
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<",
        "</",
        "<t",
        "ST",
        "OP",
        "STOP",
        " ",
        "\n",
        "a",
        "é",
        "🙂",
        '{"name": "f", "arguments": {"x": 1}}',
        "{",
        "}",
        "\n\n",
    ]
    for _ in range(150):
        text = "".join(rng.choice(atoms) for _ in range(rng.randrange(1, 14)))
        config = rng.choice(CONFIGS + [{"stop": ["STOP", "OP<"]}])
        want, _ = assert_split_invariant(text, **config)
        # Markers never leak when they did their job.
        if not config.get("stop"):
            assert "</think>" not in want["reasoning"]


# ---------------------------------------------------------------------------- channels


def test_literal_think_at_start():
    out = whole("<think>\nLet me think.\nMore.\n</think>\n\nThe answer.")
    assert out == {"reasoning": "Let me think.\nMore.", "content": "The answer.", "tool_calls": []}


def test_think_open_from_prompt():
    out = whole("Let me think.\n</think>\n\nThe answer.", think_open=True)
    assert out["reasoning"] == "Let me think." and out["content"] == "The answer."
    # Reasoning never closed (cut by max_tokens): all of it is reasoning.
    out = whole("Still thinking...\n", think_open=True)
    assert out == {"reasoning": "Still thinking...", "content": "", "tool_calls": []}


def test_think_only_at_start_and_only_for_reasoning_models():
    assert whole("Hi <think>x</think>")["content"] == "Hi <think>x</think>"
    assert whole("<think>x</think>y", reasoning=False)["content"] == "<think>x</think>y"
    assert whole("\n <think>x</think>y") == {"reasoning": "x", "content": "y", "tool_calls": []}
    assert whole("<thinking>x")["content"] == "<thinking>x"
    assert whole("<thi")["content"] == "<thi"


def test_markers_are_never_emitted_and_content_streams_at_once():
    em = Emitter(reasoning=True, stop=["END"])
    assert em.feed("<thi") == []
    assert em.feed("nk>\nabc") == [Delta("reasoning", "abc")]
    assert em.feed("\n</th") == []  # "\n" may be the edge before </think>, "</th" a marker start
    assert em.feed("ink>\n\nHello") == [Delta("content", "Hello")]
    # Tools on: the trailing " " may be the edge before a <tool_call>; "E" may start "END".
    assert em.feed(" world E") == [Delta("content", " world")]
    assert em.feed("x") == [Delta("content", " Ex")]
    assert em.finish() == []


def test_no_hold_back_without_possible_marker():
    em = Emitter(reasoning=False, tools_enabled=False)
    assert em.feed("Hello \n") == [Delta("content", "Hello \n")]
    assert em.feed("<tool_call>") == [Delta("content", "<tool_call>")]


# ---------------------------------------------------------------------------- stop strings


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Plain content with stops: cut at the match that a left-to-right reader completes first."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(len(s) for s in hits)], True
    return text, False


def test_stop_string_at_every_position():
    text = "The quick brown fox — ça 🙂 jumps"
    for i in range(len(text)):
        for j in range(i + 1, min(len(text), i + 6) + 1):
            stop = text[i:j]
            want, stopped = reference_stop(text, [stop])
            for chunks in (
                [text],
                list(text),
                [text[: i + 1], text[i + 1 :]],
                [text[: j - 1], text[j - 1 :]],
            ):
                out, em, _ = run(chunks, reasoning=False, tools_enabled=False, stop=[stop])
                assert (out["content"], em.stopped) == (want, stopped), (stop, chunks)
                assert em.stop_string == stop


@pytest.mark.parametrize(
    "text,stops,want",
    [
        ("xabcdy", ["abcd", "bc"], "xa"),  # "bc" completes first
        ("xabcdy", ["bc", "abcd"], "xa"),
        ("xabcd", ["cd", "abcd"], "x"),  # both complete together: the longer (earlier) wins
        ("aaa", ["aa"], ""),
        ("hello world", ["wor", "orl", "o w"], "hell"),
        ("no match here", ["xyz", "zzz"], "no match here"),
        ("🙂🙃🙂", ["🙃"], "🙂"),
    ],
)
def test_overlapping_stop_strings(text, stops, want):
    for chunks in ([text], list(text)):
        out, em, _ = run(chunks, reasoning=False, tools_enabled=False, stop=stops)
        assert out["content"] == want
        assert em.stopped == (want != text)


def test_stop_inside_reasoning():
    out, em, _ = run(["<think>abc ST", "OP def</think>content"], stop=["STOP"])
    assert em.stopped
    assert out == {"reasoning": "abc ", "content": "", "tool_calls": []}


def test_stop_in_content_after_reasoning_and_nothing_after():
    em = Emitter(reasoning=True, stop=["\n\nUser:"])
    deltas = em.feed("<think>r</think>Answer.\n\nUs")
    assert not em.stopped
    deltas += em.feed("er: next question")
    assert em.stopped and em.stop_string == "\n\nUser:"
    assert em.feed("more") == [] and em.finish() == []
    assert join_deltas(deltas)["content"] == "Answer."


def test_stop_beats_marker_and_cuts_tool_block():
    assert whole("a <tool_call>{}", stop=["<tool"])["content"] == "a "
    out, em, _ = run(['<tool_call>{"name": "f", "arguments": {}}STOP</tool_call>'], stop=["STOP"])
    assert em.stopped and out["tool_calls"][0]["function"]["name"] == "f"
    out, em, _ = run(['<tool_call>{"name": "f", STOP'], stop=["STOP"])
    # cut inside the call: the call as far as it got, never its markup in the content
    assert (
        em.stopped
        and out["content"] == ""
        and out["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    )


def test_stop_limits():
    with pytest.raises(ValueError):
        Emitter(reasoning=False, stop=[str(i) for i in range(MAX_STOP + 1)])
    Emitter(reasoning=False, stop=["a", "b", "c", "d", "", "a"])  # empties and repeats do not count
    assert whole("abc", reasoning=False, stop=[""])["content"] == "abc"


# ---------------------------------------------------------------------------- tool calls


def test_one_tool_call():
    text = 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
    out, em, deltas = run([text], reasoning=False)
    assert out["content"] == "Let me check."
    assert out["tool_calls"] == [
        {
            "id": "ID",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'},
        }
    ]
    tool_deltas = [d for d in deltas if d.kind == "tool_call"]
    assert (
        tool_deltas[0].name == "get_weather" and tool_deltas[0].arguments == "" and tool_deltas[0].index == 0
    )
    assert len(tool_deltas) > 1 and all(d.name is None and d.id is None for d in tool_deltas[1:])
    assert em.finish_reason("stop") == "tool_calls"
    assert em.tool_calls[0]["function"]["arguments"] == '{"city": "Zürich", "days": 2}'


def test_two_tool_calls_after_reasoning():
    text = (
        "<think>\nNeed two lookups.\n</think>\n\n"
        '<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"b\\"}"}\n</tool_call>\n'
    )
    for chunks in ([text], list(text)):
        out, em, deltas = run(chunks)
        assert out["reasoning"] == "Need two lookups."
        assert out["content"] == ""
        assert [c["function"] for c in out["tool_calls"]] == [
            {"name": "search", "arguments": '{"q": "a"}'},
            {"name": "search", "arguments": '{"q": "b"}'},
        ]
        assert [d.index for d in deltas if d.kind == "tool_call" and d.name] == [0, 1]
        ids = [d.id for d in deltas if d.id]
        assert len(set(ids)) == 2


def test_malformed_tool_json_is_content():
    text = "Sure.\n<tool_call>\n{bad json}\n</tool_call>\nafter"
    out, em, _ = run([text], reasoning=False)
    assert out["content"] == text and out["tool_calls"] == []
    assert em.finish_reason("stop") == "stop"
    assert (
        whole('<tool_call>{"arguments": {}}</tool_call>')["content"]
        == '<tool_call>{"arguments": {}}</tool_call>'
    )


def test_unclosed_tool_block_at_the_end():
    out = whole('<tool_call>\n{"name": "f", "arguments": {"k": "v"}}\n')
    assert out["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"k": "v"}'}
    cut = whole('x <tool_call>{"name": "f"')
    assert cut["content"] == "x" and cut["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}


def test_tools_disabled_keeps_blocks_as_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    out, em, _ = run([text], reasoning=False, tools_enabled=False)
    assert out["content"] == text and not em.tool_calls


def test_unicode_everywhere():
    text = '<think>Réflexion 思考 🤔</think>Réponse : 答案 🙂 <tool_call>{"name": "dire", "arguments": {"mot": "héhé 🙂"}}</tool_call>'
    out, _ = assert_split_invariant(text)
    assert out["reasoning"] == "Réflexion 思考 🤔"
    assert out["content"] == "Réponse : 答案 🙂"
    assert out["tool_calls"][0]["function"]["arguments"] == '{"mot": "héhé 🙂"}'


def test_finish_reason_helper():
    assert finish_reason(True, "stop") == "tool_calls"
    assert finish_reason(False, "length") == "length"


# ---------------------------------------------------------------------------- tools.py


def test_parse_tool_block_forms():
    assert parse_tool_block('\n {"name": "f", "arguments": {"a": 1}} \n') == [ParsedToolCall("f", '{"a": 1}')]
    assert parse_tool_block('{"name": "f", "parameters": {"a": "é"}}') == [ParsedToolCall("f", '{"a": "é"}')]
    assert parse_tool_block('{"name": "f"}') == [ParsedToolCall("f", "{}")]
    assert parse_tool_block('{"name": "f", "arguments": "{\\"a\\": 1}"}') == [ParsedToolCall("f", '{"a": 1}')]
    assert parse_tool_block('```json\n{"name": "f", "arguments": {}}\n```') == [ParsedToolCall("f", "{}")]
    assert parse_tool_block('{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {}}') == [
        ParsedToolCall("f", "{}"),
        ParsedToolCall("g", "{}"),
    ]
    assert parse_tool_block('[{"name": "f", "arguments": {}}]') == [ParsedToolCall("f", "{}")]
    assert parse_tool_block('{"type": "function", "function": {"name": "f", "arguments": {}}}') == [
        ParsedToolCall("f", "{}")
    ]
    for bad in [
        "",
        "   ",
        "{",
        "[]",
        "42",
        '{"name": 3}',
        '{"name": ""}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f"} trailing',
    ]:
        assert parse_tool_block(bad) is None, bad


def test_call_ids():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(CALL_ID.fullmatch(i) for i in ids)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tool_choice():
    p = resolve_tool_choice([TOOL], None)
    assert (p.choice, p.parse, p.template_tools, p.required) == ("auto", True, [TOOL], False)
    p = resolve_tool_choice([TOOL], "none")
    assert (p.choice, p.parse, p.template_tools) == ("none", False, None)
    p = resolve_tool_choice([TOOL], "required")
    assert (p.choice, p.parse, p.required) == ("required", True, True)
    p = resolve_tool_choice([TOOL], {"type": "function", "function": {"name": "get_weather"}})
    assert (p.choice, p.function, p.required, p.template_tools) == ("function", "get_weather", True, [TOOL])
    p = resolve_tool_choice(None, None)
    assert (p.choice, p.parse, p.template_tools) == ("none", False, None)
    assert resolve_tool_choice([], "auto").parse is False
    for tools, choice in [
        (None, "required"),
        ([TOOL], "sometimes"),
        ([TOOL], {"type": "function", "function": {"name": "other"}}),
        ([TOOL], {"type": "function"}),
        ([TOOL], 3),
        ([{"type": "retrieval"}], "auto"),
        ([{"type": "function", "function": {}}], "auto"),
        ("not a list", "auto"),
    ]:
        with pytest.raises(ToolChoiceError):
            resolve_tool_choice(tools, choice)


# ---------------------------------------------------------------------------- with the detokenizer


def test_token_stream_through_detokenizer_and_emitter(tiny_model):
    from tokenizers import Tokenizer

    from pantheon.chat.detokenize import IncrementalDetokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = (
        "<think>\nIl faut chercher la météo à 東京 🌧.\n</think>\n\nJe regarde.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call><|im_end|>'
    )
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    em = Emitter(reasoning=True)
    deltas = []
    for i in ids:
        deltas += em.feed(detok.push(i))
    deltas += em.feed(detok.flush()) + em.finish()
    out = join_deltas(deltas)
    assert out["reasoning"] == "Il faut chercher la météo à 東京 🌧."
    assert out["content"] == "Je regarde."
    assert [c["function"] for c in out["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "東京"}'}
    ]
    assert em.finish_reason("stop") == "tool_calls"


# ------------------------------------------------------------- a call cut off at length


@pytest.mark.parametrize("tool_format", ["json", "xml"])
def test_a_call_cut_anywhere_is_the_same_streamed_or_not_and_never_markup(tool_format):
    """max_tokens may end the output at any character of a call: streamed (in any split) or
    not, the deltas join to the same message, the content never holds the markup, and the
    cut-off call is what it is: its name once written, its arguments so far (issue 26 §2)."""
    if tool_format == "json":
        text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
        args = '{"city": "Paris", "days": 2}'
    else:
        text = (
            "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
        )
        args = '{"city": "Paris", "days": 2}'
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    named_at = text.index("get_weather") + len("get_weather") + (1 if tool_format == "json" else 1)
    for cut in range(len(text) + 1):
        part = text[:cut]
        out, _ = assert_split_invariant(part, reasoning=False, tool_format=tool_format, tools=tools)
        assert "<t" not in out["content"] and "</" not in out["content"], (cut, out)
        if cut >= named_at:
            (call,) = out["tool_calls"]
            assert call["function"]["name"] == "get_weather", (cut, out)
            got = call["function"]["arguments"]
            if tool_format == "json":
                # the arguments so far, as written (compact once the call is whole)
                assert args.startswith(got) or json.loads(got) == json.loads(args), (cut, got)
            else:  # the parameters written so far (the XML parser takes an unclosed one as it is)
                assert set(json.loads(got)) <= set(json.loads(args)), (cut, got)
        elif "<tool_call>" in part:
            assert out["tool_calls"] == [], (cut, out)
