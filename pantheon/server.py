"""The HTTP server: the Quart app factory ``create_app(config, pool, registry)``.

Routes (spec: serve-architecture.md): ``GET /``, ``GET /health``, ``OPTIONS`` anywhere (CORS
preflight; every response carries the CORS headers), ``GET /v1/models`` (one Model object per name),
``POST /v1/chat/completions`` (SSE or one JSON body), and the admin table: ``POST
/admin/models/load``, ``POST /admin/models/unload``, ``GET /admin/dies``. Every error is an OpenAI
error object. Cheap routes never wait on a generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from pantheon import openai_api as oa
from pantheon import ops
from pantheon.config import ServeConfig, parse_dies
from pantheon.generate import Generation, prepare
from pantheon.openai_api import ApiError
from pantheon.protocol import LoadModel
from pantheon.registry import READY, Instance, ModelAssets, Registry
from pantheon.workerpool import LoadFailedError, PoolError

log = logging.getLogger("pantheon.server")

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Session-Id, "
                                    "OpenAI-Organization, OpenAI-Project, X-Stainless-*",
    "Access-Control-Max-Age": "86400",
}

# The spec's status_for_reason: admission/table-full 507, duplicate/unloading 409, not-found 404,
# anything else 500.
LOAD_STATUS = {"not_found": 404, "out_of_memory": 507, "admission": 507, "duplicate": 409,
               "cancelled": 409}
MAX_INSTANCES = 16  # the spec's MR_MAX_MODELS


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


class Models:
    """Loading and unloading instances: one upload at a time; a failed load changes nothing."""

    def __init__(self, config: ServeConfig, pool: Any, registry: Registry):
        self.config, self.pool, self.registry = config, pool, registry
        self._upload = asyncio.Lock()

    def _place(self) -> tuple[str, ...]:
        """A die for a model given none: the alive die holding the fewest instances."""
        dies = [d.die for d in self.pool.dies() if d.alive]
        if not dies:
            raise ApiError(507, "no die is available to place the model on (start the server "
                                "with --cpu-dies N or give --dies)", type="server_error",
                           code="no_die")
        count = {d: 0 for d in dies}
        for inst in self.registry.instances():
            if inst.die in count:
                count[inst.die] += 1
        return (min(dies, key=lambda d: count[d]),)

    async def ensure_worker(self, die: str) -> None:
        known = {d.die: d for d in self.pool.dies()}
        if die in known and known[die].alive:
            return
        budget = self.config.cpu_die_budget if die.startswith("cpu:") else None
        await self.pool.start_worker(die, budget_bytes=budget)

    async def load(self, path: str, name: str | None = None, dies: tuple[str, ...] = (),
                   quantize: bool = False) -> Instance:
        name = name or os.path.basename(os.path.normpath(path))
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise ApiError(404, f"no model folder at {path!r} (it needs a config.json)",
                           param="path", code="not_found")
        try:
            assets = await asyncio.to_thread(ModelAssets, path)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer or template
            raise ApiError(500, f"cannot read the model's tokenizer or template: {e}",
                           type="server_error", param="path", code="invalid") from None
        async with self._upload:
            if len(self.registry.instances()) >= MAX_INSTANCES:
                raise ApiError(507, f"the model table is full ({MAX_INSTANCES} instances)",
                               type="server_error", code="table_full")
            dies = tuple(dies) or self._place()
            for die in dies:
                if die.startswith("cpu:") and int(die[4:]) >= self.config.cpu_dies:
                    raise ApiError(400, f"die {die} does not exist (--cpu-dies "
                                        f"{self.config.cpu_dies})", param="dies", code="invalid")
            try:
                await self.ensure_worker(dies[0])
            except PoolError as e:
                raise ApiError(500, str(e), type="server_error", code="worker_start") from None
            inst = self.registry.reserve(name, path, dies)
            msg = LoadModel(instance=inst.instance_id, path=os.path.abspath(path),
                            dtype=self.config.dtype,
                            devices=list(dies),
                            kv_budget_bytes=self.config.kv_budget, num_slots=self.config.slots,
                            prefill_chunk=self.config.prefill_chunk,
                            max_model_len=self.config.max_model_len, quantize=quantize)
            try:
                loaded = await self.pool.load(dies[0], msg)
            except BaseException as e:
                self.registry.discard(inst)
                if isinstance(e, LoadFailedError):
                    status = LOAD_STATUS.get(e.kind, 500)
                    raise ApiError(status, f"load failed: {e.reason}", code=e.kind,
                                   type="server_error" if status >= 500 else
                                   "invalid_request_error") from None
                if isinstance(e, PoolError):
                    raise ApiError(500, str(e), type="server_error", code="worker_died") from None
                raise
        assets.add_eos(loaded.eos_token_ids)
        self.registry.publish(inst, assets=assets, loaded=loaded,
                              max_model_len=loaded.max_model_len)
        log.info("loaded %s as %s on %s (max_model_len %d)", name, inst.instance_id,
                 ",".join(dies), loaded.max_model_len)
        return inst

    async def unload(self, name: str) -> list[Instance]:
        insts = [i for i in self.registry.find(name) if i.state == READY]
        if not insts:
            if self.registry.find(name):
                raise ApiError(409, f"model {name!r} is loading or already unloading",
                               param="name", code="conflict")
            raise ApiError(404, f"no model or instance named {name!r}", param="name",
                           code="model_not_found")
        for inst in insts:
            await self.registry.drain(inst, self.config.queue_timeout_s)
            self.registry.discard(inst)
            with contextlib.suppress(Exception):
                await self.pool.unload(inst.die, inst.instance_id)
        return insts

    def worker_dead(self, die: str, reason: str) -> None:
        for inst in self.registry.instances():
            if die in inst.dies and inst.state == READY:
                inst.state = "failed"
                log.error("instance %s is failed: its worker on %s died", inst.instance_id, die)


def create_app(config: ServeConfig, pool: Any, registry: Registry) -> Quart:
    app = Quart("pantheon")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    models = Models(config, pool, registry)
    live: set[Generation] = set()  # generations in flight, ended at once on shutdown
    app.extensions["pantheon"] = {"config": config, "pool": pool, "registry": registry,
                                  "models": models, "live": live}
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

    @app.post("/v1/chat/completions", provide_automatic_options=False)
    async def chat():
        raw = await request.get_data(cache=False)
        req = oa.parse_chat_request(raw, header_session=request.headers.get("X-Session-Id"))
        ops.check_request(req)  # the request limits (400), and the model for the trace
        inst = await registry.admit(req.model, req.session_id)
        try:
            if len(raw) > 32768:  # long prompts tokenize off the event loop
                prep = await asyncio.to_thread(prepare, inst.assets, req, inst.max_model_len)
            else:
                prep = prepare(inst.assets, req, inst.max_model_len)
            gen = Generation(pool, inst, req, prep, config.fingerprint)
        except BaseException:
            registry.leave(inst)
            raise
        live.add(gen)
        ops.attach(gen)  # per-request log and metrics; ended at once past the drain deadline

        def done() -> None:
            live.discard(gen)
            registry.leave(inst)

        if not req.stream:
            try:
                out = await gen.complete()
            finally:
                done()
            return json_response(out)
        body = _Body(gen.stream_chunks(), done)
        resp = Response(body, status=200, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp.timeout = None
        return resp

    # ------------------------------------------------------------ admin

    async def _json_object() -> dict:
        raw = await request.get_data(cache=False)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise oa.invalid(None, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise oa.invalid(None, "the request body must be a JSON object")
        return body

    @app.post("/admin/models/load", provide_automatic_options=False)
    async def admin_load():
        body = await _json_object()
        path, name = body.get("path"), body.get("name")
        if not isinstance(path, str) or not path:
            raise oa.invalid("path", "'path' must be a model folder path")
        if name is not None and not isinstance(name, str):
            raise oa.invalid("name", "'name' must be a string")
        dies = body.get("dies") or ()
        if isinstance(dies, list):
            if not all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in dies):
                raise oa.invalid("dies", "'dies' must be a list of die ids")
            dies = ",".join(str(d) for d in dies)
        if dies and not isinstance(dies, str):
            raise oa.invalid("dies", "'dies' must be a list of die ids")
        try:
            die_t = parse_dies(dies, "dies") if dies else ()
        except ValueError as e:
            raise oa.invalid("dies", str(e)) from None
        quantize = body.get("quantize", False)
        if not isinstance(quantize, bool):
            raise oa.invalid("quantize", "'quantize' must be a boolean")
        inst = await models.load(path, name, die_t, quantize)
        return json_response({"status": "loaded", **inst.info()})

    @app.post("/admin/models/unload", provide_automatic_options=False)
    async def admin_unload():
        body = await _json_object()
        name = body.get("name") or body.get("instance")
        if not isinstance(name, str) or not name:
            raise oa.invalid("name", "'name' must be a model name or instance id")
        gone = await models.unload(name)
        return json_response({"status": "unloaded", "instances": [i.instance_id for i in gone]})

    @app.get("/admin/dies", provide_automatic_options=False)
    async def admin_dies():
        out = []
        for d in pool.dies():
            st = d.last_stats
            engine = {s.instance: s for s in (st.instances if st else [])}
            insts = []
            for i in registry.instances():
                if d.die in i.dies:
                    info, es = i.info(), engine.get(i.instance_id)
                    if es is not None:
                        info["slots_busy"] = sum(1 for sl in es.slots if sl.state != "idle")
                        info["engine_waiting"] = es.waiting
                        info["kv_blocks_used"] = es.kv_blocks_used
                        info["kv_blocks_total"] = es.kv_blocks_total
                    insts.append(info)
            out.append({"die": d.die, "device_name": d.device_name, "alive": d.alive,
                        "pid": d.pid, "error": d.error, "total_bytes": d.total_bytes,
                        "free_bytes": d.free_bytes,
                        "used_bytes": max(0, d.total_bytes - d.free_bytes),
                        "budget_bytes": config.cpu_die_budget if d.die.startswith("cpu:")
                        else d.total_bytes,
                        "step_ms_avg": st.step_ms_avg if st else None,
                        "instances": insts})
        return json_response({"object": "list", "data": out})

    @app.get("/admin/models", provide_automatic_options=False)
    async def admin_models():
        return json_response({"object": "list",
                              "data": [i.info() for i in registry.instances()]})

    return app
