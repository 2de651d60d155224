"""The one flow every model-serving route follows: **place → admit → respond**.

Each route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/embeddings``,
Ollama's ``/api/chat``, ``/api/generate`` and ``/api/embed``) parses its own body and renders its
own answer; between the two they share this module:

- ``place(s, model, session_id, prepare)``: make a catalog model resident (an alias becomes its
  model's name), route to the replica a request would take now (404 / 503 before any work),
  ``prepare(instance)`` the request for it (defaults, template, tokens, context, constraint:
  every 400 comes here, before any slot), acquire a slot (fast path, FIFO queue, pressure:
  429 / 503; a catalog model let go since it was made resident loads again, once), and prepare
  again when the slot is on a replica that differs from the one prepared for;
- ``place_chat(s, req)``: ``place`` for a ``GenerationRequest`` (every generating route's): its
  token ids checked (``check_token_ids``), ``pantheon.control.context.fit`` and its output
  constraint checked, off the event loop;
- ``through_recovery(s, place, model)``: the same, held while the model restarts after a worker
  death (``Supervisor.await_recovery``);
- ``admit(s, req, place, make)``: the request limits, placement through recovery (refusals
  counted), the generation made and registered live, and its ``done()``;
- ``respond(admitted, stream, ...)``: one JSON body, or a stream (SSE, or Ollama's NDJSON) that
  releases the slot when it ends or the client goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple, TypeVar

from quart import Response

from pantheon import errors
from pantheon.api import middleware as ops
from pantheon.api import structured
from pantheon.api.generation import Generation, checked_constraint, needs_constraint, vocab_size
from pantheon.api.responses import json_response
from pantheon.api.state import AppState
from pantheon.control.context import Prepared, fit, limit_of
from pantheon.control.registry import Instance
from pantheon.core.request import GenerationRequest
from pantheon.core.token_times import router_times
from pantheon.errors import ApiError
from pantheon.models import generation_defaults

T = TypeVar("T")

BIG_BODY = 32768  # bytes: a body this long is parsed and tokenized off the event loop

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


def same_context(a: Instance, b: Instance) -> bool:
    """Whether a request prepared for ``b`` holds on ``a`` as it is: the same model files, the
    same context limit and the same generation defaults."""
    return (
        a.path == b.path
        and limit_of(a) == limit_of(b)
        and generation_defaults.in_force(a) == generation_defaults.in_force(b)
    )


async def place(
    s: AppState,
    model: str | None,
    session_id: str | None,
    prepare: Callable[[Instance], Awaitable[T]],
) -> tuple[str | None, Instance, T]:
    """``(model name, instance holding a slot, prepare's result)``; see the module doc. The
    caller releases the slot (``s.registry.leave``) once it is done with it."""
    # until it holds a slot the request keeps its model from being evicted under it
    with s.residency.wanting(model):
        name = await s.residency.ensure(model)
        likely = s.registry.route(name, session_id)
        ready = await prepare(likely)
        try:
            inst = await s.registry.acquire_slot(name, session_id)
        except ApiError as e:
            # let go since ensure() (an idle unload, an eviction): a catalog model loads again, once
            if e.code != "model_not_ready" or not s.residency.catalog.known(name or ""):
                raise
            await s.residency.ensure(name)
            inst = await s.registry.acquire_slot(name, session_id)
    try:
        if not same_context(inst, likely):
            ready = await prepare(inst)  # another replica, another context
    except BaseException:
        s.registry.leave(inst)
        raise
    return name, inst, ready


def check_token_ids(inst: Instance, req: GenerationRequest, prompt: list[int] | None = None) -> None:
    """A 400 naming the field for a token id ``inst``'s model does not have (``logit_bias``'s
    keys, a completion prompt's ids), before any slot: a stream would only have an error event.
    A model that only embeds (BERT) is a 400 here: every generating route comes through."""
    if not getattr(inst.shape, "can_generate", True):
        raise errors.model_cannot_generate(inst.name)
    vocab = vocab_size(inst)
    if prompt is not None:
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise errors.invalid_param(
                "prompt", f"'prompt' token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
    bad = next((t for t in req.logit_bias if not 0 <= t < vocab), None)
    if bad is not None:
        raise errors.invalid_param(
            "logit_bias", f"'logit_bias' token id {bad} is outside the vocabulary (0..{vocab - 1})"
        )


async def place_chat(s: AppState, req: GenerationRequest) -> tuple[Instance, Prepared]:
    """Place a generation request (``place``), whichever route: its token ids checked, its defaults
    filled, its context fitted and its constraint checked for the instance, all before a slot;
    ``req.model`` becomes the model's name (an alias resolved). Returns the instance holding a
    slot and the request's ``Prepared``."""

    if req.answer_grammar is not None and req.tools and s.config.ops.tool_auto == "decide":
        # every answer a call or a reply (--tool-auto decide): the grammar without prose
        req.answer_grammar = structured.call_or_reply_grammar(
            req.tools, parallel=req.parallel_tool_calls, prose=False
        )

    async def prepare(inst: Instance) -> Prepared:
        check_token_ids(inst, req)
        # off the event loop: a model's template is its author's code, and even bounded
        # (chat/template.py: 0.5 s, sizes) it must never hold /health, other streams or signals
        prep = await asyncio.to_thread(fit, inst, req)
        if needs_constraint(req, prep):  # what the model cannot enforce is a 400 before any slot
            prep.constraint = await asyncio.to_thread(checked_constraint, inst, req, prep)
        return prep

    req.model, inst, prep = await place(s, req.model, req.session_id, prepare)
    return inst, prep


async def through_recovery(
    s: AppState, place: Callable[[], Awaitable[tuple[Instance, T]]], model: str | None
) -> tuple[Instance, T]:
    """``place()``, waiting while the model restarts after a worker death when a supervisor
    runs (``pantheon.control.supervisor``)."""
    if s.supervisor is None:
        return await place()
    return await s.supervisor.await_recovery(place, model, s.registry.queue_timeout_s)


class Admitted(NamedTuple):
    """A request that holds a slot: its generation, instance, context, and ``done()``, which
    releases the slot (call it exactly once: ``respond`` does)."""

    gen: Generation
    inst: Instance
    prep: Prepared
    done: Callable[[], None]


async def admit(
    s: AppState,
    req: GenerationRequest,
    place: Callable[[], Awaitable[tuple[Instance, Prepared]]],
    make: Callable[[Instance, Prepared], Generation],
) -> Admitted:
    """The request limits (400), ``place()`` through a model's recovery (429 / 503 counted),
    then ``make(inst, prep)`` the generation and register it live. The slot is released if
    any of it fails; after it, by ``done()``."""
    ops.check_request(req)  # the request limits (400), and the model for the trace
    try:
        inst, prep = await through_recovery(s, place, req.model)
    except ApiError as e:
        s.feed.reject(e.status, req.model, e.code, e.message)  # counts 429s and 503s
        raise
    try:
        gen = make(inst, prep)
    except BaseException:
        s.registry.leave(inst)
        raise
    s.live.add(gen)
    ops.attach(gen)  # per-request log and metrics; ended at once past the drain deadline

    def done() -> None:
        s.live.discard(gen)
        s.registry.leave(inst)
        s.residency.keep(inst.name, req.keep_alive)
        s.feed.request_done(gen.ttft_s)

    return Admitted(gen, inst, prep, done)


async def respond(adm: Admitted, stream: bool, content_type: str = SSE) -> Response:
    """The answer of an admitted request: the whole generation as one JSON body, or its
    chunks as a ``content_type`` stream; the slot is released either way. Headers: the
    instance that served it, and whether its context was capped."""
    headers = {"X-Pantheon-Instance": adm.inst.instance_id}
    if adm.prep.capped:
        headers["X-Context-Capped"] = "true"
    if not stream:
        try:
            out = await adm.gen.complete()
        finally:
            adm.done()
        return json_response(out, headers=headers)
    return streaming_response(adm.gen.stream_chunks(), adm.done, headers, content_type)


def streaming_response(
    body: AsyncIterator[bytes], done: Callable[[], None], headers: dict[str, str], content_type: str = SSE
) -> Response:
    """A 200 stream of ``body`` that calls ``done()`` when it is closed (the client went away,
    or the stream ended) or never started."""
    resp = Response(
        Body(body, done),
        status=200,
        content_type=content_type,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
    )
    resp.timeout = None
    return resp


class Body:
    """A streamed body: releases the slot when closed, even if it never started."""

    def __init__(self, agen: AsyncIterator[bytes], on_close: Callable[[], None]):
        self._agen = agen
        self._on_close: Callable[[], None] | None = on_close

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._agen.__anext__()
        router_times.stamp("w")
        return chunk

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._agen, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._release()

    def _release(self) -> None:
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()

    def __del__(self) -> None:
        self._release()
