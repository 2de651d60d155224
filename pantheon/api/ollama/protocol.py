"""Ollama's API objects, typed (msgspec), and the mapping of its requests onto our ``ChatRequest``.

Requests (``ChatBody``, ``GenerateBody``, their ``Options``) are decoded with their types checked
(a wrong type is a 400 naming the field) and unknown fields ignored, as Ollama does. The mapping
builds the OpenAI chat body our parser (``pantheon.api.openai.protocol.parse_chat_request``)
checks, so every range, tool schema, limit and output constraint is the chat route's; an error
it raises is renamed to the Ollama field it came from (``max_tokens`` -> ``options.num_predict``,
``response_format`` -> ``format``, ``messages[1]`` -> ``prompt``).

The mapping:

- ``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` (negative: random, as
  Ollama's -1), ``stop``, ``presence_penalty``, ``frequency_penalty``, ``repeat_penalty``
  (``repetition_penalty``), ``repeat_last_n`` (the same window, -1 all, 0 none), ``num_predict``
  (``max_tokens``; 0 or negative: until the context is full, Ollama's -1 and -2), ``num_ctx``
  (the request's context: its prompt is capped to fit as a longer conversation is, at most the
  instance's own context; 0 the instance's; negative or past 2^31 - 1 a 400 naming it). Every other option (``num_keep``, ``typical_p``, ``mirostat``, the
  load-time ``num_gpu``, ``num_thread`` ...) is ignored, as Ollama ignores the ones it does not
  know: a model is loaded once, as ``pantheon serve`` was told.
- ``format``: ``"json"`` (any JSON object) or a JSON schema, enforced by constrained decoding
  (a schema strictly: what cannot be enforced is a 400).
- ``tools``: OpenAI-shaped already; calls come back as ``message.tool_calls`` with
  ``arguments`` an object. ``tool_choice`` (none / auto / required / a named function) is an
  extension here, as on ``/v1/chat/completions``.
- ``think``: on a model whose chat template reasons (``<think>``), unset or true turns the
  template's ``enable_thinking`` on (Ollama's default), false off; ``"low"`` / ``"medium"`` /
  ``"high"`` (``"max"`` is ``"high"``) also pass ``reasoning_effort``. True on any other model is
  a 400, as Ollama answers. The reasoning comes back in ``thinking``.
- ``keep_alive``: ``pantheon.control.residency.parse_keep_alive``.
- ``logprobs`` / ``top_logprobs``: as OpenAI's, in Ollama's ``logprobs`` list.
- messages: ``thinking`` is the assistant turn's ``reasoning_content``, ``tool_calls`` its
  calls, ``tool_name`` a tool turn's name; ``images`` are refused (a 400): no model here reads
  them (a checkpoint's vision tower is left out at load).
- ``/api/generate``: ``system`` + ``prompt`` are one conversation under the chat template;
  ``raw: true`` sends ``prompt`` as it is (no ``system`` then, as Ollama). Refused with a 400:
  ``suffix`` (insertion), ``template`` (the model's own Jinja template is what renders), and the
  deprecated ``context`` (token ids of an earlier answer: send the conversation to ``/api/chat``).
  No response carries ``context`` either.
- Ignored: ``truncate`` (a conversation too long for the context is always capped, oldest turns
  first), ``shift``.

Responses: ``ChatResponse`` / ``GenerateResponse`` (one per NDJSON line, and the final one with
``done_reason`` and the durations in nanoseconds), the listings (``ListResponse``,
``ProcessResponse``, ``ShowResponse``) and ``{"error": "..."}`` (``error_body``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec

from pantheon import errors
from pantheon.api.openai import protocol as oa
from pantheon.api.openai.protocol import ChatRequest
from pantheon.chat.emitter import Delta
from pantheon.control.residency import KeepAliveError, parse_keep_alive
from pantheon.errors import ApiError, invalid_param

# The Ollama release whose API this follows: the first with every field served here (the
# logprobs of 0.12.11 being the last to land). Clients gate features on it.
OLLAMA_VERSION = "0.12.11"
THINK_LEVELS = ("low", "medium", "high", "max")

# ---------------------------------------------------------------- requests


class Options(msgspec.Struct, kw_only=True):
    """The options this server maps (see the module doc); any other is ignored. Integers may
    come as whole floats (Go's JSON numbers): the chat parser checks them."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | float | None = None
    min_p: float | None = None
    seed: int | float | None = None
    stop: list[str] | str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | float | None = None
    num_predict: int | float | None = None
    num_ctx: int | float | None = None


class CallFunctionIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}


class ToolCallIn(msgspec.Struct, kw_only=True):
    function: CallFunctionIn
    id: str | None = None


class MessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str = ""
    stream: bool | None = None  # None: true, Ollama's default
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None
    options: Options | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None  # ignored: a long conversation is always capped
    shift: bool | None = None  # ignored


class ChatBody(_Common, kw_only=True):
    messages: list[MessageIn] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # an extension (see the module doc)


class GenerateBody(_Common, kw_only=True):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class NameBody(msgspec.Struct, kw_only=True):
    """``/api/show``'s body (``name``: its deprecated spelling of ``model``)."""

    model: str = ""
    name: str = ""
    verbose: bool | None = None


BodyT = TypeVar("BodyT", ChatBody, GenerateBody, NameBody)
_AT = re.compile(r"at `\$\.?([^`]*)`")


def decode(raw: bytes | str, kind: type[BodyT]) -> BodyT:
    """A request body -> its typed object; a 400 naming the field for a wrong type."""
    body = oa.load_json(raw or b"{}")
    if not isinstance(body, dict):
        raise errors.not_an_object()
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as e:
        m = _AT.search(str(e))
        raise invalid_param(m.group(1) if m else None, f"invalid request: {e}") from None


def keep_alive(value: float | str | None) -> float | None:
    try:
        return parse_keep_alive(value)
    except KeepAliveError as e:
        raise invalid_param("keep_alive", str(e)) from None


def model_name(body: ChatBody | GenerateBody | NameBody) -> str:
    name = body.model or (body.name if isinstance(body, NameBody) else "")
    if not name:
        raise invalid_param("model", "model is required")
    return name


# ---------------------------------------------------------------- the mapping onto ChatRequest


@dataclass
class Request:
    """An Ollama request mapped: the chat request, the context it asks for (``num_ctx``), and
    the Ollama field each of the chat request's messages came from (to rename errors)."""

    chat: ChatRequest
    num_ctx: int | None
    where: list[str] = field(default_factory=list)
    prompt: str | None = None  # /api/generate with raw: the prompt, sent as it is


def _whole(v: int | float | None, param: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, float) and not v.is_integer():
        raise invalid_param(param, f"'{param}' must be an integer, got {v}")
    return int(v)


MAX_NUM_CTX = 2**31 - 1  # llama.cpp's n_ctx (an int32), which Ollama hands it: past it, no context

_OPTION_FIELDS = (  # ours <- Ollama's
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repeat_penalty"),
    ("repetition_window", "repeat_last_n"),
)


def option_fields(o: Options | None) -> tuple[dict[str, Any], int | None]:
    """``options`` -> (the chat body's sampling fields, ``num_ctx`` or None)."""
    out: dict[str, Any] = {}
    if o is None:
        return out, None
    for ours, theirs in _OPTION_FIELDS:
        v = getattr(o, theirs)
        if v is not None:
            out[ours] = v
    seed = _whole(o.seed, "options.seed")
    if seed is not None and seed >= 0:  # negative: a random seed (Ollama's default -1)
        out["seed"] = seed
    n = _whole(o.num_predict, "options.num_predict")
    if n is not None and n > 0:  # 0, -1, -2: until the context is full
        out["max_tokens"] = n
    if o.stop is not None:
        out["stop"] = [o.stop] if isinstance(o.stop, str) else o.stop
    ctx = _whole(o.num_ctx, "options.num_ctx")
    if ctx is not None and not 0 <= ctx <= MAX_NUM_CTX:
        raise invalid_param(
            "options.num_ctx",
            f"'options.num_ctx' must be between 1 and {MAX_NUM_CTX} tokens (0: the model's own), got {ctx}",
        )
    return out, ctx or None


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``format`` -> the chat body's ``response_format`` (None: free text)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise invalid_param("format", f'invalid format {fmt[:50]!r}: expected "json" or a JSON schema object')


def think_value(v: bool | str | None) -> tuple[bool | None, str | None]:
    """``think`` -> (on / off / unset, the level asked for)."""
    if v is None or isinstance(v, bool):
        return v, None
    if v not in THINK_LEVELS:
        raise invalid_param(
            "think", f'invalid think value {v[:20]!r} (must be "high", "medium", "low", "max", true or false)'
        )
    return True, "high" if v == "max" else v


def thinking_kwargs(think: bool | str | None, reasoning: bool | None, model: str) -> dict[str, Any]:
    """The chat template's switches for ``think`` on a model that reasons (``reasoning``; None:
    not known yet, the request fails at routing anyway) or not."""
    on, level = think_value(think)
    if reasoning is None:
        return {} if on is None else {"enable_thinking": on}
    if not reasoning:
        if on:
            raise invalid_param("think", f'"{model}" does not support thinking')
        return {}
    kw: dict[str, Any] = {"enable_thinking": on is not False}  # unset: on, as Ollama
    if level is not None:
        kw["reasoning_effort"] = level
    return kw


def chat_messages(msgs: list[MessageIn], model: str) -> list[dict[str, Any]]:
    """Ollama messages -> the chat body's."""
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if m.images:
            raise invalid_param(
                f"{p}.images",
                f"'{p}.images': model {model!r} reads text only (this server loads no vision encoder)",
            )
        role = m.role.lower()
        msg: dict[str, Any] = {"role": role, "content": m.content or ""}
        if role == "assistant":
            if m.thinking:
                msg["reasoning_content"] = m.thinking
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c.id or "",
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in m.tool_calls
                ]
        elif role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def _chat_body(
    body: ChatBody | GenerateBody, model: str, messages: list[dict[str, Any]], reasoning: bool | None
) -> tuple[dict[str, Any], int | None]:
    out, num_ctx = option_fields(body.options)
    out.update(model=model, messages=messages, stream=body.stream is not False)
    rf = response_format(body.format)
    if rf is not None:
        out["response_format"] = rf
    if body.keep_alive is not None:
        out["keep_alive"] = body.keep_alive
    if body.logprobs:
        out["logprobs"] = True
        if body.top_logprobs:
            out["top_logprobs"] = body.top_logprobs
    kw = thinking_kwargs(body.think, reasoning, model)
    if kw:
        out["chat_template_kwargs"] = kw
    return out, num_ctx


def _parse(out: dict[str, Any], where: list[str], header_session: str | None) -> ChatRequest:
    try:
        return oa.parse_chat_request(out, header_session=header_session)
    except ApiError as e:
        raise renamed(e, where) from None


def chat_request(
    body: ChatBody, model: str, *, reasoning: bool | None = None, header_session: str | None = None
) -> Request:
    """``/api/chat`` (with messages) for ``model`` -> ``Request``; ``reasoning``: the model's
    chat template reasons (None: not known)."""
    msgs = body.messages or []
    out, num_ctx = _chat_body(body, model, chat_messages(msgs, model), reasoning)
    if body.tools is not None:
        out["tools"] = body.tools
    if body.tool_choice is not None:
        out["tool_choice"] = body.tool_choice
    where = [f"messages[{i}]" for i in range(len(msgs))]
    return Request(_parse(out, where, header_session), num_ctx, where)


def generate_request(
    body: GenerateBody, model: str, *, reasoning: bool | None = None, header_session: str | None = None
) -> Request:
    """``/api/generate`` (with a prompt) for ``model`` -> ``Request`` (see the module doc)."""
    if body.suffix:
        raise invalid_param("suffix", "'suffix' (insertion) is not supported")
    if body.template:
        raise invalid_param(
            "template",
            "'template' is not supported: the model's own chat template renders the prompt "
            "(send raw: true with a prompt formatted yourself)",
        )
    if body.context is not None:
        raise invalid_param(
            "context",
            "'context' (deprecated by Ollama) is not supported: send the whole conversation to /api/chat",
        )
    if body.images:
        raise invalid_param(
            "images", f"'images': model {model!r} reads text only (this server loads no vision encoder)"
        )
    prompt = body.prompt or ""
    if body.raw:
        if body.system:
            raise invalid_param("system", "raw mode does not support 'system' (nor 'template', 'context')")
        # no template: the prompt is tokenized as it is; the message only satisfies the parser
        out, num_ctx = _chat_body(body, model, [{"role": "user", "content": "-"}], None)
        # and no reasoning either (the output is plain text): a format's grammar starts at the
        # first token, not after a <think> block the model might open (``Generation._constraint``)
        out["chat_template_kwargs"] = {"enable_thinking": False}
        return Request(_parse(out, ["prompt"], header_session), num_ctx, ["prompt"], prompt)
    messages, where = [], []
    if body.system:
        messages.append({"role": "system", "content": body.system})
        where.append("system")
    messages.append({"role": "user", "content": prompt})
    where.append("prompt")
    out, num_ctx = _chat_body(body, model, messages, reasoning)
    return Request(_parse(out, where, header_session), num_ctx, where)


_RENAMES = (  # the chat parser's parameter -> Ollama's (a prefix: what follows it stays)
    ("max_completion_tokens", "options.num_predict"),
    ("max_tokens", "options.num_predict"),
    ("repetition_penalty", "options.repeat_penalty"),
    ("repetition_window", "options.repeat_last_n"),
    ("repeat_last_n", "options.repeat_last_n"),
    ("response_format.json_schema.schema", "format"),
    ("response_format", "format"),
    ("chat_template_kwargs", "think"),
    *(
        (k, f"options.{k}")
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "presence_penalty",
            "frequency_penalty",
        )
    ),
)
_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")


def rename(param: str, where: list[str]) -> str:
    """A chat parameter's name -> the Ollama field it came from."""
    m = _MESSAGE.fullmatch(param)
    if m:
        i = int(m.group(1))
        return (where[i] if i < len(where) else "messages") + m.group(2)
    for old, new in _RENAMES:
        if param == old or param.startswith((old + ".", old + "[")):
            return new + param[len(old) :]
    return param


def renamed(e: ApiError, where: list[str]) -> ApiError:
    """``e`` with its parameter, and the name in its message, in Ollama's terms."""
    if e.param is None:
        return e
    new = rename(e.param, where)
    if new != e.param:
        e.message = e.message.replace(f"'{e.param}'", f"'{new}'")
        e.param = new
        e.args = (e.message,)
    return e


# ---------------------------------------------------------------- responses


def now() -> str:
    """RFC 3339 in UTC, as Ollama's ``created_at``."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class CallFunction(msgspec.Struct, kw_only=True):
    index: int
    name: str
    arguments: dict[str, Any]


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str = ""
    function: CallFunction


class TokenLogprob(msgspec.Struct, kw_only=True, omit_defaults=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class Logprob(TokenLogprob, kw_only=True, omit_defaults=True):
    top_logprobs: list[TokenLogprob] = []


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    thinking: str = ""
    tool_calls: list[ToolCall] = []


class Timing(msgspec.Struct, kw_only=True):
    """A finished request's figures, durations in nanoseconds (see ``timing``)."""

    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0


def timing(
    *,
    arrived: float,
    placed: float,
    first_token: float | None,
    ended: float,
    prompt_tokens: int,
    eval_tokens: int,
) -> Timing:
    """From ``time.monotonic()`` stamps: ``load_duration`` is arrival to holding a slot (a load
    on demand, the queue, the template); ``prompt_eval_duration`` from then to the first token
    (the prefill); ``eval_duration`` from the first token to the end."""

    def ns(s: float) -> int:
        return max(0, round(s * 1e9))

    first = ended if first_token is None else first_token
    return Timing(
        total_duration=ns(ended - arrived),
        load_duration=ns(placed - arrived),
        prompt_eval_count=prompt_tokens,
        prompt_eval_duration=ns(first - placed),
        eval_count=eval_tokens,
        eval_duration=ns(ended - first),
    )


class ChatResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    created_at: str
    message: Message
    done: bool
    done_reason: str = ""
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    logprobs: list[Logprob] = []


class GenerateResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    created_at: str
    response: str
    thinking: str = ""
    done: bool
    done_reason: str = ""
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    logprobs: list[Logprob] = []


def done_reason(finish: str | None) -> str:
    """Our finish reason -> Ollama's ``done_reason`` (a tool call ends with "stop" there)."""
    return "length" if finish == "length" else "stop"


def logprobs(lps: list[dict] | None) -> list[Logprob]:
    """The chat route's token logprobs (``oa.token_logprob``: the same fields) -> Ollama's."""
    return msgspec.convert(lps or [], list[Logprob])


def output(
    kind: str,
    model: str,
    *,
    content: str = "",
    thinking: str = "",
    calls: list[ToolCall] | None = None,
    lps: list[Logprob] | None = None,
    done: bool = False,
    reason: str = "",
    stats: Timing | None = None,
) -> ChatResponse | GenerateResponse:
    """One response object of ``/api/chat`` (``kind`` "chat") or ``/api/generate``."""
    figures = msgspec.structs.asdict(stats) if stats is not None else {}
    if kind == "chat":
        msg = Message(role="assistant", content=content, thinking=thinking, tool_calls=calls or [])
        return ChatResponse(
            model=model,
            created_at=now(),
            message=msg,
            done=done,
            done_reason=reason,
            logprobs=lps or [],
            **figures,
        )
    return GenerateResponse(
        model=model,
        created_at=now(),
        response=content,
        thinking=thinking,
        done=done,
        done_reason=reason,
        logprobs=lps or [],
        **figures,
    )


@dataclass
class _Call:
    id: str
    name: str
    args: list[str]


class ToolCalls:
    """The emitter's tool-call deltas (a header, then argument fragments, per index) -> Ollama's
    whole calls, each given out once it is complete: when the next call starts, or at the end.
    Arguments that are not a JSON object (a call cut off by ``num_predict``: the response then
    says ``done_reason: "length"``) come out as ``{}``."""

    def __init__(self) -> None:
        self._open: dict[int, _Call] = {}

    def feed(self, deltas: list[Delta]) -> list[ToolCall]:
        done: list[ToolCall] = []
        for d in deltas:
            if d.kind != "tool_call":
                continue
            i = d.index or 0
            if i not in self._open:
                done += self._close(lambda j, i=i: j != i)
                self._open[i] = _Call(d.id or "", d.name or "", [])
            call = self._open[i]
            call.name = call.name or d.name or ""
            call.args.append(d.arguments or "")
        return done

    def finish(self) -> list[ToolCall]:
        return self._close(lambda j: True)

    def _close(self, which) -> list[ToolCall]:
        out = []
        for i in sorted(j for j in self._open if which(j)):
            c = self._open.pop(i)
            try:
                args = json.loads("".join(c.args) or "{}")
            except ValueError:
                args = {}
            out.append(
                ToolCall(
                    id=c.id,
                    function=CallFunction(
                        index=i, name=c.name, arguments=args if isinstance(args, dict) else {}
                    ),
                )
            )
        return out


def text_of(deltas: list[Delta], kind: str) -> str:
    return "".join(d.text or "" for d in deltas if d.kind == kind)


# -- listings


class ModelDetails(msgspec.Struct, kw_only=True):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    capabilities: list[str]


class ListResponse(msgspec.Struct, kw_only=True):
    models: list[ListModel]


class ProcessModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class ProcessResponse(msgspec.Struct, kw_only=True):
    models: list[ProcessModel]


class ShowResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str] = []
    modified_at: str = ""


class Version(msgspec.Struct):
    version: str


def error_body(e: ApiError) -> dict[str, str]:
    """Ollama's error object: the message alone."""
    return {"error": e.message}


_encoder = msgspec.json.Encoder()


def line(obj: Any) -> bytes:
    """One NDJSON line."""
    return _encoder.encode(obj) + b"\n"


def iso(ts: float) -> str:
    """A unix time as RFC 3339 (UTC)."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


# Ollama's "forever" (a negative keep_alive): the largest duration past now, ~292 years
FOREVER_S = (1 << 63) / 1e9


def forever() -> str:
    return iso(time.time() + FOREVER_S)
