"""The OpenAI routes: ``GET /v1/models``, ``GET /v1/models/<id>``, ``POST /v1/chat/completions``.

A chat request, in order: parse and check it -> route it to a replica (``Registry.route``: 404
or 503 before any work) -> fill the sampling fields it left out from that model's defaults
(``pantheon.models.generation_defaults``) and fit its context
(``pantheon.control.context.fit``: pass, cap or deny, 400) -> acquire a slot (``Registry.acquire_slot``: fast path, FIFO queue, memory
pressure: 429 / 503; while its model restarts after a worker death ``Supervisor.await_recovery``
holds it) -> submit a ``Generation`` to the instance's worker -> emit one JSON body or an SSE
stream -> release the slot, even when the client went away first.

The steps between parsing and rendering are ``pantheon.api.flow``'s, which every model-serving
route shares (``flow.place_chat``: a generation request's placement, every generating route's).
"""

from __future__ import annotations

import asyncio
import time

from quart import Blueprint, request

from pantheon import errors
from pantheon.api import flow
from pantheon.api import middleware as ops
from pantheon.api.generation import Generation
from pantheon.api.openai import protocol as oa
from pantheon.api.responses import json_response
from pantheon.api.state import AppState, app_state
from pantheon.control.context import limit_of
from pantheon.control.registry import Instance
from pantheon.models import generation_defaults

bp = Blueprint("openai", __name__)


def _model_objects(s: AppState) -> list[dict]:
    """Every model the server can serve: the catalog's entries (loaded or not), then the
    ready models loaded by the admin API that it does not list, each with its ``status``."""
    catalog = s.residency.catalog
    catalog.refresh()  # a model copied into a --models-dir folder shows at once
    ready: dict[str, Instance] = {}
    for inst in s.registry.ready():
        ready.setdefault(inst.name, inst)
    out, seen = [], set()
    for e in catalog.entries():
        seen.add(e.name)
        inst = ready.get(e.name)
        if inst is not None:  # what a request can really get: the context its KV pool holds
            obj = oa.model_object(e.name, inst.created, limit_of(inst), generation_defaults.in_force(inst))
            obj["kv_cache_dtype"] = str(inst.kv_types)
        else:
            obj = oa.model_object(e.name, e.modified, e.context_limit)
            obj["kv_cache_dtype"] = str(e.kv_cache_dtype or s.config.kv_types)  # what a load gets
        obj["status"] = s.residency.status(e.name)
        if e.aliases:
            obj["aliases"] = list(e.aliases)
        out.append(obj)
    for name, inst in ready.items():
        if name not in seen:
            obj = oa.model_object(name, inst.created, limit_of(inst), generation_defaults.in_force(inst))
            obj["kv_cache_dtype"] = str(inst.kv_types)
            obj["status"] = {"value": "loaded"}
            out.append(obj)
    return out


@bp.get("/v1/models", provide_automatic_options=False)
async def list_models():
    return json_response(oa.model_list(_model_objects(app_state())))


@bp.get("/v1/models/<path:model_id>", provide_automatic_options=False)
async def get_model(model_id: str):
    s = app_state()
    name = s.residency.catalog.canonical(model_id)
    for m in _model_objects(s):
        if m["id"] == name:
            return json_response(m)
    raise errors.model_not_found(model_id)


@bp.post("/v1/chat/completions", provide_automatic_options=False)
async def chat():
    s = app_state()
    arrived = time.monotonic()
    raw = await request.get_data(cache=False)
    session = request.headers.get("X-Session-Id")
    big = len(raw) > flow.BIG_BODY
    if big:  # parsing and checking megabytes is work for a thread, not the loop
        req = await asyncio.to_thread(oa.parse_chat_request, raw, header_session=session)
    else:
        req = oa.parse_chat_request(raw, header_session=session)
    del raw
    ops.body_done()  # the body's bytes leave the --max-body-in-flight count
    adm = await flow.admit(
        s,
        req,
        lambda: flow.place_chat(s, req),
        lambda inst, prep: Generation(
            s.pool, inst, req, prep, s.config.fingerprint, arrived=arrived, on_tokens=s.feed.tokens
        ),
    )
    return await flow.respond(adm, req.stream)
