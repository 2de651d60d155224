"""The HTTP server: the Quart app factory ``create_app(config, pool, registry)``.

Routes (spec: serve-architecture.md): ``GET /``, ``GET /health``, ``OPTIONS`` anywhere (CORS
preflight; every response carries the CORS headers), ``GET /v1/models`` (one Model object per name),
``POST /v1/chat/completions`` (SSE or one JSON body), and the admin API (``pantheon.api.admin.routes``: load,
unload, models, dies, cache reset, state, events). Every error is an OpenAI error object. Cheap
routes never wait on a generation.

A chat request: parse -> route (``Registry.candidates``) -> context admission (``admission``:
pass / cap / deny) -> the model's slot gate (``Registry.admit``: fast path, FIFO queue, pressure)
-> ``Generation`` -> release. The app owns the die manager, the pressure source and the feed;
one background task re-runs the queues and copies the workers' memory figures a few times a
second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from pantheon.api import middleware as ops
from pantheon.api.admin.routes import bp as admin_bp
from pantheon.api.openai import protocol as oa
from pantheon.api.openai.protocol import ApiError
from pantheon.api.openai.service import Generation, prepare
from pantheon.config.settings import ServeConfig
from pantheon.control.context import limit_of
from pantheon.control.dies import DieManager
from pantheon.control.feed import Feed
from pantheon.control.lifecycle import Models
from pantheon.control.pressure import NAMES as LEVEL_NAMES
from pantheon.control.pressure import PressureSource
from pantheon.control.registry import Registry
from pantheon.control.supervisor import admit as recovery_admit

log = logging.getLogger("pantheon.api.app")

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Session-Id, "
                                    "OpenAI-Organization, OpenAI-Project, X-Stainless-*",
    "Access-Control-Max-Age": "86400",
}

TICK_S = 0.25  # how often the queues re-run and the dies' figures refresh


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(oa.dumps(obj), status=status, headers=headers or {},
                    content_type="application/json")


def error_response(e: ApiError) -> Response:
    return json_response(e.body(), e.status, e.headers)


class _Body:
    """The SSE body: releases the instance when closed, even if it never started."""

    def __init__(self, agen, on_close):
        self._agen = agen
        self._on_close = on_close

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._agen.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()

    def __del__(self):
        self._release()


def create_app(config: ServeConfig, pool: Any, registry: Registry) -> Quart:
    app = Quart("pantheon")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    dies = DieManager(cpu_dies=config.cpu_dies, cpu_budget=config.cpu_die_budget,
                      reserve=config.die_reserve,
                      host_available=lambda: pressure.host_memory()[1])
    workers = {}  # die -> (total, free) as its worker last measured: the pressure of CUDA dies

    def measured(die: str):
        return workers.get(die)

    pressure = PressureSource(config.pressure_thresholds, die_probe=measured)
    registry.pressure = pressure.level
    feed = Feed()
    live: set[Generation] = set()  # generations in flight, ended at once on shutdown
    models = Models(config, pool, registry, dies, feed, live)
    app.extensions["pantheon"] = {"config": config, "pool": pool, "registry": registry,
                                  "models": models, "live": live, "dies": dies,
                                  "pressure": pressure, "feed": feed}
    app.register_blueprint(admin_bp)

    level_seen = {"v": 0}

    def note_pressure() -> None:
        """A change of the overall pressure level becomes an event (the tick, the test seam)."""
        level = pressure.level(d.id for d in dies.dies())
        if level != level_seen["v"]:
            feed.event("pressure", f"memory pressure {LEVEL_NAMES[level_seen['v']]} -> "
                                   f"{LEVEL_NAMES[level]}")
            level_seen["v"] = level

    app.extensions["pantheon"]["note_pressure"] = note_pressure

    async def tick() -> None:
        """Re-run the queues (pressure may have dropped), refresh the dies' figures, and note
        a change of the pressure level."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                for d in pool.dies():
                    workers[d.die] = (d.total_bytes, d.free_bytes)
                models.sync_dies()
                registry.poke()
                note_pressure()
            except Exception:  # noqa: BLE001 - the ticker must go on
                log.exception("the registry tick failed")

    @app.before_serving
    async def start_tick():
        app.extensions["pantheon"]["tick_task"] = asyncio.create_task(tick(), name="tick")

    @app.after_serving
    async def stop_tick():
        task = app.extensions["pantheon"].pop("tick_task", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        feed.close()
        await models.close()

    ops.install(app)  # access rules, limits, /metrics, request logs, graceful shutdown

    @app.after_request
    async def cors(resp: Response) -> Response:
        for k, v in CORS_HEADERS.items():
            resp.headers.setdefault(k, v)
        return resp

    @app.errorhandler(ApiError)
    async def api_error(e: ApiError):
        return error_response(e)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException):
        code = e.code or 500
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            code, "http_error")
        msg = {404: f"no route {request.method} {request.path}",
               413: f"the request body is larger than {config.max_body_bytes} bytes "
                    f"(the --max-body limit)"}.get(
            code, e.description or e.name)
        return error_response(ApiError(code, msg, code=kind))

    @app.errorhandler(Exception)
    async def internal(e: Exception):
        log.exception("unhandled error")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}",
                                       type="server_error", code="internal_error"))

    @app.before_request
    async def preflight():
        if request.method == "OPTIONS":  # CORS preflight, on any path (routed or not)
            return json_response({})
        return None

    @app.get("/", provide_automatic_options=False)
    async def root():
        return json_response({"service": "pantheon", "status": "ok"})

    @app.get("/health", provide_automatic_options=False)
    async def health():
        ok = registry.has_ready
        return json_response({"status": "ok" if ok else "loading",
                              "models": registry.names()}, 200 if ok else 503)

    def _model_objects() -> list[dict]:
        out, seen = [], set()
        for inst in registry.ready():
            if inst.name not in seen:
                seen.add(inst.name)
                out.append(oa.model_object(inst.name, inst.created, inst.max_model_len))
        return out

    @app.get("/v1/models", provide_automatic_options=False)
    async def list_models():
        return json_response(oa.model_list(_model_objects()))

    @app.get("/v1/models/<path:model_id>", provide_automatic_options=False)
    async def get_model(model_id: str):
        for m in _model_objects():
            if m["id"] == model_id:
                return json_response(m)
        raise oa.model_not_found(model_id)

    async def _prepare(inst, req, big: bool):
        if big:  # long prompts tokenize off the event loop
            return await asyncio.to_thread(prepare, inst.assets, req, inst.max_model_len,
                                           limit_of(inst))
        return prepare(inst.assets, req, inst.max_model_len, limit_of(inst))

    async def _admitted(req, big: bool):
        """Route, admit the context (pass / cap / deny), then take a slot: a denied request
        never waits in the queue. Returns ``(instance, Prepared)``."""
        likely = registry.route(req.model, req.session_id)  # 404 / 503 before any work
        prep = await _prepare(likely, req, big)
        inst = await registry.admit(req.model, req.session_id)
        try:
            if inst.path != likely.path or limit_of(inst) != limit_of(likely):
                prep = await _prepare(inst, req, big)  # another replica, another context
        except BaseException:
            registry.leave(inst)
            raise
        return inst, prep

    @app.post("/v1/chat/completions", provide_automatic_options=False)
    async def chat():
        arrived = time.monotonic()
        raw = await request.get_data(cache=False)
        req = oa.parse_chat_request(raw, header_session=request.headers.get("X-Session-Id"))
        ops.check_request(req)  # the request limits (400), and the model for the trace
        try:
            # (waits while its model restarts after a worker death: pantheon.control.supervisor)
            inst, prep = await recovery_admit(app.extensions["pantheon"],
                                              lambda: _admitted(req, len(raw) > 32768), req.model)
        except ApiError as e:
            feed.reject(e.status, req.model, e.code, e.message)  # counts 429s and 503s
            raise
        try:
            gen = Generation(pool, inst, req, prep, config.fingerprint, arrived=arrived,
                             on_tokens=feed.tokens)
        except BaseException:
            registry.leave(inst)
            raise
        live.add(gen)
        ops.attach(gen)  # per-request log and metrics; ended at once past the drain deadline

        def done() -> None:
            live.discard(gen)
            registry.leave(inst)
            feed.request_done(gen.ttft_s)

        headers = {"X-Pantheon-Instance": inst.instance_id}
        if prep.capped:
            headers["X-Context-Capped"] = "true"
        if not req.stream:
            try:
                out = await gen.complete()
            finally:
                done()
            return json_response(out, headers=headers)
        body = _Body(gen.stream_chunks(), done)
        resp = Response(body, status=200, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                 **headers})
        resp.timeout = None
        return resp

    return app
