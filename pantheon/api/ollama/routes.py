"""The Ollama routes, as a Quart blueprint (Ollama's ``server/routes.go``, for what a router of
resident models can do):

=======  ===============  ==================================================================
GET      /api/version     ``{"version"}``: the Ollama release whose API this follows
GET      /api/tags        the models served (``listing.served_models``)
GET      /api/ps          the loaded ones: memory, ``size_vram`` (0 on CPU), ``expires_at``,
                          ``context_length``
POST     /api/show        ``{model}``: details, ``model_info``, template, parameters,
                          capabilities
POST     /api/chat        ``messages`` -> NDJSON lines (``stream: false``: one object)
POST     /api/generate    ``prompt`` (+ ``system``, or ``raw``) -> the same, ``response``
POST     /api/embed       ``input`` (a string or strings; ``truncate``, ``dimensions``,
                          ``keep_alive``) -> ``embeddings``: the ``/v1/embeddings`` path
POST     /api/embeddings  the legacy form: ``prompt`` -> ``embedding``
POST     /api/pull, /api/push, /api/create, /api/copy, /api/blobs/<d>; DELETE /api/delete:
                          501: models come from the server's configuration
=======  ===============  ==================================================================

Generating requests go through ``pantheon.api.flow``'s ``admit`` (limits, routing, context, slot,
recovery, the live generation and its ``done()``); the request mapping is ``protocol``'s. An empty
``messages`` / ``prompt`` only loads the model (``residency.ensure``; ``done_reason: "load"``),
or with ``keep_alive: 0`` lets it go (``residency.keep(name, 0)``; ``done_reason: "unload"``),
as Ollama does. A model name may carry Ollama's ``:latest`` tag. ``/api/show`` and an unload
want a listed name; generation routes as ``/v1/chat/completions`` does (one resident model takes
any name).

Every error leaves in Ollama's shape, ``{"error": message}``, with its status: ours
(``ApiError``, naming the Ollama field it came from), Quart's HTTP ones, and the rest (500);
a stream that fails once started ends with an ``{"error"}`` line. The access rules (API keys,
origins) are the middleware's, as for ``/v1/*``; a browser's POST must say JSON there too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from quart import Blueprint, Response, request
from werkzeug.exceptions import HTTPException

from pantheon import errors
from pantheon.api import embedding, fields, flow
from pantheon.api import middleware as ops
from pantheon.api.ollama import listing
from pantheon.api.ollama import protocol as ol
from pantheon.api.ollama.generation import OllamaGeneration
from pantheon.api.responses import json_response
from pantheon.api.state import AppState, app_state
from pantheon.control.registry import Instance
from pantheon.errors import ApiError

log = logging.getLogger("pantheon.api.ollama")

bp = Blueprint("ollama", __name__)


def error_response(e: ApiError) -> Response:
    return json_response(e.ollama_body(), e.status, e.headers)


@bp.errorhandler(ApiError)
async def _api_error(e: ApiError):
    return error_response(e)


@bp.errorhandler(HTTPException)
async def _http_error(e: HTTPException):
    code = e.code or 500
    if code == 413:
        return error_response(errors.body_too_large(app_state().config.max_body_bytes))
    if code == 404:
        return error_response(errors.route_not_found(request.method, request.path))
    return error_response(errors.http_error(code, e.description or e.name))


@bp.errorhandler(Exception)
async def _internal(e: Exception):
    log.exception("unhandled error")
    return error_response(errors.internal_error(e))


# ---------------------------------------------------------------- models


@bp.get("/api/version", provide_automatic_options=False)
async def version():
    return json_response(ol.Version(ol.OLLAMA_VERSION))


def _tag(m: listing.Served) -> ol.ListModel:
    files, shape = listing.files_of(m.path), listing.shape_of(m)
    return ol.ListModel(
        name=m.name,
        model=m.name,
        modified_at=ol.iso(files.modified),
        size=files.size,
        digest=files.digest,
        details=listing.details(m, files, shape),
        capabilities=listing.capabilities(m),
    )


@bp.get("/api/tags", provide_automatic_options=False)
async def tags():
    served = listing.served_models(app_state())
    models = await asyncio.to_thread(lambda: [_tag(m) for m in served])
    return json_response(ol.ListResponse(models=models))


def _expires_at(s: AppState, m: listing.Served) -> str:
    """When the model is let go if left idle (its keep-alive, ``pantheon.control.residency``);
    Ollama's "forever" is its longest duration from now."""
    whens = [w for w in (s.residency.expires_at(i) for i in m.instances) if w is not None]
    return ol.iso(min(whens)) if whens else ol.forever()


@bp.get("/api/ps", provide_automatic_options=False)
async def ps():
    s = app_state()
    loaded = [m for m in listing.served_models(s) if m.instances]
    tagged = await asyncio.to_thread(lambda: [_tag(m) for m in loaded])
    out = []
    for m, t in zip(loaded, tagged):
        size, vram = listing.memory(s, m)
        out.append(
            ol.ProcessModel(
                name=m.name,
                model=m.name,
                size=size,
                digest=t.digest,
                details=t.details,
                expires_at=_expires_at(s, m),
                size_vram=vram,
                context_length=listing.context_length(m),
            )
        )
    return json_response(ol.ProcessResponse(models=out))


def _show(m: listing.Served) -> ol.ShowResponse:
    files, shape = listing.files_of(m.path), listing.shape_of(m)
    return ol.ShowResponse(
        modelfile=listing.modelfile(m),
        parameters=listing.parameters(m),
        template=listing.template(m),
        details=listing.details(m, files, shape),
        model_info=listing.model_info(files, shape),
        capabilities=listing.capabilities(m),
        modified_at=ol.iso(files.modified),
    )


@bp.post("/api/show", provide_automatic_options=False)
async def show():
    s = app_state()
    body = ol.decode(await request.get_data(cache=False), ol.NameBody)
    ops.body_done()
    name = ol.model_name(body)
    m = listing.find(s, name)
    if m is None:
        raise errors.ollama_model_not_found(name)
    return json_response(await asyncio.to_thread(_show, m))


def _manage(route: str) -> Callable:
    async def refuse(**_: str):
        raise errors.ollama_manage_unsupported(route)

    refuse.__name__ = "refuse_" + route.strip("/").replace("/", "_")
    return refuse


for _route, _methods in (
    ("/api/pull", ["POST"]),
    ("/api/push", ["POST"]),
    ("/api/create", ["POST"]),
    ("/api/copy", ["POST"]),
    ("/api/delete", ["DELETE"]),
):
    bp.add_url_rule(_route, view_func=_manage(_route), methods=_methods, provide_automatic_options=False)
bp.add_url_rule(
    "/api/blobs/<digest>",
    view_func=_manage("/api/blobs"),
    methods=["HEAD", "POST"],
    provide_automatic_options=False,
)


@bp.post("/api/embed", provide_automatic_options=False)
async def embed():
    """Ollama's ``/api/embed``: the ``/v1/embeddings`` path (same slots, pooling and checks)."""
    return await _embed(legacy=False)


@bp.post("/api/embeddings", provide_automatic_options=False)
async def embeddings_legacy():
    """The deprecated ``/api/embeddings``: one ``prompt``, one ``embedding`` (empty for an
    empty prompt, as Ollama answers it)."""
    return await _embed(legacy=True)


async def _embed(legacy: bool) -> Response:
    s = app_state()
    t0 = time.monotonic_ns()
    raw = await request.get_data(cache=False)
    big = len(raw) > flow.BIG_BODY
    body = await asyncio.to_thread(fields.load_json, raw) if big else fields.load_json(raw)
    del raw
    ops.body_done()
    if not isinstance(body, dict):
        raise errors.not_an_object()
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise errors.invalid_param("model", "model is required")
    name = name.removesuffix(":latest")
    field = "prompt" if legacy else "input"
    value = body.get(field)
    if legacy and value == "":
        return json_response({"embedding": []})
    inputs = embedding.parse_inputs(value, field)
    truncate = body.get("truncate", True)
    dims = body.get("dimensions")
    if not isinstance(truncate, bool):
        raise errors.invalid_param("truncate", "'truncate' must be a boolean")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise errors.invalid_param("dimensions", "'dimensions' must be a positive integer")
    try:
        inst, vectors, tokens = await embedding.embed_inputs(
            s,
            name,
            inputs,
            dims=dims,
            keep_alive=ol.keep_alive(body.get("keep_alive")),
            big=big,
            param=field,
            truncate=truncate,
        )
    except ApiError as e:
        raise _ollama_error(e, name) from None
    if legacy:
        return json_response({"embedding": vectors[0]})
    took = time.monotonic_ns() - t0
    return json_response(
        {
            "model": inst.name,
            "embeddings": vectors,
            "total_duration": took,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }
    )


@bp.route(
    "/api/<path:rest>", methods=["GET", "POST", "DELETE", "PUT", "PATCH"], provide_automatic_options=False
)
async def unknown(rest: str):
    raise errors.route_not_found(request.method, request.path)


# ---------------------------------------------------------------- generation


async def _body(kind: type[ol.BodyT]) -> tuple[ol.BodyT, bool]:
    """The request's body, decoded (off the event loop when big), and whether it was big."""
    raw = await request.get_data(cache=False)
    big = len(raw) > flow.BIG_BODY
    body = await asyncio.to_thread(ol.decode, raw, kind) if big else ol.decode(raw, kind)
    ops.body_done()  # the body's bytes leave the --max-body-in-flight count
    return body, big


async def _peek(s: AppState, name: str) -> Instance | None:
    """The instance a request for ``name`` would go to, for what its template supports (a
    model the catalog knows is loaded first); None when routing fails: ``flow.admit`` answers it."""
    await s.residency.ensure(name)
    try:
        return s.registry.route(name)
    except ApiError:
        return None


def _reasoning(inst: Instance | None) -> bool | None:
    return None if inst is None or inst.assets is None else bool(inst.model_assets.reasoning)


async def _load_or_unload(s: AppState, kind: str, name: str, keep: float | str | None) -> Response:
    """An empty conversation: load the model (``done_reason: "load"``), or with
    ``keep_alive: 0`` let it go once idle (``"unload"``)."""
    keep_alive = ol.keep_alive(keep)
    if keep_alive == 0:
        m = listing.find(s, name)
        if m is None:
            raise errors.ollama_model_not_found(name)
        s.residency.keep(m.name, 0)
        return json_response(ol.output(kind, m.name, done=True, reason="unload"))
    await s.residency.ensure(name)
    try:
        inst = s.registry.route(name)
    except ApiError as e:
        raise _ollama_error(e, name) from None
    s.residency.keep(inst.name, keep_alive)
    return json_response(ol.output(kind, inst.name, done=True, reason="load"))


def _ollama_error(e: ApiError, name: str | None) -> ApiError:
    """Ollama's own wording of a model it does not have; any other error as it is (it names
    the Ollama field already: ``GenerationRequest.names``)."""
    if e.code == "model_not_found" and e.param == "model":
        return errors.ollama_model_not_found(name or "")
    return e


async def _generate(s: AppState, oreq: ol.Request, kind: str, arrived: float) -> Response:
    req = oreq.chat
    try:
        adm = await flow.admit(
            s,
            req,
            lambda: flow.place_chat(s, req),
            lambda inst, prep: OllamaGeneration(
                s.pool,
                inst,
                req,
                prep,
                s.config.fingerprint,
                arrived=arrived,
                on_tokens=s.feed.tokens,
                kind=kind,
                raw=req.prompt is not None,
            ),
        )
    except ApiError as e:
        raise _ollama_error(e, req.model) from None
    return await flow.respond(adm, req.stream, flow.NDJSON)


@bp.post("/api/chat", provide_automatic_options=False)
async def chat():
    s, arrived = app_state(), time.monotonic()
    body, big = await _body(ol.ChatBody)
    name = listing.resolve(s, ol.model_name(body))
    if not body.messages:
        return await _load_or_unload(s, "chat", name, body.keep_alive)
    reasoning = _reasoning(await _peek(s, name))
    session = request.headers.get("X-Session-Id")

    def mapped() -> ol.Request:  # the checks: a thread's work for a big body
        return ol.chat_request(body, name, reasoning=reasoning, header_session=session)

    oreq = await asyncio.to_thread(mapped) if big else mapped()
    return await _generate(s, oreq, "chat", arrived)


@bp.post("/api/generate", provide_automatic_options=False)
async def generate():
    s, arrived = app_state(), time.monotonic()
    body, _ = await _body(ol.GenerateBody)
    name = listing.resolve(s, ol.model_name(body))
    if not body.prompt:
        return await _load_or_unload(s, "generate", name, body.keep_alive)
    reasoning = None if body.raw else _reasoning(await _peek(s, name))
    session = request.headers.get("X-Session-Id")
    oreq = ol.generate_request(body, name, reasoning=reasoning, header_session=session)
    return await _generate(s, oreq, "generate", arrived)
