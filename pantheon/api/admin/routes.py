"""The admin API, as a Quart blueprint: load and unload models, the instance and die tables, the
prefix cache reset, and the dashboard's feed.

=======  ======================  ==========================================================
POST     /admin/models/load      ``{path, name?, dies?, quantize?, slots?, max_context?, wait?}``
                                 200 with the instance once ready; 202 at once with
                                 ``wait: false`` (progress in GET /admin/models); 404 no such
                                 folder, 400 bad request or unsupported architecture, 409 a
                                 load/unload of that name in progress or a duplicate replica,
                                 507 no room (which die lacks how much) or a full table, 500
                                 anything else
POST     /admin/models/unload    ``{name | instance, drain_timeout?}``: every replica of a name,
                                 or one instance; drains up to the deadline (30 s), then ends
                                 the rest with a clean error
GET      /admin/models           instances (loading / ready / draining / failed) and recently
                                 failed loads
GET      /admin/dies             per die: budget, used, free, pressure, instances
POST     /admin/cache/reset      ``{name?}``: forget cached prefixes (one model, or all)
GET      /admin/state            one ``pantheon.snapshot.Snapshot``
GET      /admin/events           Server-Sent Events: ``event: snapshot`` every ``interval``
                                 seconds (default 1; ``interval_ms`` also works) and
                                 ``event: event`` for each event as it happens
POST     /admin/test/pressure    ``{level, die?}`` forces a pressure level (``level: null``
                                 clears); only with ``PANTHEON_TEST_HOOKS=1``
=======  ======================  ==========================================================
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
from quart import Blueprint, Response, current_app, request

from pantheon import snapshot as st
from pantheon.api.openai import protocol as oa
from pantheon.config.settings import ConfigError, parse_dies
from pantheon.control.feed import booked, die_cpu_paths, engine_stats, hit_rate, snapshot
from pantheon.control.pressure import NAMES

bp = Blueprint("admin", __name__)
MIN_INTERVAL_S = 0.05


def _state() -> dict:
    return current_app.extensions["pantheon"]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(oa.dumps(obj), status=status, content_type="application/json")


async def _json_object() -> dict:
    raw = await request.get_data(cache=True)  # cached: the access rules may have read it
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise oa.invalid(None, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise oa.invalid(None, "the request body must be a JSON object")
    return body


def _typed(body: dict, key: str, kind: type | tuple, word: str, default: Any = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise oa.invalid(key, f"'{key}' must be {word}")
    return v


def _dies(raw: Any) -> tuple[str, ...]:
    if raw in (None, "", []):
        return ()
    if isinstance(raw, list):
        if not all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in raw):
            raise oa.invalid("dies", "'dies' must be a list of die ids (N, cuda:N or cpu:N)")
        raw = ",".join(str(d) for d in raw)
    if not isinstance(raw, str):
        raise oa.invalid("dies", "'dies' must be a list of die ids (N, cuda:N or cpu:N)")
    try:
        return parse_dies(raw, "dies")
    except ConfigError as e:
        raise oa.invalid("dies", str(e)) from None


# ---------------------------------------------------------------- views


def instance_view(s: dict, inst: Any, engine: dict) -> dict:
    """One row of GET /admin/models: the registry's, the worker's and the die manager's view."""
    es = engine.get(inst.instance_id)
    q = s["registry"].queues().get(inst.name)
    out = inst.info()
    w, kv = booked(s["dies"], inst.instance_id)
    out.update(weights_bytes=w, kv_bytes=kv, queue_depth=len(q) if q is not None else 0,
               kv_pool_tokens=inst.kv_pool_tokens, slots_busy=inst.gate.active)
    if es is not None:
        block = es.kv_bytes // es.kv_blocks_total if es.kv_blocks_total else 0
        out.update(slots_busy=sum(1 for sl in es.slots if sl.state != "idle"),
                   engine_waiting=es.waiting, kv_blocks_used=es.kv_blocks_used,
                   kv_blocks_total=es.kv_blocks_total,
                   cache={"blocks": es.kv_blocks_cached, "bytes": es.kv_blocks_cached * block,
                          "hit_blocks": es.cache_hit_blocks,
                          "query_blocks": es.cache_query_blocks, "hit_rate": hit_rate(es)})
    return out


def die_views(s: dict) -> list[dict]:
    pool, dies, pressure, registry = s["pool"], s["dies"], s["pressure"], s["registry"]
    workers = {d.die: d for d in pool.dies()}
    engine = engine_stats(pool)
    paths = die_cpu_paths(registry)
    out = []
    for d in dies.dies():
        wk = workers.get(d.id)
        stats = wk.last_stats if wk is not None else None
        level = pressure.die_level(d.id)
        insts = [instance_view(s, i, engine) for i in registry.instances() if d.id in i.dies]
        out.append({
            "die": d.id, "kind": d.kind,
            "device_name": d.device_name or (wk.device_name if wk is not None else ""),
            "alive": bool(wk and wk.alive), "worker": "running" if wk and wk.alive else (
                "dead" if wk is not None else "not started"),
            "pid": wk.pid if wk is not None else None,
            "error": wk.error if wk is not None and not wk.alive else None,
            # liveness: deaths and restarts since start, the latest death's reason (kept after
            # the restart), and the heartbeat's view of the step running now
            "deaths": wk.deaths if wk is not None else 0,
            "restarts": wk.restarts if wk is not None else 0,
            "last_death": ({"reason": wk.last_death, "at": wk.last_death_at}
                           if wk is not None and wk.last_death else None),
            "step_running_s": (round(wk.beat.turn_s, 3) if wk is not None and wk.alive
                               and wk.beat is not None else None),
            "steps": wk.beat.steps if wk is not None and wk.beat is not None else None,
            "total_bytes": d.total_bytes, "reserve_bytes": d.reserve_bytes,
            "budget_bytes": d.budget_bytes, "used_bytes": d.used_bytes,
            "weights_bytes": d.weights_bytes, "kv_bytes": d.kv_bytes,
            "free_bytes": max(0, d.budget_bytes - d.used_bytes),
            "measured_free_bytes": wk.free_bytes if wk is not None else None,
            "pressure": level, "pressure_name": NAMES[level],
            # CPU dies: the vector ISA, which CPU paths work here, and each instance's choice
            "isa": (wk.cpu_isa or None) if wk is not None else None,
            "cpu_paths": {n: (why or "ok") for n, why in wk.cpu_paths.items()} if wk else {},
            "cpu_path": paths.get(d.id),
            "step_ms_avg": stats.step_ms_avg if stats is not None else None,
            "bookings": {iid: {"weights_bytes": b[0], "kv_bytes": b[1]}
                         for iid, b in sorted(d.bookings.items())},
            "instances": insts})
    return out


# ---------------------------------------------------------------- routes


@bp.post("/admin/models/load", provide_automatic_options=False)
async def load():
    body = await _json_object()
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise oa.invalid("path", "'path' must be a model folder path")
    name = _typed(body, "name", str, "a string")
    if name is not None and (not name.strip() or "#" in name or len(name) > 128):
        raise oa.invalid("name", "'name' must be 1 to 128 characters, without '#'")
    dies = _dies(body.get("dies"))
    quantize = _typed(body, "quantize", bool, "a boolean", False)
    slots = _typed(body, "slots", int, "an integer")
    if slots is not None and not 1 <= slots <= 256:
        raise oa.invalid("slots", "'slots' must be between 1 and 256")
    max_context = _typed(body, "max_context", int, "an integer")
    if max_context is not None and max_context < 16:
        raise oa.invalid("max_context", "'max_context' must be at least 16 tokens")
    wait = _typed(body, "wait", bool, "a boolean", True)
    s = _state()
    inst, task = await s["models"].start_load(path, name, dies, quantize, slots=slots,
                                              max_context=max_context, background=not wait)
    if not wait:
        return json_response({"status": "loading", **instance_view(s, inst, {})}, 202)
    await asyncio.shield(task)  # a client that goes away does not stop the load
    return json_response({"status": "loaded", **instance_view(s, inst, engine_stats(s["pool"]))})


@bp.post("/admin/models/unload", provide_automatic_options=False)
async def unload():
    body = await _json_object()
    target = body.get("name") or body.get("instance")
    if not isinstance(target, str) or not target:
        raise oa.invalid("name", "'name' must be a model name or instance id")
    timeout = body.get("drain_timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(
            timeout, bool) or not 0 <= timeout <= 3600):
        raise oa.invalid("drain_timeout", "'drain_timeout' must be seconds between 0 and 3600")
    done = await _state()["models"].unload(target, timeout)
    return json_response({"status": "unloaded", "instances": [d["instance"] for d in done],
                          "results": done})


@bp.get("/admin/models", provide_automatic_options=False)
async def models():
    s = _state()
    engine = engine_stats(s["pool"])
    rows = [instance_view(s, i, engine) for i in s["registry"].instances()]
    return json_response({"object": "list", "data": rows + s["models"].recent_failures()})


@bp.get("/admin/dies", provide_automatic_options=False)
async def dies():
    s = _state()
    total, avail = s["pressure"].host_memory()
    return json_response({"object": "list", "data": die_views(s),
                          "host": {"total_bytes": total, "available_bytes": avail,
                                   "pressure": s["pressure"].host_level()}})


@bp.post("/admin/cache/reset", provide_automatic_options=False)
async def cache_reset():
    body = await _json_object()
    name = _typed(body, "name", str, "a string") or _typed(body, "instance", str, "a string")
    done = _state()["models"].reset_cache(name)
    return json_response({"status": "reset", "instances": done})


@bp.get("/admin/state", provide_automatic_options=False)
async def state():
    return Response(st.encode(snapshot(_state())), content_type="application/json")


def _interval() -> float:
    args = request.args
    try:
        if "interval_ms" in args:
            value = float(args["interval_ms"]) / 1000
        else:
            value = float(args.get("interval", 1.0))
    except ValueError:
        raise oa.invalid("interval", "'interval' must be a number of seconds") from None
    if not MIN_INTERVAL_S <= value <= 3600:
        raise oa.invalid("interval", f"'interval' must be between {MIN_INTERVAL_S} and 3600 s")
    return value


@bp.get("/admin/events", provide_automatic_options=False)
async def events():
    interval = _interval()
    s = _state()
    feed = s["feed"]
    queue = feed.subscribe()

    def frame(kind: str, data: bytes) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def stopping() -> bool:
        drain = s.get("drain")
        return s["registry"].closing or bool(drain is not None and drain.closing)

    async def stream():
        try:
            yield frame("snapshot", st.encode(snapshot(s)))
            due = time.monotonic() + interval
            while not stopping():
                try:
                    ev = await asyncio.wait_for(queue.get(), max(0.0, due - time.monotonic()))
                except TimeoutError:
                    yield frame("snapshot", st.encode(snapshot(s)))
                    due = max(due + interval, time.monotonic())
                    continue
                if ev is None:
                    return
                yield frame("event", msgspec.json.encode(ev))
        finally:
            feed.unsubscribe(queue)

    resp = Response(stream(), content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.timeout = None
    return resp


@bp.post("/admin/test/pressure", provide_automatic_options=False)
async def test_pressure():
    """The pressure test seam (registered only with PANTHEON_TEST_HOOKS=1)."""
    s = _state()
    if not s["config"].test_hooks:
        raise oa.ApiError(404, f"no route {request.method} {request.path}", code="not_found")
    body = await _json_object()
    level, die = body.get("level"), body.get("die")
    if die is not None and not isinstance(die, str):
        raise oa.invalid("die", "'die' must be a die id")
    if level is None:
        s["pressure"].clear()
    elif not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 3:
        raise oa.invalid("level", "'level' must be 0..3, or null to clear")
    else:
        s["pressure"].force(level, die)
    s["registry"].poke()  # waiters held by the old level may go now
    if "note_pressure" in s:
        s["note_pressure"]()
    return json_response({"status": "ok", "forced": {str(k): v for k, v in
                                                     s["pressure"].forced.items()}})
