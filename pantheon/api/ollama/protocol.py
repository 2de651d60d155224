"""Ollama's API objects, typed (msgspec), and the mapping of its requests onto our ``GenerationRequest``.

Requests (``ChatBody``, ``GenerateBody``, their ``Options``) are decoded with their types checked
(a wrong type is a 400 naming the field) and unknown fields ignored, as Ollama does. The mapping
goes straight to a ``GenerationRequest``: each value is checked by the checks every front end
shares (``pantheon.api.fields``: every range, tool schema and output constraint is the chat
route's) under the Ollama field it came from (``options.num_predict``, ``format``,
``messages[1].role``), and the request keeps those names (``NAMES``) for the errors after mapping
(the context rule, the limits).

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
``ProcessResponse``, ``ShowResponse``); an error is ``{"error": "..."}`` (``ApiError.ollama_body``).
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
from pantheon.api import fields, structured
from pantheon.chat.emitter import Delta
from pantheon.control.residency import KeepAliveError, parse_keep_alive
from pantheon.core import request as core
from pantheon.core.request import GenerationRequest, TemplateKwargs, Tool
from pantheon.errors import invalid_param

# The Ollama release whose API this follows: the first with every field served here (the
# logprobs of 0.12.11 being the last to land). Clients gate features on it.
OLLAMA_VERSION = "0.12.11"
THINK_LEVELS = ("low", "medium", "high", "max")

# ---------------------------------------------------------------- requests


class Options(msgspec.Struct, kw_only=True):
    """The options this server maps (see the module doc); any other is ignored. Integers may
    come as whole floats (Go's JSON numbers): ``pantheon.api.fields`` checks them."""

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
    body = fields.load_json(raw or b"{}")
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


# ---------------------------------------------------------------- the mapping onto GenerationRequest


@dataclass
class Request:
    """An Ollama request mapped: the generation request, and the Ollama field each of its
    messages came from (``messages[i]``; ``system`` and ``prompt`` on ``/api/generate``)."""

    chat: GenerationRequest
    where: list[str] = field(default_factory=list)

    @property
    def num_ctx(self) -> int | None:
        """The context the request asks for (``options.num_ctx``; None: the instance's)."""
        return self.chat.num_ctx

    @property
    def prompt(self) -> str | list[int] | None:
        """``/api/generate`` with ``raw``: the prompt, sent as it is."""
        return self.chat.prompt


def _whole(v: int | float | None, param: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, float) and not v.is_integer():
        raise invalid_param(param, f"'{param}' must be an integer, got {v}")
    return int(v)


MAX_NUM_CTX = 2**31 - 1  # llama.cpp's n_ctx (an int32), which Ollama hands it: past it, no context

_OPTIONS = (  # ours <- Ollama's option (the rest are mapped by hand below)
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repeat_penalty"),
    ("repetition_window", "repeat_last_n"),
)
# ours -> Ollama's field, for every value an option gives and the fields named otherwise
NAMES = {
    **{ours: f"options.{theirs}" for ours, theirs in _OPTIONS},
    "seed": "options.seed",
    "stop": "options.stop",
    "max_tokens": "options.num_predict",
    "response_format": "format",
    "chat_template_kwargs": "think",
}


def option_fields(o: Options | None) -> tuple[dict[str, object], int | None]:
    """``options`` -> (our sampling fields as given, ``num_ctx`` or None)."""
    out: dict[str, object] = {}
    if o is None:
        return out, None
    for ours, theirs in _OPTIONS:
        out[ours] = getattr(o, theirs)
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


def constraint(fmt: str | dict[str, object] | None) -> fields.Constraint:
    """``format``: ``"json"`` (any object) or a JSON schema, enforced strictly; "" or none:
    free text."""
    if fmt is None or fmt == "":
        return fields.TEXT
    if fmt == "json":
        return "json_object", structured.json_schema_grammar({"type": "object"}, "format")
    if isinstance(fmt, dict):
        return "json_schema", structured.json_schema_grammar(fmt, "format", strict=True)
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


def thinking_kwargs(think: bool | str | None, reasoning: bool | None, model: str) -> TemplateKwargs:
    """The chat template's switches for ``think`` on a model that reasons (``reasoning``; None:
    not known yet, the request fails at routing anyway) or not."""
    on, level = think_value(think)
    if reasoning is None:
        return {} if on is None else {"enable_thinking": on}
    if not reasoning:
        if on:
            raise invalid_param("think", f'"{model}" does not support thinking')
        return {}
    kw: TemplateKwargs = {"enable_thinking": on is not False}  # unset: on, as Ollama
    if level is not None:
        kw["reasoning_effort"] = level
    return kw


def chat_messages(msgs: list[MessageIn], model: str) -> list[core.Message]:
    """Ollama messages -> the chat template's."""
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if m.images:
            raise invalid_param(
                f"{p}.images",
                f"'{p}.images': model {model!r} reads text only (this server loads no vision encoder)",
            )
        given = m.role.lower()
        role = fields.role(given, f"{p}.role")
        calls = None
        if role == "assistant" and m.tool_calls:
            calls = [
                fields.tool_call(c.id or "", c.function.name, c.function.arguments) for c in m.tool_calls
            ]
        out.append(
            fields.message(
                role,
                m.content or "",
                tool_calls=calls,
                reasoning=m.thinking if role == "assistant" else None,
                tool_call_id=(m.tool_call_id or "") if given == "tool" else None,
                name=(m.tool_name or None) if given == "tool" else None,
            )
        )
    return out


def _request(
    body: ChatBody | GenerateBody,
    model: str,
    messages: list[core.Message],
    reasoning: bool | None,
    header_session: str | None,
    *,
    tools: list[Tool] | None = None,
    choice: tuple[str, str | None] = ("auto", None),
) -> GenerationRequest:
    """The ``GenerationRequest`` of a mapped body: its options, format, think, keep_alive and
    logprobs, each checked under its Ollama name."""
    given, num_ctx = option_fields(body.options)
    fmt = constraint(body.format)
    given.update(stream=body.stream is not False, keep_alive=body.keep_alive)
    if body.logprobs:
        given["logprobs"] = True
        given["top_logprobs"] = body.top_logprobs or None
    given["chat_template_kwargs"] = thinking_kwargs(body.think, reasoning, model) or None
    req = fields.generation_request(
        given, model=model, messages=messages, names=NAMES, header_session=header_session
    )
    req.num_ctx = num_ctx
    return fields.with_tools(req, tools, choice, fmt)


def chat_request(
    body: ChatBody, model: str, *, reasoning: bool | None = None, header_session: str | None = None
) -> Request:
    """``/api/chat`` (with messages) for ``model`` -> ``Request``; ``reasoning``: the model's
    chat template reasons (None: not known)."""
    msgs = body.messages or []
    messages = chat_messages(msgs, model)
    tools = fields.tools_of(body.tools)
    choice = fields.tool_choice_of(body.tool_choice, tools)
    req = _request(body, model, messages, reasoning, header_session, tools=tools, choice=choice)
    return Request(req, [f"messages[{i}]" for i in range(len(msgs))])


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
        # no template: the prompt is tokenized as it is. And no reasoning either (the output is
        # plain text): a format's grammar starts at the first token, not after a <think> block
        # the model might open (``Generation._constraint``)
        req = _request(body, model, [], None, header_session)
        req.prompt, req.chat_template_kwargs = prompt, {"enable_thinking": False}
        return Request(req, ["prompt"])
    messages, where = [], []
    if body.system:
        messages.append(fields.message("system", body.system))
        where.append("system")
    messages.append(fields.message("user", prompt))
    where.append("prompt")
    return Request(_request(body, model, messages, reasoning, header_session), where)


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


_encoder = msgspec.json.Encoder()


def line(obj: object) -> bytes:
    """One NDJSON line: ``obj`` as msgspec encodes it (a Struct, or a dict of JSON values)."""
    return _encoder.encode(obj) + b"\n"


def iso(ts: float) -> str:
    """A unix time as RFC 3339 (UTC)."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


# Ollama's "forever" (a negative keep_alive): the largest duration past now, ~292 years
FOREVER_S = (1 << 63) / 1e9


def forever() -> str:
    return iso(time.time() + FOREVER_S)
