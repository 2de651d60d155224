"""The OpenAI chat API surface: request validation into a typed ``GenerationRequest`` (``pantheon.core.request``), and builders
for every object the server sends back (completions, chunks, usage, models). The errors, and
their OpenAI error object, are ``pantheon.errors``.

Validation is hand-written so that every invalid value is a 400 ``invalid_request_error`` whose
``param`` names the exact field (``messages[2].content``, ``stop``, ``tool_choice.function.name``).
Unknown fields are ignored, as OpenAI-compatible servers do. The builders emit exactly the shapes of
the OpenAI OpenAPI schema (checked by tests/unit/test_openai_api.py against ../shared/specs).

Why one module of ~580 lines: the request validation and the response builders are the two
halves of one schema (the OpenAI chat API), checked together against it; a split into
``request`` and ``response`` modules is the natural next step when ``/v1/completions`` lands.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import msgspec

from pantheon.api import fields, structured
from pantheon.api.fields import load_json
from pantheon.core.protocol import PromptLogprobs
from pantheon.core.request import GenerationRequest, Message
from pantheon.errors import invalid_param, not_an_object

# ---------------------------------------------------------------- the request


def parse_chat_request(raw: bytes | str | object, *, header_session: str | None = None) -> GenerationRequest:
    """Bytes (or an already decoded value) -> ``GenerationRequest``; raises ``ApiError`` (400).
    The body's field names are ours (``GenerationRequest`` follows OpenAI's), except
    ``max_completion_tokens``, the newer name of ``max_tokens``."""
    body = load_json(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    if not isinstance(body, dict):
        raise not_an_object()
    model = fields.string(body.get("model"), "model")
    msgs = body.get("messages")
    if msgs is None:
        raise invalid_param("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise invalid_param("messages", "'messages' must be a non-empty array")
    messages = [_message(f"messages[{i}]", m, model) for i, m in enumerate(msgs)]
    given, names = body, {}
    mct = fields.integer(body.get("max_completion_tokens"), "max_completion_tokens", 1)
    if mct is not None:
        given, names = {**body, "max_tokens": mct}, {"max_tokens": "max_completion_tokens"}
    req = fields.generation_request(
        given, model=model, messages=messages, names=names, header_session=header_session
    )
    tools = fields.tools_of(body.get("tools"))
    choice = fields.tool_choice_of(body.get("tool_choice"), tools)
    return fields.with_tools(req, tools, choice, structured.request_grammar(body))


def _message(p: str, m: object, model: str | None) -> Message:
    """A chat message at ``p`` (``messages[i]``), checked."""
    if not isinstance(m, dict):
        raise invalid_param(p, f"'{p}' must be an object")
    given = m.get("role")
    role = fields.role(given, f"{p}.role")
    calls, reasoning, tcid = None, None, None
    if role == "assistant":
        content = fields.message_text(m.get("content"), f"{p}.content", model, allow_null=True) or ""
        if m.get("tool_calls") is not None:
            calls = _assistant_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        rc = m.get("reasoning_content")
        reasoning = rc if isinstance(rc, str) else None
    else:
        content = fields.message_text(m.get("content"), f"{p}.content", model) or ""
    if role == "tool":
        tcid = fields.string(m.get("tool_call_id"), f"{p}.tool_call_id")
        if given == "tool" and tcid is None:
            raise invalid_param(f"{p}.tool_call_id", f"'{p}.tool_call_id' must be a string")
    name = fields.string(m.get("name"), f"{p}.name")
    return fields.message(role, content, tool_calls=calls, reasoning=reasoning, tool_call_id=tcid, name=name)


def _assistant_tool_calls(calls: object, p: str) -> list[dict[str, object]]:
    if not isinstance(calls, list):
        raise invalid_param(p, f"'{p}' must be an array")
    out = []
    for j, c in enumerate(calls):
        q = f"{p}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise invalid_param(f"{q}.function", f"'{q}.function' must be an object")
        fn = c["function"]
        name = fields.string(fn.get("name"), f"{q}.function.name")
        if name is None:
            raise invalid_param(f"{q}.function.name", f"'{q}.function.name' must be a string")
        out.append(fields.tool_call(c.get("id") or "", name, fn.get("arguments", "{}")))
    return out


# ---------------------------------------------------------------- response builders


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def usage(
    prompt_tokens: int, completion_tokens: int, *, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def message(
    content: str | None, *, reasoning: str | None = None, tool_calls: list[dict] | None = None
) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
        if not content:
            msg["content"] = None
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def tool_call(id: str, name: str, arguments: str) -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def choice(index: int, msg: dict, finish_reason: str, logprobs: list[dict] | None = None) -> dict:
    lp = None if logprobs is None else {"content": logprobs, "refusal": None}
    return {"index": index, "message": msg, "logprobs": lp, "finish_reason": finish_reason}


def chat_completion(
    id: str, created: int, model: str, fingerprint: str, choices: list[dict], usage_: dict
) -> dict:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "system_fingerprint": fingerprint,
        "service_tier": "default",
    }


def chunk(
    id: str,
    created: int,
    model: str,
    fingerprint: str,
    choices: list[dict],
    *,
    include_usage: bool = False,
    usage_: dict | None = None,
) -> dict:
    out = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }
    if include_usage:
        out["usage"] = usage_
    return out


def chunk_choice(
    index: int, delta: dict, finish_reason: str | None = None, logprobs: list[dict] | None = None
) -> dict:
    lp = None if logprobs is None else {"content": logprobs, "refusal": None}
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}


def token_logprob(
    token: str, logprob: float, raw: bytes | None, top: Sequence[tuple[str, float, bytes | None]] = ()
) -> dict:
    def fin(x: float) -> float:
        return x if math.isfinite(x) else -9999.0

    return {
        "token": token,
        "logprob": fin(logprob),
        "bytes": None if raw is None else list(raw),
        "top_logprobs": [
            {"token": t, "logprob": fin(lp), "bytes": None if b is None else list(b)} for t, lp, b in top
        ],
    }


class PromptTokenLogprob(TypedDict):
    """One token of one position in vLLM's ``prompt_logprobs``."""

    logprob: float
    rank: int
    decoded_token: str


def prompt_logprobs(
    prompt: Sequence[int], got: PromptLogprobs | None, k: int, piece: Callable[[int], str]
) -> list[dict[str, PromptTokenLogprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first position (nothing predicts it), then per
    position ``{token_id: {logprob, rank, decoded_token}}`` holding the prompt's own token and
    the top ``k`` (keys are strings in JSON)."""
    out: list[dict[str, PromptTokenLogprob] | None] = [None]
    if got is None:
        return out + [None] * (len(prompt) - 1)
    for i, tok in enumerate(prompt[1:]):
        entry = {str(tok): _lp_entry(got.logprobs[i], got.ranks[i], piece(tok))}
        for rank, (t, lp) in enumerate(got.top[i][:k], 1):
            entry.setdefault(str(t), _lp_entry(lp, rank, piece(t)))
        out.append(entry)
    return out


def _lp_entry(logprob: float, rank: int, decoded: str) -> PromptTokenLogprob:
    return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": decoded}


def model_object(
    name: str, created: int, max_model_len: int | None, defaults: dict[str, float | int] | None = None
) -> dict:
    """A model object; ``defaults``: the sampling defaults in force for it (what a request that
    leaves those fields out gets: ``pantheon.models.generation_defaults``)."""
    out: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "pantheon"}
    if max_model_len is not None:
        out["max_model_len"] = max_model_len
    if defaults is not None:
        out["defaults"] = dict(defaults)
    return out


def model_list(models: list[dict]) -> dict:
    return {"object": "list", "data": models}


_encoder = msgspec.json.Encoder()


def dumps(obj: object) -> bytes:
    """``obj`` as JSON: anything msgspec encodes (dicts, lists, scalars, Structs)."""
    return _encoder.encode(obj)


def sse(obj: object) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
