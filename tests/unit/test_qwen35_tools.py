"""Qwen3.5 through the chat API: its real chat template (thinking on by default, tools and past
calls in its XML form), its XML tool calls read back into OpenAI ``tool_calls`` (whole and
streamed), the grammar that forces such a call, and the router's request path wired to all three.

The template is read from the shared specs (``../shared/specs``), never copied into the repo."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest
from test_structured_router import accepts

from pantheon.api import structured
from pantheon.api.openai import protocol as oa
from pantheon.chat.emitter import Emitter, join_deltas
from pantheon.chat.template import ChatTemplate, think_open
from pantheon.chat.tools import (
    HARMONY_TOOL_FORMAT,
    JSON_TOOL_FORMAT,
    XML_TOOL_FORMAT,
    ParsedToolCall,
    forced_call_prefix,
    tool_call_format,
)
from pantheon.chat.xml_tools import convert_value, parse_xml_tool_block
from pantheon.core.protocol import TokenOut

from helpers.chat_template import hf_render as shared_hf_render
from helpers.instances import ready_instance
from helpers.paths import SPECS, need_specs

QWEN35 = SPECS / "qwen3.5-4B.chat_template.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TYPED = {
    "type": "function",
    "function": {
        "name": "typed",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "x": {"type": "number"},
                "ok": {"type": "boolean"},
                "obj": {"type": "object"},
                "arr": {"type": "array", "items": {"type": "integer"}},
                "maybe": {"type": ["integer", "null"]},
                "s": {"type": "string"},
                "free": {},
            },
        },
    },
}
TOOLS = [WEATHER, TYPED]

CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"  # fmt: skip
CALL_ARGS = '{"city": "Paris", "days": 3}'
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


@pytest.fixture(scope="module")
def qwen35() -> ChatTemplate:
    need_specs()
    return ChatTemplate(QWEN35.read_text(encoding="utf-8"), eos_token="<|im_end|>")


def hf_render(template: str, messages, **kw) -> str:
    """What transformers itself renders (Qwen3.5's tokenizer has no BOS)."""
    return shared_hf_render(template, messages, bos=None, eos="<|im_end|>", **kw)


def emit(chunks, *, tools=TOOLS, **kw) -> dict:
    """Feed ``chunks`` to a Qwen3.5 emitter; the joined message, call ids replaced by "ID"."""
    kw.setdefault("reasoning", True)
    em = Emitter(tool_format=XML_TOOL_FORMAT, tools=tools, **kw)
    deltas = [d for c in chunks for d in em.feed(c)] + em.finish()
    out = join_deltas(deltas)
    for call in out["tool_calls"]:
        assert CALL_ID.fullmatch(call["id"]), call
        call["id"] = "ID"
    out["finish"] = em.finish_reason("stop")
    return out


def calls(out: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out["tool_calls"]]


# ---------------------------------------------------------------------------- the template


def test_thinking_is_on_by_default_and_enable_thinking_false_turns_it_off(qwen35):
    msgs = [{"role": "user", "content": "Bonjour"}]
    on = qwen35.render(msgs)
    assert on.endswith("<|im_start|>user\nBonjour<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert think_open(on)
    off = qwen35.render(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think_open(off)
    assert on == hf_render(QWEN35.read_text(), msgs)
    assert off == hf_render(QWEN35.read_text(), msgs, enable_thinking=False)


def test_reasoning_before_the_close_goes_to_reasoning_content(qwen35):
    prompt = qwen35.render([{"role": "user", "content": "2+2?"}])
    out = emit(["Two plus", " two.\n</thi", "nk>\n\nFour."], think_open=think_open(prompt))
    assert (out["reasoning"], out["content"]) == ("Two plus two.", "Four.")
    prompt = qwen35.render([{"role": "user", "content": "2+2?"}], enable_thinking=False)
    out = emit(["Four."], think_open=think_open(prompt))
    assert (out["reasoning"], out["content"]) == ("", "Four.")


def test_tools_and_past_calls_render_as_the_template_expects(qwen35):
    """OpenAI clients send a call's arguments as JSON text and its content as null; the template
    iterates ``arguments|items`` (a mapping) and types nothing itself."""
    args = {"city": "Zürich", "days": 3, "opts": {"a": [1, 2]}}
    openai_msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    got = qwen35.render(openai_msgs, tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in got
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
    ) in got
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in got
    assert got.endswith("<|im_start|>assistant\n<think>\n")
    hf_msgs = json.loads(json.dumps(openai_msgs))
    hf_msgs[2]["content"] = ""
    hf_msgs[2]["tool_calls"][0]["function"]["arguments"] = args
    assert got == hf_render(QWEN35.read_text(), hf_msgs, tools=[WEATHER])


def test_the_format_is_chosen_from_the_template(qwen35):
    need_specs()
    assert qwen35.tool_format == XML_TOOL_FORMAT
    for other, fmt in (("qwen3-0.6B", JSON_TOOL_FORMAT), ("llama-3.3-70B-Instruct", "llama3")):
        source = (SPECS / f"{other}.chat_template.jinja").read_text(encoding="utf-8")
        assert ChatTemplate(source).tool_format == fmt, other
    # gpt-oss writes no <tool_call> block at all: Harmony messages (tests/unit/test_harmony.py)
    source = (SPECS / "gpt-oss-120b.chat_template.jinja").read_text(encoding="utf-8")
    assert ChatTemplate(source).tool_format == HARMONY_TOOL_FORMAT
    # nor does Gemma 4: <|tool_call>call:NAME{...} in its own syntax (tests/unit/test_gemma4_output.py)
    source = (SPECS / "gemma-4-31B-it.chat_template.jinja").read_text(encoding="utf-8")
    assert ChatTemplate(source).tool_format == "gemma4"
    assert ChatTemplate().tool_format == JSON_TOOL_FORMAT  # the ChatML fallback
    # a tool_use template is the one that renders tools, so it decides
    assert ChatTemplate("{{ messages }}", tool_use_template=qwen35.source).tool_format == XML_TOOL_FORMAT
    assert tool_call_format("<function=f> alone, as Llama 3.1 mentions it") == JSON_TOOL_FORMAT
    assert forced_call_prefix(XML_TOOL_FORMAT, "f") == "<tool_call>\n<function=f>\n"
    assert forced_call_prefix(JSON_TOOL_FORMAT, "f") == '<tool_call>\n{"name": "f", "arguments": '
    assert forced_call_prefix(XML_TOOL_FORMAT, None) == forced_call_prefix(JSON_TOOL_FORMAT, None)


# ---------------------------------------------------------------------------- reading calls


def test_one_call_with_text_before_it():
    out = emit(["Let me check.\n\n" + CALL], think_open=False, reasoning=False)
    assert out["content"] == "Let me check."
    assert out["tool_calls"] == [
        {"id": "ID", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}
    ]
    assert out["finish"] == "tool_calls"


def test_two_calls_after_reasoning_in_two_blocks_and_in_one():
    second = CALL.replace("Paris", "Lyon").replace("3", "5")
    out = emit(["I need both.\n</think>\n\n" + CALL + "\n" + second], think_open=True)
    assert out["reasoning"] == "I need both." and out["content"] == ""
    assert calls(out) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Lyon", "days": 5}),
    ]
    one_block = CALL.replace(
        "</function>\n</tool_call>", "</function>\n<function=typed>\n</function>\n</tool_call>"
    )
    assert calls(emit([one_block], reasoning=False)) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("typed", {}),
    ]


def test_values_are_typed_by_the_schema_when_they_parse_as_that_type():
    block = (
        "<function=typed>\n"
        "<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
        "<parameter=ok>\nTrue\n</parameter>\n<parameter=obj>\n{\"k\": [1, null]}\n</parameter>\n"
        "<parameter=arr>\n[1, 2]\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
        "<parameter=s>\n007\n</parameter>\n<parameter=free>\n12\n</parameter>\n"
        "<parameter=unknown>\ntrue\n</parameter>\n"
        "</function>"
    )  # fmt: skip
    (call,) = parse_xml_tool_block(block, TOOLS) or []
    assert call.name == "typed"
    assert json.loads(call.arguments) == {
        "n": 42, "x": 2.5, "ok": True, "obj": {"k": [1, None]}, "arr": [1, 2], "maybe": None,
        "s": "007",  # a string stays the text the model wrote
        "free": "12",  # a schema that names no type: text, as vLLM
        "unknown": "true",  # not in the schema: text
    }  # fmt: skip
    # text that is not of the declared type stays text: the call is kept, the client sees what was written
    schemas = TYPED["function"]["parameters"]["properties"]
    for name, text in [
        ("n", "forty"),
        ("n", "4.5"),
        ("x", "NaN"),
        ("ok", "yes"),
        ("obj", "[1]"),
        ("arr", "{}"),
    ]:
        assert convert_value(text, schemas[name]) == text, (name, text)
    assert convert_value("3.0", schemas["n"]) == 3 and isinstance(convert_value("3.0", schemas["n"]), int)
    assert convert_value("7", schemas["x"]) == 7
    assert convert_value("null", {"type": ["string", "null"]}) is None
    assert convert_value("null", {"type": "string"}) == "null"
    assert convert_value("2", {"enum": [1, 2]}) == 2  # the type read off the enum values


def test_a_values_own_newlines_and_markup_like_text_survive():
    block = "<function=get_weather>\n<parameter=city>\n\nline 1\n  line 2 <b>&\n\n</parameter>\n</function>"
    assert parse_xml_tool_block(block, TOOLS) == [
        ParsedToolCall("get_weather", json.dumps({"city": "\nline 1\n  line 2 <b>&\n"}))
    ]


def test_missing_closing_tags_are_tolerated_as_vllm_does():
    block = "<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n"
    assert parse_xml_tool_block(block, TOOLS) == [ParsedToolCall("get_weather", CALL_ARGS)]
    out = emit([CALL.removesuffix("</function>\n</tool_call>")], reasoning=False)  # cut off at the end
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})] and out["content"] == ""


@pytest.mark.parametrize(
    "inside",
    [
        "",
        "   \n",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # the JSON format
        "<function=>\n</function>",  # no name
        "<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>",  # tag not closed
        "I will call it: <function=get_weather>\n</function>",  # text before the function
        "<function=get_weather>\nstray <parameter=city>\nParis\n</parameter>\n</function>",
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\ntrailing",
        "<function=get_weather>\n<parameter=>\nParis\n</parameter>\n</function>",  # no parameter name
    ],
)
def test_malformed_blocks_are_content_as_written(inside):
    assert parse_xml_tool_block(inside, TOOLS) is None
    text = "Before. <tool_call>\n" + inside + "\n</tool_call> after"
    out = emit([text], reasoning=False)
    assert out["tool_calls"] == [] and out["content"] == text and out["finish"] == "stop"


def test_garbage_never_raises():
    rng = random.Random(7)
    alphabet = ["<", ">", "/", "=", "\n", " ", "a", "{", "}", '"', "<function=", "</function>",
                "<parameter=", "</parameter>", "<tool_call>", "</tool_call>", "null", "1"]  # fmt: skip
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        parse_xml_tool_block(text, TOOLS)
        out = emit([text], reasoning=False)
        for _name, args in calls(out):
            assert isinstance(args, dict)


def test_streamed_in_any_split_equals_the_whole():
    text = "Sure.\n" + CALL.replace("Paris", "Saint-Étienne 🙂") + "\nDone."
    whole = emit([text], reasoning=False)
    assert calls(whole) == [("get_weather", {"city": "Saint-Étienne 🙂", "days": 3})]
    assert whole["content"] == "Sure.Done."
    for i in range(len(text) + 1):  # every split into two pieces
        assert emit([text[:i], text[i:]], reasoning=False) == whole, i
    assert emit(list(text), reasoning=False) == whole  # and one character at a time
    for chunks in (list(text), [text[:40], text[40:90], text[90:]]):
        deltas = []
        em = Emitter(reasoning=False, tool_format=XML_TOOL_FORMAT, tools=TOOLS)
        for c in chunks:
            deltas += em.feed(c)
        deltas += em.finish()
        shown = "".join(d.text for d in deltas if d.kind == "content")
        assert "<" not in shown and "Paris" not in shown  # no markup leaks into content


def test_the_json_format_stays_the_default():
    json_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    em = Emitter(reasoning=False)
    assert em.tool_format == JSON_TOOL_FORMAT
    assert join_deltas(em.feed(json_call) + em.finish())["tool_calls"][0]["function"]["name"] == "get_weather"
    em = Emitter(reasoning=False)
    assert join_deltas(em.feed(CALL) + em.finish())["content"] == CALL  # XML is not JSON
    with pytest.raises(ValueError):
        Emitter(reasoning=False, tool_format="yaml")


# ---------------------------------------------------------------------------- forcing a call


def test_a_named_tools_grammar_accepts_its_xml_call_only():
    named = structured.tool_grammar([WEATHER], "get_weather", "<tool_call>\n", XML_TOOL_FORMAT)
    after = CALL.removeprefix("<tool_call>\n")
    assert accepts(named, after)
    assert accepts(named, after.replace("<parameter=days>\n3\n</parameter>\n", ""))  # days is optional
    assert not accepts(named, '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts(named, after.replace("get_weather", "get_wether"))
    assert not accepts(named, after.replace("<parameter=city>\nParis\n</parameter>\n", ""))  # required
    assert not accepts(named, after.replace("\n3\n", "\nthree\n"))  # an integer
    assert not accepts(named, after.replace("days", "weeks"))  # names come from the schema
    unit = after.replace("</function>", "<parameter=unit>\nc\n</parameter>\n</function>")
    assert accepts(named, unit) and not accepts(named, unit.replace("\nc\n", "\nk\n"))  # the enum


def test_the_grammar_follows_what_the_prompt_already_opened():
    body = CALL.removeprefix("<tool_call>\n<function=get_weather>\n")
    opened = structured.tool_grammar(
        TOOLS, "get_weather", forced_call_prefix(XML_TOOL_FORMAT, "get_weather"), "xml"
    )
    assert accepts(opened, body) and not accepts(opened, CALL)
    anyone = structured.tool_grammar(TOOLS, None, "<tool_call>\n", XML_TOOL_FORMAT)
    assert accepts(anyone, CALL.removeprefix("<tool_call>\n"))
    assert accepts(anyone, "<function=typed>\n<parameter=ok>\ntrue\n</parameter>\n</function>\n</tool_call>")
    assert not accepts(anyone, "<function=other>\n</function>\n</tool_call>")
    bare = structured.tool_grammar(TOOLS, None, "", XML_TOOL_FORMAT)  # no markup in the prompt yet
    assert accepts(bare, CALL) and not accepts(bare, CALL.removeprefix("<tool_call>\n"))


def test_what_the_grammar_accepts_parses_back_to_the_call():
    text = (
        "<tool_call>\n<function=typed>\n<parameter=n>\n-4\n</parameter>\n<parameter=obj>\n"
        '{"a": {"b": [true]}}\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n'
        "<parameter=s>\n{not json}\n</parameter>\n</function>\n</tool_call>"
    )
    assert accepts(structured.tool_grammar([TYPED], "typed", "", XML_TOOL_FORMAT), text)
    assert calls(emit([text], reasoning=False)) == [
        ("typed", {"n": -4, "obj": {"a": {"b": [True]}}, "maybe": None, "s": "{not json}"})
    ]


def test_schemas_with_refs_and_no_properties_compile():
    ref_tool = {"type": "function", "function": {"name": "r", "parameters": {
        "type": "object", "$defs": {"P": {"type": "object", "properties": {"q": {"type": "integer"}}}},
        "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}}}  # fmt: skip
    g = structured.tool_grammar([ref_tool], "r", "<tool_call>\n", XML_TOOL_FORMAT)
    assert accepts(g, '<function=r>\n<parameter=p>\n{"q": 1}\n</parameter>\n</function>\n</tool_call>')
    assert not accepts(g, '<function=r>\n<parameter=p>\n{"q": "1"}\n</parameter>\n</function>\n</tool_call>')
    (call,) = (
        parse_xml_tool_block('<function=r>\n<parameter=p>\n{"q": 1}\n</parameter>\n</function>', [ref_tool])
        or []
    )
    assert json.loads(call.arguments) == {"p": {"q": 1}}  # typed through the $ref
    assert convert_value("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 5
    # a union with a string: JSON of its other type is typed (llama.cpp's test-chat.cpp reading)
    assert convert_value("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 5
    assert convert_value("5 apples", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "5 apples"
    free = {"type": "function", "function": {"name": "free"}}  # no parameters declared: any, as text
    g = structured.tool_grammar([free], "free", "<tool_call>\n", XML_TOOL_FORMAT)
    assert accepts(g, "<function=free>\n<parameter=any>\nx\n</parameter>\n</function>\n</tool_call>")
    assert accepts(g, "<function=free>\n</function>\n</tool_call>")


# ---------------------------------------------------------------------------- the request path


class _Stream:
    """A worker's answer, one token per batch, as the pool's RequestStream gives them."""

    def __init__(self, sub, ids):
        self.toks = [TokenOut(sub.request_id, t) for t in ids]
        self.toks[-1].finish = "stop"

    async def next_batch(self):
        return [self.toks.pop(0)] if self.toks else []

    def abort(self):
        pass


class _Pool:
    """Answers every request with the tokens of ``answer``; keeps the Submits it got."""

    def __init__(self, assets, answer: str):
        self.assets, self.answer, self.subs = assets, answer, []

    def submit(self, die, sub):
        self.subs.append(sub)
        return _Stream(sub, self.assets.encode(self.answer))


@pytest.fixture(scope="module")
def qwen35_assets(tiny_model, qwen35):
    """The tiny test model's tokenizer with Qwen3.5's chat template."""
    from pantheon.models.assets import ModelAssets

    assets = ModelAssets(tiny_model)
    assets.template = qwen35
    assets.reasoning = True
    return assets


def _generate(assets, body, answer, *, prep=None, stream=False):
    from pantheon.api.generation import Generation
    from pantheon.control.context import fit_context

    req = oa.parse_chat_request({"messages": [{"role": "user", "content": "weather in Paris?"}], **body})
    prep = prep or fit_context(assets, req, 4096)
    pool = _Pool(assets, answer)
    inst = ready_instance(assets, "qwen35")
    gen = Generation(pool, inst, req, prep, "fp")

    async def collect():
        if not stream:
            return await gen.complete()
        return [chunk async for chunk in gen.stream_chunks()]

    return asyncio.run(collect()), pool, prep


def _streamed_message(chunks: list[bytes]) -> dict:
    msg = {"reasoning": "", "content": "", "calls": {}}
    for raw in chunks:
        data = raw.decode().removeprefix("data: ").strip()
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            delta = choice["delta"]
            msg["reasoning"] += delta.get("reasoning_content") or ""
            msg["content"] += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = msg["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"].get("arguments") or ""
            if choice.get("finish_reason"):
                msg["finish"] = choice["finish_reason"]
    return msg


def test_auto_tool_call_whole_and_streamed(qwen35_assets):
    answer = "The user wants the weather.\n</think>\n\nChecking.\n\n" + CALL
    body, pool, prep = _generate(qwen35_assets, {"tools": TOOLS}, answer)
    assert prep.think_open and pool.subs[0].params.grammar is None
    (choice,) = body["choices"]
    msg = choice["message"]
    assert msg["reasoning_content"] == "The user wants the weather." and msg["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", CALL_ARGS)
    ]
    assert choice["finish_reason"] == "tool_calls"
    chunks, _, _ = _generate(qwen35_assets, {"tools": TOOLS, "stream": True}, answer, stream=True)
    streamed = _streamed_message(chunks)
    assert streamed == {
        "reasoning": "The user wants the weather.",
        "content": "Checking.",
        "calls": {0: {"name": "get_weather", "arguments": CALL_ARGS}},
        "finish": "tool_calls",
    }


def test_required_constrains_to_an_xml_call_of_any_tool(qwen35_assets):
    answer = CALL.removeprefix("<tool_call>\n")  # the prompt holds the opening
    body, pool, prep = _generate(qwen35_assets, {"tools": TOOLS, "tool_choice": "required"}, answer)
    grammar = pool.subs[0].params.grammar
    assert prep.prefix == "<tool_call>\n" and grammar
    assert accepts(grammar, answer)
    assert not accepts(grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    msg = body["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", CALL_ARGS)
    ]
    assert not msg["content"]


def test_a_named_call_opened_in_the_xml_form_is_constrained_and_read_as_xml(qwen35_assets):
    from pantheon.control.context import Prepared

    prefix = forced_call_prefix(XML_TOOL_FORMAT, "get_weather")
    tools_req = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    prompt_ids = qwen35_assets.encode(
        qwen35_assets.template.render([{"role": "user", "content": "x"}]) + prefix
    )
    prep = Prepared(prompt_ids, prefix, False, 256, "get_weather")
    answer = CALL.removeprefix("<tool_call>\n<function=get_weather>\n")
    for stream in (False, True):
        out, pool, _ = _generate(
            qwen35_assets, dict(tools_req, stream=stream), answer, prep=prep, stream=stream
        )
        grammar = pool.subs[0].params.grammar
        assert accepts(grammar, answer) and not accepts(grammar, '{"city": "Paris"}}\n</tool_call>')
        if stream:
            assert _streamed_message(out)["calls"] == {0: {"name": "get_weather", "arguments": CALL_ARGS}}
        else:
            (call,) = out["choices"][0]["message"]["tool_calls"]
            assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", CALL_ARGS)
            assert out["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_call_continues_whatever_form_the_prompt_opened(qwen35_assets):
    """The prompt's opening is written by ``pantheon.control.context``; the grammar and the reader
    follow it, in either format, so the call always comes back whole."""

    from pantheon.control.context import fit_context

    tools_req = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    req = oa.parse_chat_request({"messages": [{"role": "user", "content": "weather in Paris?"}], **tools_req})
    prep = fit_context(qwen35_assets, req, 4096)
    if prep.prefix == forced_call_prefix(XML_TOOL_FORMAT, "get_weather"):
        answer = CALL.removeprefix("<tool_call>\n<function=get_weather>\n")
    else:  # the JSON opening, with the arguments object open
        assert prep.prefix == forced_call_prefix(JSON_TOOL_FORMAT, "get_weather")
        answer = '{"city": "Paris", "days": 3}}\n</tool_call>'
    body, pool, _ = _generate(qwen35_assets, tools_req, answer, prep=prep)
    assert accepts(pool.subs[0].params.grammar, answer)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
