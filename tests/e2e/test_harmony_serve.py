"""gpt-oss's Harmony format through a real ``pantheon serve`` and the official client.

The ``tiny`` model with gpt-oss's chat template (from ../shared/specs): its output is forced
(``guided_choice``) to a Harmony text, spelled in the tiny tokenizer's ordinary tokens, so the
whole router path runs (template, detokenizer, the parser the template picks, the chat
response builders): analysis comes back as ``reasoning_content``, final as ``content``, a message
to ``functions.NAME`` as ``tool_calls``, streamed and not the same.
"""

from __future__ import annotations

import json

import pytest

from helpers.one_model import ask_both, served, streamed_call, with_template
from helpers.paths import need_specs

pytestmark = pytest.mark.timeout(240)

NAME = "tiny-harmony"
ANSWER = (
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Look.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    template = (need_specs() / "gpt-oss-120b.chat_template.jinja").read_text(encoding="utf-8")
    base = tmp_path_factory.mktemp("harmony")
    folder = with_template(model_factory("tiny"), base / NAME, template)
    yield from served(["--model", str(folder), "--name", NAME], base / "serve.log", (NAME,))


def _ask(srv, text: str, **kw):
    """The same request whole and streamed: (message, finish_reason, joined stream)."""
    return ask_both(srv, NAME, MESSAGES, text, **kw)


def test_analysis_and_final(srv):
    msg, finish, streamed = _ask(srv, ANSWER)
    assert (msg.model_extra or {}).get("reasoning_content") == "Think."
    assert msg.content == "Hi!" and not msg.tool_calls
    assert finish == "stop"
    assert streamed == {"reasoning_content": "Think.", "content": "Hi!", "calls": {}, "finish": "stop"}


def test_a_call(srv):
    msg, finish, streamed = _ask(srv, CALL, tools=[WEATHER])
    assert (msg.model_extra or {}).get("reasoning_content") == "Look."
    assert not msg.content
    assert msg.tool_calls is not None
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    assert finish == "tool_calls"
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert streamed["finish"] == "tool_calls" and streamed["reasoning_content"] == "Look."


def test_a_named_tool_choice_writes_the_call(srv):
    """The prompt opens the call's header; the grammar holds the arguments to the schema."""
    tool = {
        "type": "function",
        "function": {
            "name": "pick_city",
            "description": "Pick a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Oslo", "Paris"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    choice = {"type": "function", "function": {"name": "pick_city"}}
    client = srv.client()
    body = dict(model=NAME, messages=MESSAGES, max_tokens=40, tools=[WEATHER, tool], tool_choice=choice)
    (ch,) = client.chat.completions.create(**body).choices
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls is not None
    ((name, args),) = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    assert name == "pick_city" and json.loads(args)["city"] in ("Oslo", "Paris")
    streamed = streamed_call(srv, body)
    assert streamed["name"] == "pick_city" and json.loads(streamed["arguments"])["city"] in ("Oslo", "Paris")
