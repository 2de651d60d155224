"""The Responses API's pure half (pantheon/api/openai/responses.py): input items -> chat
messages, flat tools -> chat tools, ``text.format`` -> ``response_format``, the refusals and
the renamed chat errors, and the output builder's items and events (validated as the SDK's
types), including a stream that fails midway."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pantheon.api.generation import Piece
from pantheon.api.openai import responses as R
from pantheon.chat.emitter import Delta
from pantheon.control.context import Prepared
from pantheon.errors import ApiError

EVENT = TypeAdapter(ResponseStreamEvent)


def test_a_string_input_is_one_user_message_after_the_instructions():
    msgs, where = R.input_messages("hi", "be brief")
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert where == ["instructions", "input"]


def test_items_map_to_the_chat_templates_messages():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "call_3", "name": "f", "arguments": "{}"},
    ]  # fmt: skip
    msgs, where = R.input_messages(items)
    assert msgs == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "one", "name": "f"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two", "name": "g"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]
    assert where == ["input[0]", "input[1]", "input[3]", "input[6]", "input[7]", "input[8]"]


@pytest.mark.parametrize(
    "items, param",
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "input[0].content[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"role": "user"}], "input[0].content"),
        ([{"role": "user", "content": []}], "input[0].content"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], "input[0].arguments"),
        ([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}],
         "input[0].output[0].type"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        ([{"type": "computer_call"}], "input[0].type"),
        ([{"content": "no role"}], "input[0].type"),
        (["text"], "input[0]"),
        ([], "input"),
        ([{"type": "reasoning", "summary": []}], "input"),
        (None, "input"),
    ],
)  # fmt: skip
def test_unsupported_items_are_400s_naming_them(items, param):
    with pytest.raises(ApiError) as e:
        R.input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_flat_function_tools_and_tool_choice_map_to_chats():
    tools = [
        {
            "type": "function",
            "name": "f",
            "description": "d",
            "parameters": {"type": "object"},
            "strict": True,
        }
    ]
    assert R.chat_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert R.chat_tools([{"type": "function", "name": "g", "parameters": None}]) == [
        {"type": "function", "function": {"name": "g"}}
    ]
    for choice in ("auto", "none", "required", None):
        assert R.chat_tool_choice(choice) == choice
    assert R.chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    for bad, param in (
        ([{"type": "web_search"}], "tools[0].type"),
        ([{"type": "file_search", "vector_store_ids": []}], "tools[0].type"),
        ({"type": "function"}, "tools"),
    ):
        with pytest.raises(ApiError) as e:
            R.chat_tools(bad)
        assert e.value.param == param
    for bad, param in (
        ({"type": "allowed_tools"}, "tool_choice"),
        ({"type": "function"}, "tool_choice.name"),
    ):
        with pytest.raises(ApiError) as e:
            R.chat_tool_choice(bad)
        assert e.value.param == param


def test_text_format_maps_to_response_format():
    assert R.chat_format(None) is None and R.chat_format({"verbosity": "low"}) is None
    assert R.chat_format({"format": {"type": "text"}}) == {"type": "text"}
    assert R.chat_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    fmt = {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}
    assert R.chat_format({"format": fmt}) == {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
    }
    req = R.parse_responses_request({"input": "x", "text": {"format": fmt}})
    assert req.chat.response_format == "json_schema" and req.chat.grammar
    assert req.echo["text"] == {"format": fmt}


def test_the_chat_request_and_the_echo():
    body = {
        "model": "m",
        "input": "x",
        "max_output_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "user": "u",
        "store": True,
        "metadata": {"a": "b"},
        "reasoning": {"effort": "low"},
        "parallel_tool_calls": False,
        "prompt_cache_key": "k",
        "seed": 3,
        "stream": True,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
        "tool_choice": {"type": "function", "name": "f"},
    }
    req = R.parse_responses_request(json.dumps(body))
    c = req.chat
    assert (c.model, c.max_tokens, c.temperature, c.top_p, c.user, c.seed, c.stream) == (
        "m",
        7,
        0.5,
        0.9,
        "u",
        3,
        True,
    )
    assert c.session_id == "k" and c.tool_choice == "function" and c.tool_choice_name == "f"
    e = req.echo
    assert e["store"] is False and e["metadata"] == {"a": "b"} and e["max_output_tokens"] == 7
    assert e["parallel_tool_calls"] is False and e["tool_choice"] == {"type": "function", "name": "f"}
    assert e["tools"][0] == {"type": "function", "name": "f", "description": None,
                             "parameters": {"type": "object", "properties": {}}, "strict": True}  # fmt: skip


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "r"}, "previous_response_id"),
        ({"conversation": {"id": "c"}}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"n": 2}, "n"),
        ({"max_tool_calls": 1}, "max_tool_calls"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"top_p": 2}, "top_p"),
        ({"instructions": 5}, "instructions"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}], "tool_choice": "required"},
         "tools[0].parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]}, "input[1].content"),
    ],
)  # fmt: skip
def test_refusals_and_chat_errors_name_the_responses_param(extra, param):
    with pytest.raises(ApiError) as e:
        R.parse_responses_request({"input": "hi", **extra})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_accepted_fields_that_change_nothing():
    req = R.parse_responses_request(
        {"input": "hi", "store": False, "background": False, "n": 1, "include": ["reasoning.encrypted_content"],
         "truncation": "auto", "service_tier": "auto", "safety_identifier": "s", "stream_options": {}}
    )  # fmt: skip
    assert req.chat.messages == [{"role": "user", "content": "hi"}]


def _response(b: R.OutputBuilder, status: str = "completed") -> Response:
    echo = R.parse_responses_request({"input": "x"}).echo
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens_details": {"reasoning_tokens": 2}}  # fmt: skip
    body = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": "m",
        "output": b.output,
        "usage": R.response_usage(usage),
        **echo,
    }
    return Response.model_validate(body)


def _events(evs: list[dict]) -> list[str]:
    for i, e in enumerate(evs):
        EVENT.validate_python({**e, "sequence_number": i})
    return [e["type"] for e in evs]


def test_the_builder_makes_reasoning_message_and_call_items():
    b = R.OutputBuilder()
    evs = b.feed([Delta("reasoning", "think"), Delta("reasoning", " more"), Delta("content", "\n\n")])
    evs += b.feed([Delta("content", "Hi"), Delta("content", " there"), Delta("content", "\n")])
    evs += b.feed(
        [
            Delta("tool_call", index=0, id="call_a", name="f", arguments=""),
            Delta("tool_call", index=0, arguments='{"x"'),
        ]
    )
    evs += b.feed(
        [
            Delta("tool_call", index=0, arguments=": 1}"),
            Delta("tool_call", index=1, id="call_b", name="g", arguments="{}"),
        ]
    )
    evs += b.finish()
    assert _events(evs) == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip
    r = _response(b)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "think more"
    assert r.output_text == "\n\nHi there\n"  # the message's whitespace is the model's
    calls = r.output[2:]
    assert [(c.call_id, c.name, c.arguments, c.status) for c in calls] == [
        ("call_a", "f", '{"x": 1}', "completed"),
        ("call_b", "g", "{}", "completed"),
    ]
    assert all(c.id.startswith("fc_") for c in calls) and r.output[1].id.startswith("msg_")
    assert (
        r.usage.input_tokens_details.cached_tokens == 1
        and r.usage.output_tokens_details.reasoning_tokens == 2
    )
    # the items the events carried at the end are the response's
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert done == b.output


def test_whitespace_before_a_call_is_no_message_and_an_empty_answer_is_one():
    b = R.OutputBuilder()
    b.feed([Delta("content", "\n"), Delta("tool_call", index=0, id="call_a", name="f", arguments="{}")])
    b.finish()
    assert [o["type"] for o in b.output] == ["function_call"]
    b = R.OutputBuilder()
    evs = b.finish("incomplete")
    assert _events(evs)[0] == "response.output_item.added"
    r = _response(b, "incomplete")
    assert r.output_text == "" and r.output[0].status == "incomplete"


class _Failing(R.ResponseGeneration):
    """A generation whose model writes one piece, then its worker dies."""

    async def _all_pieces(self):  # type: ignore[override]
        yield Piece(0, [Delta("content", "Hel")], None)
        raise R._pool_error(ConnectionError("gone"), self.id)


def _gen(cls: type, body: dict) -> R.ResponseGeneration:
    rreq = R.parse_responses_request(body)
    inst = SimpleNamespace(name="m")
    prep = Prepared([1, 2, 3], "", False, 8)
    return cls(None, inst, rreq.chat, prep, "fp", rreq=rreq)


def _parse_sse(chunks: list[bytes]) -> list[dict]:
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if block:
            event, data = block.split("\n")
            assert event.startswith("event: ") and data.startswith("data: ")
            ev = json.loads(data[6:])
            assert ev["type"] == event[7:]
            out.append(ev)
    return out


def test_a_stream_that_fails_midway_ends_with_error_and_response_failed():
    gen = _gen(_Failing, {"input": "hi", "stream": True})

    async def run() -> list[bytes]:
        return [c async for c in gen.stream_chunks()]

    evs = _parse_sse(asyncio.run(run()))
    types = _events([{k: v for k, v in e.items() if k != "sequence_number"} for e in evs])
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "error", "response.failed"]  # fmt: skip
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[-2]["code"] == "internal_error" and gen.id in evs[-2]["message"]
    failed = Response.model_validate(evs[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.usage is None
    assert not any("error" in e for e in evs)  # no top-level "error" key: the SDK would raise on it
