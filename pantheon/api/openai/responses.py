"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat route's machinery.

A Responses body is mapped straight to a ``GenerationRequest`` (:func:`generation_request`):
each value is checked by the checks every front end shares (``pantheon.api.fields``: every
sampling range, tool check and output constraint, ``text.format`` -> the same llguidance grammar)
under the Responses name it came in by (``max_output_tokens``, ``input[2].content``,
``tools[0].name``, ``text.format.schema``), and the request keeps those names for the errors
after mapping. Admission is the chat route's ``admit``. The output (``ResponseGeneration``) is built by one state machine
(:class:`OutputBuilder`) for the collected and the streamed answer, so both end in the same
``response`` object.

Mapping:

- ``instructions`` is a system message first; ``input`` a string (one user message) or a list
  of items: messages (``role`` user / system / developer / assistant; ``content`` a string or
  ``input_text`` / ``output_text`` parts), ``function_call`` (an assistant message's tool call;
  calls right after an assistant message join it) and ``function_call_output`` (a tool message),
  ``reasoning`` (its text becomes the next assistant message's ``reasoning_content``).
- ``tools``: function tools, flat (``{"type": "function", "name", "parameters", ...}``);
  ``tool_choice``: none / auto / required / ``{"type": "function", "name"}``.
- ``max_output_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``, ``user``, ``stream``,
  ``parallel_tool_calls`` as in chat; ``prompt_cache_key`` is the session id (prefix cache).
- ``reasoning.effort`` -> chat's ``reasoning_effort`` (the chat template's: gpt-oss's reads it).
- Accepted and echoed, no effect: ``store`` (always echoed ``false``: nothing is stored),
  ``metadata``, ``reasoning``'s other fields, ``truncation``, ``include``, ``service_tier``,
  ``safety_identifier``, ``text.verbosity``, ``stream_options``.
- Refused (400 naming the parameter): ``previous_response_id``, ``conversation``, ``prompt``,
  ``background: true``, ``n`` other than 1, ``max_tool_calls``, logprobs (``top_logprobs``,
  ``include: ["message.output_text.logprobs"]``), non-function tools, image / file / audio
  inputs, ``item_reference`` and the built-in tools' items.

Extensions taken under their chat names, as they are: ``seed``, ``stop``, the penalties,
``logit_bias``, ``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_*``,
``session_id``, ``cache_salt``, ``chat_template_kwargs``, ``speculative``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Blueprint, request

from pantheon import errors
from pantheon.api import fields, flow, structured
from pantheon.api import middleware as ops
from pantheon.api.generation import Generation, _pool_error
from pantheon.api.openai import protocol as oa
from pantheon.api.state import app_state
from pantheon.control.context import Prepared
from pantheon.control.registry import Instance
from pantheon.core.request import GenerationRequest, Message, Tool
from pantheon.errors import ApiError, invalid_param
from pantheon.workerlink.pool import WorkerPool

bp = Blueprint("responses", __name__)

# extensions under their chat names, checked as there
_EXTRAS = (
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "speculative",
    "repetition_penalty",
    "repetition_window",
    "repeat_last_n",
    "session_id",
    "cache_salt",
    "chat_template_kwargs",
)
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ---------------------------------------------------------------- request: the mapping


def _parts_text(content: object, p: str, *, media_word: str = "inputs") -> str:
    """A string, or a list of text parts joined by newlines; media parts are a 400."""
    return fields.parts_text(content, p, _TEXT_PARTS, f"this server takes text {media_word} only")


def _req_str(item: dict, key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise invalid_param(f"{p}.{key}", f"'{p}.{key}' must be a string")
    return v


def _reasoning_text(item: dict, p: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise invalid_param(f"{p}.content", f"'{p}.content' must be an array")
    return "\n".join(x["text"] for x in parts if isinstance(x, dict) and isinstance(x.get("text"), str))


def input_messages(input_: object, instructions: object = None) -> tuple[list[Message], list[str]]:
    """``instructions`` and ``input`` -> (chat messages, the Responses path each came from).

    Raises a 400 naming the item for what is not supported."""
    msgs: list[dict] = []
    where: list[str] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_param("instructions", "'instructions' must be a string")
        if instructions:
            msgs.append({"role": "system", "content": instructions})
            where.append("instructions")
    if input_ is None:
        raise invalid_param("input", "'input' is required")
    if isinstance(input_, str):
        msgs.append({"role": "user", "content": input_})
        where.append("input")
        return msgs, where
    if not isinstance(input_, list) or not input_:
        raise invalid_param("input", "'input' must be a string or a non-empty array of items")
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message
    joinable = False  # the last message is an assistant one a function_call may join
    for i, item in enumerate(input_):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_param(p, f"'{p}' must be an object")
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid_param(
                    f"{p}.role", f"'{p}.role' must be one of {', '.join(_ROLES)}; got {role!r}"
                )
            if item.get("content") is None:
                raise invalid_param(f"{p}.content", f"'{p}.content' is required")
            msg: dict[str, Any] = {"role": role, "content": _parts_text(item["content"], f"{p}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
            where.append(p)
            joinable = role == "assistant"
        elif kind == "function_call":
            call_id = _req_str(item, "call_id", p)
            name = _req_str(item, "name", p)
            args = _req_str(item, "arguments", p)
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if joinable and reasoning is None:
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = reasoning, None
                msgs.append(msg)
                where.append(p)
                joinable = True
        elif kind == "function_call_output":
            call_id = _req_str(item, "call_id", p)
            if item.get("output") is None:
                raise invalid_param(f"{p}.output", f"'{p}.output' is required")
            out = _parts_text(item["output"], f"{p}.output", media_word="tool outputs")
            msg = {"role": "tool", "tool_call_id": call_id, "content": out}
            if call_id in names:
                msg["name"] = names[call_id]
            msgs.append(msg)
            where.append(p)
            joinable = False
        elif kind == "reasoning":
            reasoning = "\n".join(x for x in (reasoning, _reasoning_text(item, p)) if x) or None
        elif kind == "item_reference":
            raise invalid_param(
                f"{p}.type",
                f"'{p}.type': 'item_reference' needs stored items; this server stores none: send the item itself",
            )
        else:
            raise invalid_param(
                f"{p}.type",
                f"'{p}.type': input item type {kind!r} is not supported "
                "(message, function_call, function_call_output, reasoning)",
            )
    if not msgs:
        raise invalid_param("input", "'input' holds no message")
    return msgs, where


def chat_tools(tools: object) -> list[Tool] | None:
    """Responses function tools (flat) -> chat tools; any other tool type is a 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_param("tools", "'tools' must be an array")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_param(p, f"'{p}' must be an object")
        if t.get("type") != "function":
            raise invalid_param(
                f"{p}.type", f"'{p}.type': tool type {t.get('type')!r} is not supported: only function tools"
            )
        fn: dict[str, Any] = {"name": t.get("name")}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(tc: object) -> str | Tool | None:
    """Responses ``tool_choice`` -> chat's."""
    if tc is None or isinstance(tc, str):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        if not isinstance(tc.get("name"), str):
            raise invalid_param("tool_choice.name", "'tool_choice.name' must be a string")
        return {"type": "function", "function": {"name": tc["name"]}}
    kind = tc.get("type") if isinstance(tc, dict) else None
    raise invalid_param(
        "tool_choice",
        f"'tool_choice' must be none, auto, required or {{'type': 'function', 'name': ...}}; got type {kind!r}",
    )


def chat_format(text: object) -> dict[str, object] | None:
    """Responses ``text`` (its ``format``) -> chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_param("text", "'text' must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid_param("text.format", "'text.format' must be an object with a 'type'")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": js}


def _refuse(body: dict) -> None:
    """The fields a stateless server without these features refuses, naming each."""
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise invalid_param(
                key,
                f"'{key}' needs stored state; this server stores nothing: send the whole conversation in 'input'",
            )
    if body.get("prompt") is not None:
        raise invalid_param("prompt", "stored prompt templates ('prompt') are not supported")
    if body.get("background") not in (None, False):
        raise invalid_param("background", "'background' mode is not supported")
    if body.get("n") not in (None, 1):
        raise invalid_param("n", "'n' is not supported: one response per request")
    if body.get("max_tool_calls") is not None:
        raise invalid_param("max_tool_calls", "'max_tool_calls' is not supported")
    if body.get("top_logprobs") not in (None, 0):
        raise invalid_param("top_logprobs", "logprobs are not supported on /v1/responses")
    inc = body.get("include")
    if inc is not None:
        if not isinstance(inc, list) or not all(isinstance(x, str) for x in inc):
            raise invalid_param("include", "'include' must be an array of strings")
        if "message.output_text.logprobs" in inc:
            raise invalid_param("include", "logprobs are not supported on /v1/responses")


class ResponsesRequest:
    """A parsed ``/v1/responses`` body: the generation request it maps to, and the fields the
    response object echoes."""

    def __init__(self, chat: GenerationRequest, echo: dict[str, object]):
        self.chat, self.echo = chat, echo


def generation_request(body: dict[str, object], header_session: str | None = None) -> GenerationRequest:
    """A Responses body -> its ``GenerationRequest``: each value checked under the Responses
    field it came from (``max_output_tokens``, ``tools[0].name``, ``text.format.schema``)."""
    _refuse(body)
    msgs, _where = input_messages(body.get("input"), body.get("instructions"))
    messages = [
        fields.message(
            fields.role(m["role"], "role"),
            m["content"],
            tool_calls=m.get("tool_calls"),
            reasoning=m.get("reasoning_content"),
            tool_call_id=m.get("tool_call_id"),
            name=m.get("name"),
        )
        for m in msgs
    ]
    tools, choice, rf = (
        chat_tools(body.get("tools")),
        chat_tool_choice(body.get("tool_choice")),
        chat_format(body.get("text")),
    )
    given: dict[str, object] = {
        k: body[k]
        for k in ("temperature", "top_p", "stream", "user", "parallel_tool_calls", *_EXTRAS)
        if body.get(k) is not None
    }
    names = {"max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort"}
    given["max_tokens"] = body.get("max_output_tokens")
    if body.get("session_id") is None and isinstance(body.get("prompt_cache_key"), str):
        given["session_id"] = body["prompt_cache_key"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):  # the template's, as chat's (gpt-oss)
        given["reasoning_effort"] = reasoning.get("effort")
    model = fields.string(body.get("model"), "model")
    req = fields.generation_request(
        given, model=model, messages=messages, names=names, header_session=header_session
    )
    checked: list[Tool] = []
    for i, t in enumerate(tools or []):
        checked.append(fields.function_tool(t["function"], f"tools[{i}]", checked))
    tools = checked or None
    if choice is None:
        tool_choice: tuple[str, str | None] = ("auto", None)
    elif isinstance(choice, str):
        tool_choice = fields.tool_choice_mode(choice, tools)
    else:
        tool_choice = fields.named_tool_choice(choice["function"]["name"], tools, "tool_choice.name")
    constraint = fields.TEXT if rf is None else structured.response_format(rf, "text.format", "text.format")
    paths = [f"tools[{i}]" for i in range(len(tools or []))]
    return fields.with_tools(
        req, tools, tool_choice, constraint, constraint_param="text.format", tool_paths=paths
    )


def _echo(body: dict, chat: GenerationRequest) -> dict[str, object]:
    """The request fields every response object carries."""
    tools = [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict", True),
        }
        for t in body.get("tools") or []
    ]
    text = dict(body.get("text") or {})
    text["format"] = text.get("format") or {"type": "text"}
    meta = body.get("metadata")
    if meta is not None and (
        not isinstance(meta, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise invalid_param("metadata", "'metadata' must be an object of strings")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid_param("reasoning", "'reasoning' must be an object")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise invalid_param("truncation", "'truncation' must be 'auto' or 'disabled'")
    return {
        "background": False,
        "instructions": body.get("instructions"),
        "max_output_tokens": chat.max_tokens,
        "metadata": meta or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": reasoning,
        "service_tier": "default",
        "store": False,
        "temperature": chat.temperature,
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools,
        "top_p": chat.top_p,
        "truncation": truncation or "disabled",
        "user": chat.user,
    }


def parse_responses_request(
    raw: bytes | str | object, *, header_session: str | None = None
) -> ResponsesRequest:
    """Bytes (or a decoded body) -> ``ResponsesRequest``; raises ``ApiError`` (400)."""
    body = oa.load_json(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    if not isinstance(body, dict):
        raise errors.not_an_object()
    chat = generation_request(body, header_session)
    return ResponsesRequest(chat, _echo(body, chat))


# ---------------------------------------------------------------- response: the output items


class OutputBuilder:
    """The emitter's deltas -> the response's ``output`` items, and the stream's events (dicts
    without ``sequence_number``) that build them. One item is open at a time: a ``reasoning``
    item, a ``message`` (opened by the first text that is not only whitespace: whitespace
    between items is dropped), or a ``function_call``."""

    def __init__(self) -> None:
        self.output: list[dict] = []
        self._open: dict | None = None
        self._text: list[str] = []
        self._call: int | None = None
        self._ws = {"content": "", "reasoning": ""}  # whitespace waiting for an item to open

    # -- opening and closing

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open, self._text = item, []
        ev = [
            {
                "type": "response.output_item.added",
                "output_index": len(self.output) - 1,
                "item": copy.deepcopy(item),
            }
        ]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            ev.append(self._part_event("response.content_part.added", part))
        elif item["type"] == "reasoning":
            ev.append(self._part_event("response.content_part.added", {"type": "reasoning_text", "text": ""}))
        return ev

    def _part_event(self, kind: str, part: dict) -> dict:
        assert self._open is not None
        return {
            "type": kind,
            "item_id": self._open["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
            "part": part,
        }

    def _where(self) -> dict:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _close(self, status: str = "completed") -> list[dict]:
        item = self._open
        if item is None:
            return []
        text = "".join(self._text)
        ev: list[dict] = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            item["content"] = [part]
            ev.append(
                {
                    "type": "response.output_text.done",
                    **self._where(),
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                }
            )
            ev.append(self._part_event("response.content_part.done", dict(part)))
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            ev.append(
                {"type": "response.reasoning_text.done", **self._where(), "content_index": 0, "text": text}
            )
            ev.append(self._part_event("response.content_part.done", dict(part)))
        else:
            item["arguments"] = text
            ev.append({"type": "response.function_call_arguments.done", **self._where(), "arguments": text})
        item["status"] = status
        ev.append(
            {
                "type": "response.output_item.done",
                "output_index": len(self.output) - 1,
                "item": copy.deepcopy(item),
            }
        )
        self._open = None
        return ev

    # -- feeding

    def _text_delta(self, kind: str, text: str) -> list[dict]:
        want = "message" if kind == "content" else "reasoning"
        ev: list[dict] = []
        if self._open is None or self._open["type"] != want:
            if not text.strip():
                self._ws[kind] += text
                return []
            ev += self._close()
            if want == "message":
                item = {
                    "id": _new_id("msg_"),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
            else:
                item = {
                    "id": _new_id("rs_"),
                    "type": "reasoning",
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                }
            ev += self._add(item)
            text, self._ws[kind] = self._ws[kind] + text, ""
        self._text.append(text)
        kind_ev = "response.output_text.delta" if want == "message" else "response.reasoning_text.delta"
        delta = {"type": kind_ev, **self._where(), "content_index": 0, "delta": text}
        if want == "message":
            delta["logprobs"] = []
        return [*ev, delta]

    def feed(self, deltas: list) -> list[dict]:
        ev: list[dict] = []
        for d in deltas:
            if d.kind in ("content", "reasoning"):
                if d.text:
                    ev += self._text_delta(d.kind, d.text)
            elif d.kind == "tool_call":
                o = self._open
                if o is None or o["type"] != "function_call" or self._call != d.index:
                    ev += self._close()
                    item = {
                        "id": _new_id("fc_"),
                        "type": "function_call",
                        "call_id": d.id or oa.tool_call_id(),
                        "name": d.name or "",
                        "arguments": "",
                        "status": "in_progress",
                    }
                    ev += self._add(item)
                    self._call = d.index  # which of the emitter's calls is open
                if d.arguments:
                    self._text.append(d.arguments)
                    ev.append(
                        {
                            "type": "response.function_call_arguments.delta",
                            **self._where(),
                            "delta": d.arguments,
                        }
                    )
        return ev

    def finish(self, status: str = "completed") -> list[dict]:
        """Close the open item with ``status``; an answer with no item at all gets an (empty) message."""
        ev = self._close(status)
        if not self.output:
            ev += self._add(
                {
                    "id": _new_id("msg_"),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
            )
            if self._ws["content"]:
                self._text.append(self._ws["content"])
                ev.append(
                    {
                        "type": "response.output_text.delta",
                        **self._where(),
                        "content_index": 0,
                        "delta": self._ws["content"],
                        "logprobs": [],
                    }
                )
            ev += self._close(status)
        return ev


def response_usage(u: dict) -> dict:
    """Chat usage -> the Responses API's."""
    return {
        "input_tokens": u["prompt_tokens"],
        # cache_write_tokens (the SDK requires it): not counted here, 0
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]},
        "total_tokens": u["total_tokens"],
    }


def _sse(seq: int, event: dict) -> bytes:
    event["sequence_number"] = seq
    return b"event: " + event["type"].encode() + b"\ndata: " + oa.dumps(event) + b"\n\n"


class ResponseGeneration(Generation):
    """A ``Generation`` whose output is a ``response`` object (one choice)."""

    def __init__(
        self,
        pool: WorkerPool,
        inst: Instance,
        req: GenerationRequest,
        prep: Prepared,
        fingerprint: str,
        *,
        arrived: float | None = None,
        on_tokens: Callable[[int], None] | None = None,
        rreq: ResponsesRequest,
    ):
        super().__init__(pool, inst, req, prep, fingerprint, arrived=arrived, on_tokens=on_tokens)
        self.id = "resp_" + self.id.removeprefix("chatcmpl-")
        self.rreq = rreq
        self.builder = OutputBuilder()

    def response(self, status: str, *, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": copy.deepcopy(self.builder.output) if done else [],
            "usage": response_usage(self.usage()) if done and error is None else None,
            **self.rreq.echo,
            # the values it runs with: a field left out has its model's default by now
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
        }

    def _final_status(self) -> str:
        return "incomplete" if self.runs[0].finish_reason == "length" else "completed"

    async def complete(self) -> dict:
        async with contextlib.aclosing(self._all_pieces()) as pieces:
            async for p in pieces:
                self.builder.feed(p.deltas)
        status = self._final_status()
        self.builder.finish(status)
        return self.response(status)

    async def stream_chunks(self) -> AsyncIterator[bytes]:
        seq = 0
        for kind in ("response.created", "response.in_progress"):
            yield _sse(seq, {"type": kind, "response": self.response("in_progress")})
            seq += 1
        try:
            async with contextlib.aclosing(self._all_pieces()) as pieces:
                async for p in pieces:
                    for ev in self.builder.feed(p.deltas):
                        yield _sse(seq, ev)
                        seq += 1
            status = self._final_status()
            for ev in self.builder.finish(status):
                yield _sse(seq, ev)
                seq += 1
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield _sse(seq, {"type": kind, "response": self.response(status)})
        except Exception as e:  # noqa: BLE001 - the stream must still end cleanly
            err = e if isinstance(e, ApiError) else _pool_error(e, self.id)
            yield _sse(seq, {"type": "error", "code": err.code, "message": err.message, "param": err.param})
            failed = {
                "code": "rate_limit_exceeded" if err.status == 429 else "server_error",
                "message": err.message,
            }
            yield _sse(
                seq + 1, {"type": "response.failed", "response": self.response("failed", error=failed)}
            )


@bp.post("/v1/responses", provide_automatic_options=False)
async def responses():
    s = app_state()
    arrived = time.monotonic()
    raw = await request.get_data(cache=False)
    session = request.headers.get("X-Session-Id")
    big = len(raw) > flow.BIG_BODY
    if big:
        rreq = await asyncio.to_thread(parse_responses_request, raw, header_session=session)
    else:
        rreq = parse_responses_request(raw, header_session=session)
    del raw
    ops.body_done()  # the body's bytes leave the --max-body-in-flight count
    req = rreq.chat
    adm = await flow.admit(
        s,
        req,
        lambda: flow.place_chat(s, req),
        lambda inst, prep: ResponseGeneration(
            s.pool,
            inst,
            req,
            prep,
            s.config.fingerprint,
            arrived=arrived,
            on_tokens=s.feed.tokens,
            rreq=rreq,
        ),
    )
    return await flow.respond(adm, req.stream)
