"""Fitting a routed request to its instance (``fit``), before any prefill: the model's
generation defaults (``pantheon.models.generation_defaults``), then the context: pass, cap, or
deny. ``fit`` is the one place every front end's request is fitted; a conversation goes through
``fit_context`` (below), a raw prompt (``/v1/completions``, Ollama's ``raw``) through
``fit_prompt``, which never caps it. The limit is the instance's (``limit_of``), or a smaller
one the client asked for (Ollama's ``num_ctx``); an error names the client's own field
(``GenerationRequest.names``).

The limit of an instance is its context (``max_model_len``) and no more than its worker's KV pool
holds (``kv_pool_tokens``): in this design the KV pool is allocated once at load, so a context
that fits the pool never asks the die for more memory, and one that does not fit could never run.

- pass: the rendered prompt plus ``max_tokens`` fits the limit;
- cap: it does not, so the oldest non-system turns are dropped (a turn: a user message and the
  assistant/tool messages after it; the turn being answered always stays), then the oldest tokens
  of what remains, until prompt plus ``max_tokens`` fit: the spec's sliding-window drop of the
  oldest tokens, so a single message longer than the context keeps its newest tokens and is
  answered (200). The response says ``"context_capped": true`` and that turn is sent with
  ``use_cache=False``: a capped prompt is a different token sequence from the conversation the
  prefix cache holds, and caching it would only evict useful blocks;
- deny (400 ``context_length_exceeded`` naming the numbers): even with every non-system message
  cut to nothing, the system messages, the template's own text and the completion's room do not
  fit (a system prompt longer than the context: system messages are never cut). That is the
  client's error, never the server's state: the limit is fixed at load (the pool is allocated
  once), so retrying can never make it fit. (A pool full of other requests' blocks is no reason
  to refuse: the worker's scheduler waits.)

Without ``max_tokens`` the completion may use the rest of the limit; a capped prompt then keeps
``min(limit / 4, 512)`` tokens of room, so capping never leaves a single token to generate.
A ``max_tokens`` no context can ever hold is the OpenAI 400 ``context_length_exceeded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from pantheon import errors
from pantheon.chat.answer_form import with_answer_prompt
from pantheon.chat.template import RENDER_TIMEOUT_S, TemplateError, render_budget, think_open
from pantheon.chat.tools import forced_call_prefix, with_tool_prompt
from pantheon.core.request import GenerationRequest
from pantheon.models import generation_defaults
from pantheon.models.assets import ModelAssets

if TYPE_CHECKING:
    from pantheon.control.registry import Instance

CAPPED_ROOM = 512  # tokens kept for the completion of a capped prompt without max_tokens


@dataclass
class Prepared:
    prompt_ids: list[int]
    prefix: str  # text the emitter reads before the model's (a forced tool call's opening)
    think_open: bool
    max_tokens: int
    forced: str | None = None  # the function a named tool_choice forces
    capped: bool = False  # fit_context dropped part of the conversation
    dropped_messages: int = 0
    dropped_tokens: int = 0
    # the output constraint (grammar, ids it starts after, <think> id), checked against the
    # model it was fitted for before any slot (api.generation.checked_constraint); None:
    # not checked yet
    constraint: tuple[str | None, list[int], int] | None = None
    answer_form: bool = False  # the answer is call-or-reply JSON (pantheon.chat.answer_form)


class Rendered(NamedTuple):
    ids: list[int]
    prefix: str  # a forced tool call's opening, written into the prompt (see ``ForcedCall``)
    think_open: bool  # the template opened a reasoning block
    forced: str | None  # the function a demanded call is forced to
    answer_form: bool  # the answer is call-or-reply JSON (pantheon.chat.answer_form)


def answers_in_form(assets: ModelAssets, req: GenerationRequest) -> bool:
    """Whether ``req``'s answer on a model is call-or-reply JSON (``pantheon.chat.answer_form``):
    tools under ``auto`` on a template that takes none, with the grammar of that form made
    (``GenerationRequest.answer_grammar``: not when the request has an output constraint of its own,
    which it keeps, with the generic tool prompt; nor when the tools' schemas do not compile)."""
    return req.tools_enabled and req.answer_grammar is not None and not assets.template.takes_tools


def render(assets: ModelAssets, req: GenerationRequest, messages: list[dict]) -> Rendered:
    """The prompt token ids of ``messages`` under ``req``'s tools and options, and what the
    output's reading needs to know of it (:class:`Rendered`)."""
    tools = req.tools if req.tools_enabled else None
    given = tools
    answer_form = answers_in_form(assets, req)
    fallback = None  # what to render when the template refuses ``messages``
    if tools and answer_form:
        # call-or-reply JSON (pantheon.chat.answer_form): its own prompt and history
        parallel = req.parallel_tool_calls
        messages, fallback = (
            with_answer_prompt(messages, tools, parallel=parallel),
            with_answer_prompt(messages, tools, parallel=parallel, nudge=False),
        )
        given = None
    elif tools and not assets.template.takes_tools:
        # a template without a tools section (SmolLM2's) would drop them silently: the generic
        # tool prompt lists them in the system message instead, in the form the emitter reads
        fmt = assets.template.tool_syntax
        messages, given = with_tool_prompt(messages, tools, fmt.tool_prompt(tools)), None
    try:
        try:
            prompt = assets.template.render(
                messages, tools=given, add_generation_prompt=True, **req.chat_template_kwargs
            )
        except TemplateError:
            if fallback is None or len(fallback) == len(messages):
                raise
            # the template refuses the answer form's system line after the tool results
            prompt = assets.template.render(
                fallback, tools=given, add_generation_prompt=True, **req.chat_template_kwargs
            )
    except TemplateError as e:
        raise errors.chat_template_refused(e.message) from None
    opened = assets.reasoning and think_open(prompt)
    prefix, forced = "", None
    if tools and req.tool_choice in ("required", "function") and assets.tool_call_markup:
        forced = req.tool_choice_name
        if forced is None and len(tools) == 1:  # "required" with one tool names it
            forced = tools[0]["function"]["name"]
        # the call's opening in the model's own format (JSON, or Qwen3.5's XML)
        prefix = forced_call_prefix(assets.template.tool_format, forced)
        if opened:  # close the reasoning the template opened: a forced call comes at once
            prompt += "\n</think>\n\n"
            opened = False
        prompt += prefix
    return Rendered(assets.encode(prompt), prefix, opened, forced, answer_form)


def limit_of(inst: Instance) -> int:
    """The context limit ``fit_context`` fits a request to on an instance (see the module
    doc)."""
    limit = inst.max_model_len or 4096
    if inst.kv_pool_tokens:
        limit = min(limit, inst.kv_pool_tokens)
    return limit


def fit(inst: Instance, req: GenerationRequest) -> Prepared:
    """The one fitting of a routed request to ``inst``: fill the sampling fields ``req`` left
    unset from the model's defaults (in place: the generation is built from this same request;
    ``pantheon.models.generation_defaults``), then fit its context to the instance's limit (or
    the smaller ``req.num_ctx``): a conversation is rendered and passed, capped or denied
    (``fit_context``); a raw ``prompt`` is tokenized as it is and must fit, never capped
    (``fit_prompt``). A default ``max_tokens`` is a ceiling on the fitted one, never a
    reservation. Raises ``ApiError`` (400) naming the client's own field.

    Renders a template (the model author's code, bounded): call it off the event loop."""
    defaults = generation_defaults.in_force(inst)
    generation_defaults.apply(req, defaults)
    limit = limit_of(inst) if req.num_ctx is None else min(limit_of(inst), req.num_ctx)
    ceiling = generation_defaults.ceiling(req, defaults)
    if req.prompt is not None:
        return fit_prompt(inst.model_assets, req, limit, ceiling)
    prep = fit_context(inst.model_assets, req, limit)
    prep.max_tokens = generation_defaults.capped(req, defaults, prep.max_tokens)
    return prep


def _check_completion_room(req: GenerationRequest, limit: int) -> None:
    """The context rule's first half, whatever the prompt: a ``max_tokens`` no context of
    ``limit`` tokens can hold is a 400 naming the field it came from."""
    if req.max_tokens is not None and req.max_tokens >= limit:
        raise errors.max_tokens_too_large(limit, req.max_tokens, req.max_tokens_param)


def prompt_ids(assets: ModelAssets, prompt: str | list[int]) -> list[int]:
    """A raw prompt's token ids: text tokenized with the tokenizer's special tokens (as vLLM
    does for text), or the ids as given."""
    if isinstance(prompt, str):
        return assets.tokenizer.encode(prompt, add_special_tokens=True).ids
    return list(prompt)


def fit_prompt(
    assets: ModelAssets, req: GenerationRequest, limit: int, ceiling: int | None = None
) -> Prepared:
    """A raw ``req.prompt`` (no template) fitted to ``limit``: it must fit with its completion,
    never capped. The completion: ``max_tokens``; else up to the default ``ceiling`` within
    what the context leaves; else ``req.fallback_max_tokens`` as if given (16 on
    ``/v1/completions``); else the rest of the context. ``score_only``: one token, dropped."""
    assert req.prompt is not None
    ids = prompt_ids(assets, req.prompt)
    if not ids:
        p = req.param("prompt")
        raise errors.invalid_param(p, f"'{p}' is empty")
    _check_completion_room(req, limit)
    if req.score_only:
        max_tokens = 1
    elif ceiling is not None:
        max_tokens = min(ceiling, limit - len(ids))
    else:
        max_tokens = req.max_tokens or req.fallback_max_tokens or limit - len(ids)
    if max_tokens < 1 or len(ids) + max_tokens > limit:
        raise errors.prompt_too_long(limit, len(ids), max(max_tokens, 1))
    return Prepared(ids, "", False, max_tokens)


def fit_context(
    assets: ModelAssets, req: GenerationRequest, max_model_len: int, limit: int | None = None
) -> Prepared:
    """Render and tokenize ``req``, and fit its context to ``limit`` (pass / cap / deny);
    raises ``ApiError``. All the renders this takes share one time bound (``RENDER_TIMEOUT_S``:
    a template past it, or past its size bounds, is a 400 naming it; see ``pantheon.chat.template``)."""
    with render_budget(RENDER_TIMEOUT_S):
        return _fit_context(assets, req, max_model_len, limit)


def _fit_context(
    assets: ModelAssets, req: GenerationRequest, max_model_len: int, limit: int | None
) -> Prepared:
    limit = min(limit or max_model_len, max_model_len)
    _check_completion_room(req, limit)
    req = _trim_the_provably_long(assets, req, limit)
    ids, prefix, opened, forced, form = render(assets, req, req.messages)
    if len(ids) + (req.max_tokens or 1) <= limit:
        return Prepared(ids, prefix, opened, req.max_tokens or limit - len(ids), forced, answer_form=form)
    room = req.max_tokens or min(limit // 4, CAPPED_ROOM)
    return _cap(assets, req, limit, room, len(ids))


def _trim_the_provably_long(assets: ModelAssets, req: GenerationRequest, limit: int) -> GenerationRequest:
    """A message whose length alone proves it cannot fit (more characters than ``limit + 64``
    tokens can cover: no token of the vocabulary is longer than ``max_token_chars``) would only
    be capped to its newest tokens: keep just its tail of that many characters before
    tokenizing, so a megabyte prompt costs what a fitting one does. (System messages are never
    cut; the capping that follows decides what the rest becomes, as before.)"""
    most = (limit + 64) * max(1, getattr(assets, "max_token_chars", 0) or 1)
    if not any(len(m.get("content") or "") > most for m in req.messages if m["role"] != "system"):
        return req
    msgs = [
        dict(m, content=m["content"][-most:])
        if m["role"] != "system" and isinstance(m.get("content"), str) and len(m["content"]) > most
        else m
        for m in req.messages
    ]
    return msgspec.structs.replace(req, messages=msgs)


def _turns(messages: list[dict]) -> tuple[list[int], list[list[int]]]:
    """Indices of the system messages, and of the other messages grouped into turns."""
    system = [i for i, m in enumerate(messages) if m["role"] == "system"]
    turns: list[list[int]] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue
        if m["role"] == "user" or not turns:
            turns.append([i])
        else:
            turns[-1].append(i)
    return system, turns


def _cap(assets: ModelAssets, req: GenerationRequest, limit: int, room: int, full_len: int) -> Prepared:
    msgs = req.messages
    system, turns = _turns(msgs)
    budget = limit - room

    def keep(k: int) -> list[dict]:  # drop the k oldest turns
        kept = set(system) | {i for t in turns[k:] for i in t}
        return [m for i, m in enumerate(msgs) if i in kept]

    def size(messages: list[dict]) -> tuple[int, Rendered]:
        out = render(assets, req, messages)
        return len(out[0]), out

    # the fewest turns to drop: fits(k) only gets truer as k grows, so bisect
    lo, hi = 1, len(turns) - 1  # the turn being answered always stays
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        n, out = size(keep(mid))
        if n <= budget:
            best, hi = (mid, out), mid - 1
        else:
            lo = mid + 1
    if best is not None:
        k, (ids, prefix, opened, forced, form) = best
        dropped = sum(len(t) for t in turns[:k])
        return Prepared(
            ids, prefix, opened, room, forced, True, dropped, full_len - len(ids), answer_form=form
        )
    # every older turn is gone and it still does not fit: drop the oldest tokens of the rest
    k = max(0, len(turns) - 1)
    messages = [dict(m) for m in keep(k)]
    dropped = sum(len(t) for t in turns[:k])
    n, out = size(messages)
    for m in messages:
        if m["role"] == "system" or not m.get("content"):
            continue
        for _ in range(6):  # rendering is not exactly additive: a few rounds at most
            if n <= budget:
                break
            toks = assets.encode(m["content"])
            cut = min(len(toks), n - budget + 2)
            m["content"] = assets.tokenizer.decode(toks[cut:]) if cut < len(toks) else ""
            n, out = size(messages)
            if not m["content"]:
                break
        if n <= budget:
            ids, prefix, opened, forced, form = out
            return Prepared(
                ids, prefix, opened, room, forced, True, dropped, full_len - len(ids), answer_form=form
            )
    param = req.max_tokens_param if req.max_tokens is not None else "messages"
    raise errors.context_too_long(limit, full_len, room, n, param)
