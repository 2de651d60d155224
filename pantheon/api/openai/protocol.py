"""The OpenAI chat API surface: request validation into a typed ``ChatRequest``, and builders
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

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pantheon.api.openai import structured
from pantheon.config.values import KeepAliveError, parse_keep_alive
from pantheon.core.protocol import SPECULATIVE_ON, PromptLogprobs, SamplingParams
from pantheon.errors import ApiError, invalid_json, invalid_param, not_an_object
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


# ---------------------------------------------------------------- the typed request


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]  # normalised for the chat template
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from, for the errors naming it
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's prompt_logprobs: each prompt position's logprob and its top K (None: not asked)
    prompt_logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # none | auto | required | function
    tool_choice_name: str | None = None
    # False: at most one call per answer (enforced only where the answer form is the router's:
    # pantheon.chat.answer_form; other formats parse however many calls come)
    parallel_tool_calls: bool = True
    response_format: str = "text"  # the constraint's kind: text | json_object | json_schema | regex | ...
    grammar: str | None = None  # its llguidance grammar (pantheon.api.openai.structured), checked
    # under tool_choice auto without a grammar of its own: the call-or-reply grammar a model whose
    # template takes no tools answers in (pantheon.chat.answer_form); None when the tools'
    # schemas cannot be compiled into one (such a model then answers free text, as before)
    answer_grammar: str | None = None
    user: str | None = None
    # extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # the tokens the repetition penalty looks at: the last N of prompt and output (llama.cpp's
    # repeat_last_n, same default), -1 all of them, 0 none
    repetition_window: int = 64
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (OpenAI's, [-100, 100])
    min_tokens: int = 0
    ignore_eos: bool = False
    session_id: str | None = None
    cache_salt: str | None = None  # requests share cached prefixes only under the same salt
    # prompt-lookup speculative decoding (workers/speculation.py): True on (SPECULATIVE_TOKENS
    # drafts per step, or the server's --speculative count), False off, None the server's default
    speculative: bool | None = None
    chat_template_kwargs: dict[str, Any] = {}
    # seconds the model stays loaded when idle after this request (Ollama's keep_alive; None:
    # the model's default, residency.FOREVER, 0: unload once idle)
    keep_alive: float | None = None
    # the defaultable sampling fields (generation_defaults.FIELDS) the client left out: the
    # router fills them from the model's defaults once it is routed (generation_defaults.apply).
    # Empty for a request built in code: every field is then as given.
    unset: frozenset[str] = frozenset()

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def sampling(
        self,
        *,
        max_tokens: int,
        stop_token_ids: list[int],
        seed: int | None = None,
        grammar: str | None = None,
        grammar_after: list[int] | None = None,
        grammar_opening: int = -1,
    ) -> SamplingParams:
        """The worker's parameters; ``grammar`` (else the request's own) constrains the output,
        from when the output ends with ``grammar_after`` (see ``SamplingParams``)."""
        greedy = self.temperature == 0.0 or self.top_p == 0.0
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_window=self.repetition_window,
            logit_bias=dict(self.logit_bias),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed if seed is None else seed,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else 0,
            grammar=grammar or self.grammar,
            grammar_after=list(grammar_after or []),
            grammar_opening=grammar_opening,
            speculative=None if self.speculative is None else SPECULATIVE_ON if self.speculative else 0,
        )


# ---------------------------------------------------------------- field checkers


def _int(
    body: dict, key: str, lo: int | None = None, hi: int | None = None, param: str | None = None
) -> int | None:
    v = body.get(key)
    param = param or key
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise invalid_param(param, f"'{param}' must be an integer, got {type(v).__name__}")
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid_param(param, f"'{param}' must be {rng}, got {_short(v)}")
    if not INT64_MIN <= v <= INT64_MAX:  # what the worker's wire takes
        raise invalid_param(param, f"'{param}' is out of range: it must fit a 64-bit signed integer")
    return v


def _short(v: Any) -> str:
    """``v`` for an error message, cut to a readable length (an integer may have 4,300 digits)."""
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= 40 else s[:20] + f"...({len(s)} characters)"


def _num(
    body: dict, key: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False
) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise invalid_param(key, f"'{key}' must be a number, got {type(v).__name__}")
    try:
        v = float(v)  # an integer past 1e308 is an OverflowError
    except OverflowError:
        raise invalid_param(key, f"'{key}' is out of range, got {_short(v)}") from None
    if not math.isfinite(v):
        raise invalid_param(key, f"'{key}' must be a finite number")
    if lo is not None and (v < lo or lo_open and v == lo) or hi is not None and v > hi:
        rng = (
            f"> {lo}" if lo_open and hi is None else (f">= {lo}" if hi is None else f"between {lo} and {hi}")
        )
        raise invalid_param(key, f"'{key}' must be {rng}, got {v}")
    return v


def _typed(body: dict, key: str, kind: type, word: str, param: str | None = None) -> Any:
    """``body[key]`` if it is a ``kind`` (None when absent); else a 400 naming ``param``."""
    v = body.get(key)
    if v is not None and not isinstance(v, kind):
        raise invalid_param(param or key, f"'{param or key}' must be {word}")
    return v


def _bool(body: dict, key: str, param: str | None = None) -> bool | None:
    return _typed(body, key, bool, "a boolean", param)


def _str(body: dict, key: str, param: str | None = None) -> str | None:
    return _typed(body, key, str, "a string", param)


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


def _text(content: Any, param: str, *, allow_null: bool = False, model: Any = None) -> str | None:
    """A message's content: a string or a list of text parts, joined. A media part is a 400
    naming ``model`` (the request's), which serves text only."""
    if content is None:
        if allow_null:
            return None
        raise invalid_param(param, f"'{param}' is required")
    who = f"model {model!r}" if isinstance(model, str) and model else "this server's models"
    return parts_text(content, param, ("text",), f"{who} serves text only (content parts of type 'text')")


def parts_text(content: Any, param: str, text_kinds: tuple[str, ...], text_only: str) -> str:
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


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _message(i: int, m: Any, model: Any = None) -> dict[str, Any]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid_param(p, f"'{p}' must be an object")
    role = m.get("role")
    if role not in _ROLES:
        raise invalid_param(f"{p}.role", f"'{p}.role' must be one of {', '.join(_ROLES)}; got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if role == "assistant":
        out["content"] = _text(m.get("content"), f"{p}.content", allow_null=True, model=model) or ""
        calls = m.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _assistant_tool_calls(calls, f"{p}.tool_calls")
        rc = m.get("reasoning_content")
        if isinstance(rc, str) and rc:
            out["reasoning_content"] = rc
    else:
        out["content"] = _text(m.get("content"), f"{p}.content", model=model)
    if role in ("tool", "function"):
        out["role"] = "tool"
        tcid = _str(m, "tool_call_id", f"{p}.tool_call_id")
        if role == "tool" and tcid is None:
            raise invalid_param(f"{p}.tool_call_id", f"'{p}.tool_call_id' must be a string")
        if tcid is not None:
            out["tool_call_id"] = tcid
    if _str(m, "name", f"{p}.name") is not None:
        out["name"] = m["name"]
    return out


def _assistant_tool_calls(calls: Any, p: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid_param(p, f"'{p}' must be an array")
    out = []
    for j, c in enumerate(calls):
        q = f"{p}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise invalid_param(f"{q}.function", f"'{q}.function' must be an object")
        fn = c["function"]
        if _str(fn, "name", f"{q}.function.name") is None:
            raise invalid_param(f"{q}.function.name", f"'{q}.function.name' must be a string")
        # kept as the client sent it (JSON text): the renderer gives the template an object, or this
        # text where the template takes text (pantheon.chat.template.normalize_messages)
        args = fn.get("arguments", "{}")
        out.append(
            {"id": c.get("id") or "", "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_param("tools", "'tools' must be an array")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_param(p, f"'{p}' must be an object")
        if t.get("type") != "function":
            raise invalid_param(f"{p}.type", f"tool type {t.get('type')!r} is not supported")
        fn = _typed(t, "function", dict, "an object", f"{p}.function")
        name = _str(fn or {}, "name", f"{p}.function.name")
        if not name:
            raise invalid_param(f"{p}.function.name", f"'{p}.function.name' must be a non-empty string")
        if any(o["function"]["name"] == name for o in out):
            raise invalid_param(f"{p}.function.name", f"tool name {name!r} is given twice")
        params = _typed(fn, "parameters", dict, "an object", f"{p}.function.parameters")
        desc = _str(fn, "description", f"{p}.function.description")
        clean: dict[str, Any] = {"name": name} if desc is None else {"name": name, "description": desc}
        clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": clean})
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None]:
    tc = body.get("tool_choice")
    if tc is None:
        return "auto", None
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise invalid_param(
                "tool_choice", "'tool_choice' must be none, auto, required or a named function"
            )
        if tc == "required" and not tools:
            raise invalid_param("tool_choice", "tool_choice 'required' needs 'tools'")
        return tc, None
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(tc.get("function"), dict):
        raise invalid_param(
            "tool_choice", "'tool_choice' object must be {'type': 'function', 'function': {'name': ...}}"
        )
    name = tc["function"].get("name")
    if not isinstance(name, str):
        raise invalid_param("tool_choice.function.name", "'tool_choice.function.name' must be a string")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise invalid_param(
            "tool_choice.function.name", f"tool_choice names {name!r}, which is not in 'tools'"
        )
    return "function", name


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid_param("stop", "'stop' must be a string or an array of strings")
    if len(v) > MAX_STOP:
        raise invalid_param("stop", f"'stop' takes at most {MAX_STOP} sequences, got {len(v)}")
    return [s for s in v if s]


MAX_DEPTH = 64  # JSON nesting a body may have (a tool's parameter schema fits many times over)


def load_json(raw: bytes | bytearray | str) -> Any:
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


def check_body(body: Any) -> None:
    """The depth and text checks of ``load_json``, without recursion (see there)."""
    stack: list[tuple[Any, int, tuple]] = [(body, 1, ())]
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


def _path(where: tuple) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for k in where:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _logit_bias(v: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token id (a string of digits) -> a bias in [-100, 100]."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid_param("logit_bias", "'logit_bias' must be an object of token id -> bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise invalid_param("logit_bias", f"'logit_bias' key {_short(k)} is not a token id")
        # (the length first: int() of more than 4,300 digits is a ValueError)
        if len(k) > MAX_ID_DIGITS or int(k) > INT64_MAX:
            raise invalid_param(
                "logit_bias",
                f"'logit_bias' key {_short(k)} is out of range: not a token id of any vocabulary",
            )
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:
            raise invalid_param("logit_bias", f"'logit_bias' value for {k} must be a number in [-100, 100]")
        out[int(k)] = float(b)
    return out


def _template_kwargs(body: dict) -> dict[str, Any] | None:
    """``chat_template_kwargs``: an object, without the names the renderer sets itself."""
    kw = _typed(body, "chat_template_kwargs", dict, "an object")
    for key in RESERVED_TEMPLATE_KWARGS:
        if kw is not None and key in kw:
            p = f"chat_template_kwargs.{key}"
            where = "the request's own field" if key in ("tools", "messages") else "set by the server"
            raise invalid_param(p, f"'{p}' may not be given: '{key}' is {where}")
    return kw


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's


def _reasoning_effort(body: dict) -> str | None:
    """``reasoning_effort``: one of OpenAI's levels, passed to the chat template as
    ``reasoning_effort`` (gpt-oss's writes it into its system message; others ignore it)."""
    v = body.get("reasoning_effort")
    if v is None:
        return None
    if v not in REASONING_EFFORTS:
        raise invalid_param(
            "reasoning_effort", f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}"
        )
    return v


def keep_alive_field(body: dict) -> float | None:
    """The request's ``keep_alive`` (Ollama's field, an extension here): seconds, or None."""
    try:
        return parse_keep_alive(body.get("keep_alive"))
    except KeepAliveError as e:
        raise invalid_param("keep_alive", str(e)) from None


def parse_chat_request(raw: bytes | str | Any, *, header_session: str | None = None) -> ChatRequest:
    """Bytes (or an already decoded value) -> ``ChatRequest``; raises ``ApiError`` (400)."""
    if isinstance(raw, (bytes, bytearray, str)):
        body = load_json(raw)
    else:
        body = raw
    if not isinstance(body, dict):
        raise not_an_object()

    model = _str(body, "model")
    msgs = body.get("messages")
    if msgs is None:
        raise invalid_param("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise invalid_param("messages", "'messages' must be a non-empty array")
    messages = [_message(i, m, model) for i, m in enumerate(msgs)]

    kw: dict[str, Any] = {"model": model, "messages": messages}
    mct = _int(body, "max_completion_tokens", 1)
    kw["max_tokens"] = mct if mct is not None else _int(body, "max_tokens", 1)
    kw["max_tokens_param"] = "max_completion_tokens" if mct is not None else None
    for key, lo, hi in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("min_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        kw[key] = _num(body, key, lo, hi)
    kw["repetition_penalty"] = _num(body, "repetition_penalty", 0.0, 10.0, lo_open=True)
    window = _int(body, "repetition_window", -1)
    kw["repetition_window"] = window if window is not None else _int(body, "repeat_last_n", -1)
    kw["seed"] = _int(body, "seed", -(1 << 63), (1 << 63) - 1)
    kw["n"] = _int(body, "n", 1, MAX_N)
    top_k = _int(body, "top_k", -1)
    kw["top_k"] = None if top_k is None else max(top_k, 0)  # -1 (vLLM's "off") is 0 here
    kw["min_tokens"] = _int(body, "min_tokens", 0)
    if kw["min_tokens"] and kw["max_tokens"] is not None and kw["min_tokens"] > kw["max_tokens"]:
        raise invalid_param("min_tokens", "'min_tokens' must not exceed 'max_tokens'")
    kw["logit_bias"] = _logit_bias(body.get("logit_bias")) or None
    for key in ("logprobs", "stream", "ignore_eos", "speculative"):
        kw[key] = _bool(body, key)
    kw["parallel_tool_calls"] = _bool(body, "parallel_tool_calls")
    kw["top_logprobs"] = _int(body, "top_logprobs", 0, 20)
    if kw["top_logprobs"] and not kw["logprobs"]:
        raise invalid_param("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    kw["stop"] = _stop(body.get("stop"))
    kw["prompt_logprobs"] = _int(body, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    if kw["prompt_logprobs"] is not None and kw.get("stream"):
        # vLLM's rule too: they belong to no chunk (the chat stream's first is sent before any)
        raise invalid_param("prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true")

    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid_param("stream_options", "'stream_options' must be an object")
        if not kw.get("stream"):
            raise invalid_param("stream_options", "'stream_options' is only allowed when 'stream' is true")
        kw["include_usage"] = bool(_bool(so, "include_usage", "stream_options.include_usage"))

    tools = _tools(body.get("tools"))
    kw["tools"] = tools
    kw["tool_choice"], kw["tool_choice_name"] = _tool_choice(body, tools)

    kw["response_format"], kw["grammar"] = structured.request_grammar(body)
    if tools and kw["tool_choice"] in ("required", "function"):  # the call will be enforced
        forced = kw["tool_choice_name"]
        structured.check_tool_schemas(tools, None if forced is None else [forced])
    elif tools and kw["tool_choice"] == "auto" and kw["grammar"] is None:
        try:
            kw["answer_grammar"] = structured.call_or_reply_grammar(
                tools, parallel=kw["parallel_tool_calls"] is not False
            )
        except (ApiError, ValueError):  # llguidance's refusal, or its converter's
            pass  # free text then: see answer_grammar

    kw["user"] = _str(body, "user")
    sid = _str(body, "session_id")
    kw["session_id"] = sid if sid is not None else header_session
    kw["cache_salt"] = _str(body, "cache_salt")
    kw["keep_alive"] = keep_alive_field(body)
    kw["chat_template_kwargs"] = _template_kwargs(body)
    effort = _reasoning_effort(body)
    if effort is not None:  # for the templates that read it (gpt-oss's); the kwargs' own wins
        kw["chat_template_kwargs"] = {"reasoning_effort": effort, **(kw["chat_template_kwargs"] or {})}
    kw["unset"] = frozenset(k for k in generation_defaults.FIELDS if kw.get(k) is None)
    return ChatRequest(**{k: v for k, v in kw.items() if v is not None})


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


def prompt_logprobs(
    prompt: Sequence[int], got: PromptLogprobs | None, k: int, piece: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first position (nothing predicts it), then per
    position ``{token_id: {logprob, rank, decoded_token}}`` holding the prompt's own token and
    the top ``k`` (keys are strings in JSON)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    if got is None:
        return out + [None] * (len(prompt) - 1)
    for i, tok in enumerate(prompt[1:]):
        entry = {str(tok): _lp_entry(got.logprobs[i], got.ranks[i], piece(tok))}
        for rank, (t, lp) in enumerate(got.top[i][:k], 1):
            entry.setdefault(str(t), _lp_entry(lp, rank, piece(t)))
        out.append(entry)
    return out


def _lp_entry(logprob: float, rank: int, decoded: str) -> dict[str, Any]:
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


def dumps(obj: Any) -> bytes:
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
