"""The checks every front end's request mapping shares, and the one builder of its
``GenerationRequest`` (``pantheon.core.request``).

A front end (``pantheon.api.openai.protocol`` for chat, ``openai.completions``,
``openai.responses``, ``ollama.protocol``) reads its own body and hands each value here under
our field name with the client's name for it (``names``: ``max_tokens`` -> ``options.num_predict``),
so every invalid value is a 400 ``invalid_request_error`` whose ``param`` names the caller's own
field, at the moment it is checked: nothing is renamed afterwards. The request remembers the
names too, for the errors raised after mapping (the context rule, the limits, the constraint).

Every range, tool check and output constraint is therefore one check, whichever API the value
came in by. JSON bodies are read by ``load_json`` (depth and Unicode checked).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pantheon.api import structured
from pantheon.config.values import KeepAliveError, parse_keep_alive
from pantheon.core.request import GenerationRequest, Message, TemplateKwargs, Tool
from pantheon.errors import ApiError, invalid_json, invalid_param
from pantheon.models import generation_defaults

MAX_STOP = 4
MAX_N = 128
MAX_PROMPT_LOGPROBS = 20  # the top alternatives a prompt position may ask for, as top_logprobs
# Every integer sent to a worker is packed by msgspec into msgpack: a signed 64-bit range (a
# larger one is an OverflowError there, a 500 here). A request's integers are kept inside it.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A token id has at most this many digits (int64's 19, and leading zeros): a longer key is refused
# before int(), which raises ValueError past 4,300 digits.
MAX_ID_DIGITS = 20
# The names the template renderer sets itself (pantheon.chat.template, pantheon.control.context):
# a client's chat_template_kwargs may not replace them (a duplicate keyword is a TypeError there).
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")


Names = Mapping[str, str]  # our field -> the client's, where not the same name


# ---------------------------------------------------------------- value checkers
# Each takes the value as given (None: absent) and ``param``, the client's name for it.


def integer(v: object, param: str, lo: int | None = None, hi: int | None = None) -> int | None:
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise invalid_param(param, f"'{param}' must be an integer, got {type(v).__name__}")
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid_param(param, f"'{param}' must be {rng}, got {short(v)}")
    if not INT64_MIN <= v <= INT64_MAX:  # what the worker's wire takes
        raise invalid_param(param, f"'{param}' is out of range: it must fit a 64-bit signed integer")
    return v


def short(v: object) -> str:
    """``v`` for an error message, cut to a readable length (an integer may have 4,300 digits)."""
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= 40 else s[:20] + f"...({len(s)} characters)"


def number(
    v: object, param: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False
) -> float | None:
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise invalid_param(param, f"'{param}' must be a number, got {type(v).__name__}")
    try:
        v = float(v)  # an integer past 1e308 is an OverflowError
    except OverflowError:
        raise invalid_param(param, f"'{param}' is out of range, got {short(v)}") from None
    if not math.isfinite(v):
        raise invalid_param(param, f"'{param}' must be a finite number")
    if lo is not None and (v < lo or lo_open and v == lo) or hi is not None and v > hi:
        rng = (
            f"> {lo}" if lo_open and hi is None else (f">= {lo}" if hi is None else f"between {lo} and {hi}")
        )
        raise invalid_param(param, f"'{param}' must be {rng}, got {v}")
    return v


def boolean(v: object, param: str) -> bool | None:
    if v is not None and not isinstance(v, bool):
        raise invalid_param(param, f"'{param}' must be a boolean")
    return v


def string(v: object, param: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise invalid_param(param, f"'{param}' must be a string")
    return v


def obj(v: object, param: str) -> dict[str, object] | None:
    """A JSON object (its values JSON, as the client sent them), or None when absent."""
    if v is not None and not isinstance(v, dict):
        raise invalid_param(param, f"'{param}' must be an object")
    return v


# Content parts that carry an image, audio or a file (OpenAI's and vLLM's names): no model this
# server runs reads them (a checkpoint's vision tower is left out at load).
MEDIA_PARTS = (
    "image_url",
    "input_image",
    "image",
    "input_audio",
    "audio_url",
    "audio",
    "file",
    "input_file",
    "video_url",
)


# ---------------------------------------------------------------- messages


def message_text(content: object, param: str, model: str | None, *, allow_null: bool = False) -> str | None:
    """A chat message's content: a string or a list of text parts, joined. A media part is a
    400 naming ``model`` (the request's), which serves text only."""
    if content is None:
        if allow_null:
            return None
        raise invalid_param(param, f"'{param}' is required")
    who = f"model {model!r}" if model else "this server's models"
    return parts_text(content, param, ("text",), f"{who} serves text only (content parts of type 'text')")


def parts_text(content: object, param: str, text_kinds: tuple[str, ...], text_only: str) -> str:
    """``content``: a string, or a list of text parts (of ``text_kinds``) joined by newlines,
    refusals skipped; anything else is a 400 naming the part (a media part's message ends with
    ``text_only``, what the model takes). Chat messages and Responses input items both read
    their content through this."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_param(param, f"'{param}' must be a string or an array of content parts")
    if not content:
        raise invalid_param(param, f"'{param}' must not be an empty array")
    parts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_param(p, f"'{p}' must be an object")
        kind = part.get("type")
        if kind in text_kinds:
            if not isinstance(part.get("text"), str):
                raise invalid_param(f"{p}.text", f"'{p}.text' must be a string")
            parts.append(part["text"])
        elif kind == "refusal":
            continue
        elif kind in MEDIA_PARTS:
            raise invalid_param(f"{p}.type", f"content part type {kind!r} is not supported: {text_only}")
        else:
            known = ", ".join(repr(k) for k in text_kinds)
            raise invalid_param(f"{p}.type", f"content part type {kind!r} is not supported (only {known})")
    return "\n".join(parts)


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def role(v: object, param: str) -> str:
    """A message's role, checked; ``developer`` is ``system`` and ``function`` is ``tool`` to
    the chat template."""
    if v not in ROLES:
        raise invalid_param(param, f"'{param}' must be one of {', '.join(ROLES)}; got {v!r}")
    assert isinstance(v, str)
    return {"developer": "system", "function": "tool"}.get(v, v)


def tool_call(call_id: str, name: str, arguments: object) -> dict[str, object]:
    """An assistant message's tool call as the template takes it; ``arguments`` kept as the
    client sent it (JSON text, or an object): the renderer gives the template an object, or
    text where the template takes text (``pantheon.chat.template.normalize_messages``)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def message(
    role: str,
    content: str,
    *,
    tool_calls: list[dict[str, object]] | None = None,
    reasoning: str | None = None,
    tool_call_id: str | None = None,
    name: str | None = None,
) -> Message:
    """A checked message in the one form every front end gives the chat template (the keys in
    this order)."""
    out: Message = {"role": role, "content": content}
    if tool_calls is not None:
        out["tool_calls"] = tool_calls
    if reasoning:
        out["reasoning_content"] = reasoning
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    if name is not None:
        out["name"] = name
    return out


# ---------------------------------------------------------------- tools


def function_tool(fn: Mapping[str, object], p: str, seen: Sequence[Tool]) -> Tool:
    """A function tool from its fields (``name``, ``description``, ``parameters``) at ``p``
    (``tools[0].function`` on chat, ``tools[0]`` on Responses, whose tools are flat)."""
    name = string(fn.get("name"), f"{p}.name")
    if not name:
        raise invalid_param(f"{p}.name", f"'{p}.name' must be a non-empty string")
    if any(o["function"]["name"] == name for o in seen):
        raise invalid_param(f"{p}.name", f"tool name {name!r} is given twice")
    params = obj(fn.get("parameters"), f"{p}.parameters")
    desc = string(fn.get("description"), f"{p}.description")
    clean: dict[str, object] = {"name": name} if desc is None else {"name": name, "description": desc}
    clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": clean}


def tool_choice_mode(tc: str, tools: Sequence[Tool] | None, param: str = "tool_choice") -> tuple[str, None]:
    """``none`` / ``auto`` / ``required`` (which needs tools)."""
    if tc not in ("none", "auto", "required"):
        raise invalid_param(param, f"'{param}' must be none, auto, required or a named function")
    if tc == "required" and not tools:
        raise invalid_param(param, f"{param} 'required' needs 'tools'")
    return tc, None


def named_tool_choice(name: object, tools: Sequence[Tool] | None, param: str) -> tuple[str, str]:
    """A named function the answer must call: one of ``tools`` (``param``: the name's field)."""
    if not isinstance(name, str):
        raise invalid_param(param, f"'{param}' must be a string")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise invalid_param(param, f"tool_choice names {name!r}, which is not in 'tools'")
    return "function", name


def tools_of(tools: object) -> list[Tool] | None:
    """``tools`` in OpenAI's shape (chat, Ollama): function tools, checked."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_param("tools", "'tools' must be an array")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_param(p, f"'{p}' must be an object")
        if t.get("type") != "function":
            raise invalid_param(f"{p}.type", f"tool type {t.get('type')!r} is not supported")
        fn = obj(t.get("function"), f"{p}.function")
        out.append(function_tool(fn or {}, f"{p}.function", out))
    return out or None


def tool_choice_of(tc: object, tools: list[Tool] | None) -> tuple[str, str | None]:
    """``tool_choice`` in OpenAI's shape: none / auto / required / a named function."""
    if tc is None:
        return "auto", None
    if isinstance(tc, str):
        return tool_choice_mode(tc, tools)
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(tc.get("function"), dict):
        raise invalid_param(
            "tool_choice", "'tool_choice' object must be {'type': 'function', 'function': {'name': ...}}"
        )
    return named_tool_choice(tc["function"].get("name"), tools, "tool_choice.function.name")


# ---------------------------------------------------------------- the other fields


def stop(v: object, param: str = "stop") -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid_param(param, f"'{param}' must be a string or an array of strings")
    if len(v) > MAX_STOP:
        raise invalid_param(param, f"'{param}' takes at most {MAX_STOP} sequences, got {len(v)}")
    return [s for s in v if s]


def logit_bias(v: object) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token id (a string of digits) -> a bias in [-100, 100]."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid_param("logit_bias", "'logit_bias' must be an object of token id -> bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise invalid_param("logit_bias", f"'logit_bias' key {short(k)} is not a token id")
        # (the length first: int() of more than 4,300 digits is a ValueError)
        if len(k) > MAX_ID_DIGITS or int(k) > INT64_MAX:
            raise invalid_param(
                "logit_bias",
                f"'logit_bias' key {short(k)} is out of range: not a token id of any vocabulary",
            )
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:
            raise invalid_param("logit_bias", f"'logit_bias' value for {k} must be a number in [-100, 100]")
        out[int(k)] = float(b)
    return out


def template_kwargs(v: object, param: str = "chat_template_kwargs") -> TemplateKwargs | None:
    """``chat_template_kwargs``: an object, without the names the renderer sets itself."""
    kw = obj(v, param)
    for key in RESERVED_TEMPLATE_KWARGS:
        if kw is not None and key in kw:
            p = f"{param}.{key}"
            where = "the request's own field" if key in ("tools", "messages") else "set by the server"
            raise invalid_param(p, f"'{p}' may not be given: '{key}' is {where}")
    return kw


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's


def reasoning_effort(v: object, param: str = "reasoning_effort") -> str | None:
    """``reasoning_effort``: one of OpenAI's levels, passed to the chat template as
    ``reasoning_effort`` (gpt-oss's writes it into its system message; others ignore it)."""
    if v is None:
        return None
    if v not in REASONING_EFFORTS:
        raise invalid_param(param, f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}")
    assert isinstance(v, str)
    return v


def keep_alive(v: object) -> float | None:
    """The request's ``keep_alive`` (Ollama's field, an extension on the OpenAI routes):
    seconds, or None."""
    try:
        return parse_keep_alive(v)  # pyright: ignore[reportArgumentType] - it checks the type
    except KeepAliveError as e:
        raise invalid_param("keep_alive", str(e)) from None


def keep_alive_field(body: Mapping[str, object]) -> float | None:
    """A body's ``keep_alive`` (see ``keep_alive``)."""
    return keep_alive(body.get("keep_alive"))


# ---------------------------------------------------------------- the one builder

Constraint = tuple[str, str | None]  # (its kind: text | json_object | json_schema | ..., grammar)
TEXT: Constraint = ("text", None)


def generation_request(
    given: Mapping[str, object],
    *,
    model: str | None,
    messages: list[Message],
    names: Names | None = None,
    header_session: str | None = None,
) -> GenerationRequest:
    """The request of ``messages`` with the sampling, limit and session fields in ``given``
    (ours -> the value as the client gave it; absent or None: not given), each checked and, when
    invalid, a 400 naming the client's field (``names``). Tools and the output constraint are
    set after (``with_tools``): each front end reads those in its own shape."""
    names = dict(names or {})

    def name(key: str) -> str:
        return names.get(key, key)

    kw: dict[str, Any] = {"model": model, "messages": messages}
    kw["max_tokens"] = integer(given.get("max_tokens"), name("max_tokens"), 1)
    for key, lo, hi in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("min_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        kw[key] = number(given.get(key), name(key), lo, hi)
    kw["repetition_penalty"] = number(
        given.get("repetition_penalty"), name("repetition_penalty"), 0.0, 10.0, lo_open=True
    )
    window = integer(given.get("repetition_window"), name("repetition_window"), -1)
    if window is None:  # llama.cpp's name for it, an alias on the OpenAI routes
        window = integer(given.get("repeat_last_n"), "repeat_last_n", -1)
    kw["repetition_window"] = window
    kw["seed"] = integer(given.get("seed"), name("seed"), INT64_MIN, INT64_MAX)
    kw["n"] = integer(given.get("n"), name("n"), 1, MAX_N)
    top_k = integer(given.get("top_k"), name("top_k"), -1)
    kw["top_k"] = None if top_k is None else max(top_k, 0)  # -1 (vLLM's "off") is 0 here
    min_tokens = kw["min_tokens"] = integer(given.get("min_tokens"), name("min_tokens"), 0)
    max_tokens = kw["max_tokens"]
    if min_tokens and isinstance(max_tokens, int) and min_tokens > max_tokens:
        raise invalid_param(name("min_tokens"), "'min_tokens' must not exceed 'max_tokens'")
    kw["logit_bias"] = logit_bias(given.get("logit_bias")) or None
    for key in ("logprobs", "stream", "ignore_eos", "speculative", "parallel_tool_calls"):
        kw[key] = boolean(given.get(key), name(key))
    kw["top_logprobs"] = integer(given.get("top_logprobs"), name("top_logprobs"), 0, 20)
    if kw["top_logprobs"] and not kw["logprobs"]:
        raise invalid_param(name("top_logprobs"), "'top_logprobs' needs 'logprobs' set to true")
    kw["stop"] = stop(given.get("stop"), name("stop"))
    kw["prompt_logprobs"] = integer(given.get("prompt_logprobs"), "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    if kw["prompt_logprobs"] is not None and kw["stream"]:
        # vLLM's rule too: they belong to no chunk (the chat stream's first is sent before any)
        raise invalid_param("prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true")

    so = given.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid_param("stream_options", "'stream_options' must be an object")
        if not kw["stream"]:
            raise invalid_param("stream_options", "'stream_options' is only allowed when 'stream' is true")
        kw["include_usage"] = bool(boolean(so.get("include_usage"), "stream_options.include_usage"))

    kw["user"] = string(given.get("user"), "user")
    sid = string(given.get("session_id"), name("session_id"))
    kw["session_id"] = sid if sid is not None else header_session
    kw["cache_salt"] = string(given.get("cache_salt"), "cache_salt")
    kw["keep_alive"] = keep_alive(given.get("keep_alive"))
    kwargs = template_kwargs(given.get("chat_template_kwargs"), name("chat_template_kwargs"))
    effort = reasoning_effort(given.get("reasoning_effort"), name("reasoning_effort"))
    if effort is not None:  # for the templates that read it (gpt-oss's); the kwargs' own wins
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    kw["chat_template_kwargs"] = kwargs
    kw["unset"] = frozenset(k for k in generation_defaults.FIELDS if kw.get(k) is None)
    kw["names"] = names or None
    return GenerationRequest(**{k: v for k, v in kw.items() if v is not None})


def with_tools(
    req: GenerationRequest,
    tools: list[Tool] | None,
    choice: tuple[str, str | None],
    constraint: Constraint,
    *,
    constraint_param: str | None = None,
    tool_paths: Sequence[str] | None = None,
) -> GenerationRequest:
    """``req`` with its checked tools, tool choice and output constraint (in place; returned):
    the schemas of the tools a call will be forced to must be enforceable (a 400 naming
    ``tool_paths[i].parameters``: where each tool's fields are, ``tools[i].function`` by
    default), and under ``auto`` without a constraint the lazy call-or-reply grammar is made.
    ``constraint_param``: the client's field of the constraint, for the errors after mapping."""
    req.tools = tools
    req.tool_choice, req.tool_choice_name = choice
    req.response_format, req.grammar = constraint
    if constraint_param is not None:
        req.names = {**req.names, "response_format": constraint_param}
    if tools and req.tool_choice in ("required", "function"):  # the call will be enforced
        forced = req.tool_choice_name
        structured.check_tool_schemas(tools, None if forced is None else [forced], tool_paths)
    elif tools and req.tool_choice == "auto" and req.grammar is None:
        try:
            req.answer_grammar = structured.call_or_reply_grammar(
                tools, parallel=req.parallel_tool_calls, prose=True
            )  # lazy; a server set to decide makes it strict (flow.place_chat)
        except (ApiError, ValueError):  # llguidance's refusal, or its converter's
            pass  # free text then: see GenerationRequest.answer_grammar
    return req


MAX_DEPTH = 64  # JSON nesting a body may have (a tool's parameter schema fits many times over)


def load_json(raw: bytes | bytearray | str) -> object:
    """Parse a request body: 400 ``invalid_json`` for bad JSON or nesting past ``MAX_DEPTH``,
    400 naming the place for text that is not valid Unicode (a lone surrogate, which no
    tokenizer takes). Every JSON body of the API comes through here."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_json(str(e)) from None
    except RecursionError:
        raise invalid_json(f"the body is nested deeper than {MAX_DEPTH} levels") from None
    check_body(body)
    return body


def check_body(body: object) -> None:
    """The depth and text checks of ``load_json``, without recursion (see there)."""
    stack: list[tuple[object, int, tuple[str | int, ...]]] = [(body, 1, ())]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            if _lone_surrogate(v):
                p = _path(where)
                raise invalid_param(
                    p, f"'{p}' holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text"
                )
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise invalid_json(f"the body is nested deeper than {MAX_DEPTH} levels")
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            if isinstance(k, str) and _lone_surrogate(k):
                raise invalid_param(
                    _path(where) or None, "a key holds a lone surrogate: not valid Unicode text"
                )
            stack.append((x, depth + 1, (*where, k)))


def _lone_surrogate(s: str) -> bool:
    """Whether ``s`` holds a lone surrogate (what a bare ``\\ud800`` escape decodes to): such
    text is not Unicode and cannot be encoded (a regex scan of megabytes costs 50x more)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(where: tuple[str | int, ...]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for k in where:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out
