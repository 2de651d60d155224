"""Gemma 4's output format through a real ``pantheon serve`` and the official client.

``tiny-gemma4`` with Gemma 4's real chat template (from ../shared/specs) swapped in: its output is
forced (``guided_choice``) to a Gemma 4 text, spelled in the tiny tokenizer's tokens (its channel
markers made ordinary added tokens, as a byte-level grammar check can spell them; the call markers
are no tokens of it), so the whole router path runs (the template, the detokenizer, the parser the template picks, the response
builders): the thought channel comes back as ``reasoning_content``, ``<|tool_call>call:NAME{...}``
as ``tool_calls`` with JSON arguments, the rest as ``content``, streamed and not the same; a named
``tool_choice`` opens the call in the prompt and holds its arguments to the schema in Gemma's own
syntax.
"""

from __future__ import annotations

import json

import pytest

from helpers.one_model import ask_both, served, streamed_call, with_template
from helpers.paths import need_specs

pytestmark = pytest.mark.timeout(240)

NAME = "tiny-gemma4-chat"
ANSWER = "<|channel>thought\nThink.\n<channel|>Hi!"
CALLS = (
    "<|channel>thought\nLook.\n<channel|>"
    '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>'
    "<|tool_call>call:plan{opts:{deep:true,xs:[1,2.5]}}<tool_call|><|tool_response>"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
PLAN = {
    "type": "function",
    "function": {
        "name": "plan",
        "description": "A plan.",
        "parameters": {"type": "object", "properties": {}},
    },
}
CHANNEL_MARKERS = ("<|channel>", "<channel|>")
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    template = (need_specs() / "gemma-4-31B-it.chat_template.jinja").read_text(encoding="utf-8")
    base = tmp_path_factory.mktemp("gemma4chat")
    folder = with_template(model_factory("tiny-gemma4"), base / NAME, template, CHANNEL_MARKERS)
    args = ["--model", str(folder), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"]
    yield from served(args, base / "serve.log", (NAME,))


def _ask(srv, text: str, **kw):
    """The same request whole and streamed: (message, finish_reason, joined stream)."""
    return ask_both(srv, NAME, MESSAGES, text, **kw)


def test_thinking_and_an_answer(srv):
    msg, finish, streamed = _ask(srv, ANSWER)
    assert (msg.model_extra or {}).get("reasoning_content") == "Think."
    assert msg.content == "Hi!" and not msg.tool_calls
    assert finish == "stop"
    assert streamed == {"reasoning_content": "Think.", "content": "Hi!", "calls": {}, "finish": "stop"}


def test_two_calls_in_gemmas_syntax(srv):
    msg, finish, streamed = _ask(srv, CALLS, tools=[WEATHER, PLAN])
    assert (msg.model_extra or {}).get("reasoning_content") == "Look."
    assert not msg.content and msg.tool_calls is not None
    want = [
        ("get_weather", '{"city": "Oslo", "days": 2}'),
        ("plan", '{"opts": {"deep": true, "xs": [1, 2.5]}}'),
    ]
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == want
    assert finish == "tool_calls"
    assert streamed["calls"] == {i: {"name": n, "arguments": a} for i, (n, a) in enumerate(want)}
    assert (
        streamed["finish"] == "tool_calls"
        and streamed["reasoning_content"] == "Look."
        and not streamed["content"]
    )


def test_a_call_cut_off_by_max_tokens_is_no_markup(srv):
    msg, finish, streamed = _ask(srv, CALLS, tools=[WEATHER, PLAN], max_tokens=30)
    assert finish == "length" and streamed["finish"] == "length"
    assert "<|" not in (msg.content or "") and "<|" not in streamed["content"]


PICK = {
    "type": "function",
    "function": {
        "name": "pick_city",
        "description": "Pick a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Paris"]}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
        },
    },
}
SWITCH = {
    "type": "function",
    "function": {
        "name": "switch",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    },
}


def test_required_with_two_tools_writes_one_of_them(srv):
    """The prompt opens ``<|tool_call>call:``; the grammar names one of the tools and holds its
    arguments (the schemas here are bounded, so a random model ends its call quickly)."""
    client = srv.client()
    body = dict(model=NAME, messages=MESSAGES, max_tokens=40, tools=[PICK, SWITCH], tool_choice="required")
    (ch,) = client.chat.completions.create(**body).choices
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls is not None and not ch.message.content
    ((name, args),) = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    assert (name, sorted(args)) in (("pick_city", ["city", "metric"]), ("switch", ["on"]))


def test_a_named_tool_choice_writes_the_call(srv):
    """The prompt opens ``<|tool_call>call:pick_city{``; the grammar holds the arguments to the
    schema, in Gemma 4's syntax; they come back as JSON."""
    tool = PICK
    choice = {"type": "function", "function": {"name": "pick_city"}}
    client = srv.client()
    body = dict(model=NAME, messages=MESSAGES, max_tokens=40, tools=[WEATHER, tool], tool_choice=choice)
    (ch,) = client.chat.completions.create(**body).choices
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls is not None
    ((name, args),) = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    args = json.loads(args)
    assert name == "pick_city" and args["city"] in ("Oslo", "Paris") and isinstance(args["metric"], bool)
    streamed = streamed_call(srv, body)
    assert streamed["name"] == "pick_city" and json.loads(streamed["arguments"])["city"] in ("Oslo", "Paris")
