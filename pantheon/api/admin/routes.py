"""The admin API, as a Quart blueprint: load and unload models, the instance and die tables, the
prefix cache reset, and the dashboard's feed.

=======  ======================  ==========================================================
POST     /admin/models/load      ``{path, name?, dies?, quantize?, slots?, max_context?, wait?,
                                 worker_path?, embeddings?, kv_cache_dtype?, draft?}``
                                 (``worker_path``: remote dies only; ``embeddings``: a chat
                                 model serves /v1/embeddings too; ``kv_cache_dtype``: "q8_0",
                                 or K/V apart "q8_0/q4_0", over ``--kv-cache-dtype``;
                                 ``draft``: a draft model's path for speculative decoding,
                                 same tokenizer, or "mtp": the model's own head)
                                 200 with the instance once ready; 202 at once with
                                 ``wait: false`` (progress in GET /admin/models); 404 no such
                                 folder, 400 bad request or unsupported architecture, 403
                                 outside ``--models-dir``, 409 a
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
import time
from typing import TypeVar, overload

import msgspec
from quart import Blueprint, Response, request

from pantheon import errors
from pantheon import snapshot as st
from pantheon.api.admin.paths import check_path_field, check_root
from pantheon.api.admin.views import die_view, facts_of, instance_view
from pantheon.api.openai import protocol as oa
from pantheon.api.state import app_state
from pantheon.config.settings import ConfigError, parse_dies
from pantheon.config.values import parse_kv_types
from pantheon.core.description import MTP
from pantheon.core.gguf import served_name
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.names import control_problem, has_control

bp = Blueprint("admin", __name__)
T = TypeVar("T")
MIN_INTERVAL_S = 0.05


def json_response(obj: object, status: int = 200) -> Response:
    return Response(oa.dumps(obj), status=status, content_type="application/json")


async def _json_object() -> dict:
    raw = await request.get_data(cache=True)  # cached: the access rules may have read it
    body = oa.load_json(raw or b"{}")
    if not isinstance(body, dict):
        raise errors.not_an_object()
    return body


@overload
def _typed(body: dict, key: str, kind: type[T], word: str) -> T | None: ...
@overload
def _typed(body: dict, key: str, kind: type[T], word: str, default: T) -> T: ...
def _typed(body: dict, key: str, kind: type[T], word: str, default: T | None = None) -> T | None:
    """``body[key]`` checked to be a ``kind`` (a bool is not an int); absent or null: ``default``."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise errors.invalid_param(key, f"'{key}' must be {word}")
    return v


def _dies(raw: object) -> tuple[str, ...]:
    if raw in (None, "", []):
        return ()
    if isinstance(raw, list):
        if not all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in raw):
            raise errors.invalid_param("dies", "'dies' must be a list of die ids (N, cuda:N or cpu:N)")
        raw = ",".join(str(d) for d in raw)
    if not isinstance(raw, str):
        raise errors.invalid_param("dies", "'dies' must be a list of die ids (N, cuda:N or cpu:N)")
    try:
        return parse_dies(raw, "dies")
    except ConfigError as e:
        raise errors.invalid_param("dies", str(e)) from None


def _kv_types(raw: object) -> KvCacheTypes | None:
    """The load's ``kv_cache_dtype`` ("q8_0", or K/V apart: "q8_0/q4_0"); None: the server's."""
    if raw is None:
        return None
    try:
        return parse_kv_types(raw, "kv_cache_dtype")
    except ConfigError as e:
        raise errors.kv_cache_dtype_refused(str(raw), str(e).split(": ", 1)[-1]) from None


# ---------------------------------------------------------------- routes


@bp.post("/admin/models/load", provide_automatic_options=False)
async def load():
    body = await _json_object()
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise errors.invalid_param("path", "'path' must be a model folder path")
    check_path_field("path", path)
    name = _typed(body, "name", str, "a string")
    if name is not None and (not name.strip() or "#" in name or len(name) > 128 or has_control(name)):
        raise errors.invalid_param(
            "name", "'name' must be 1 to 128 characters, without '#' or control characters"
        )
    if name is None and (why := control_problem(served_name(path))):  # the name the path gives
        raise errors.invalid_param("path", f"'path' gives no usable name: {why}; give 'name'")
    dies = _dies(body.get("dies"))
    quantize = _typed(body, "quantize", bool, "a boolean", False)
    slots = _typed(body, "slots", int, "an integer")
    if slots is not None and not 1 <= slots <= 256:
        raise errors.invalid_param("slots", "'slots' must be between 1 and 256")
    max_context = _typed(body, "max_context", int, "an integer")
    if max_context is not None and max_context < 16:
        raise errors.invalid_param("max_context", "'max_context' must be at least 16 tokens")
    embeddings = _typed(body, "embeddings", bool, "a boolean", False)
    kv_cache_dtype = _kv_types(body.get("kv_cache_dtype"))
    # a draft model for speculation (workers/draft.py): a path, as 'path' (same tokenizer), or
    # "mtp": the model's own multi-token-prediction head (workers/mtp.py)
    draft = _typed(body, "draft", str, 'a model path or "mtp"')
    if draft is not None and not draft:
        raise errors.invalid_param("draft", "'draft' must be a model path or \"mtp\"")
    wait = _typed(body, "wait", bool, "a boolean", True)
    # a die on another host may hold the weights at another path than the router's copy (which
    # gives the tokenizer, the template and the size)
    # (remote dies only, under the --models-dir roots like 'path', and the same model: the worker's
    # report is compared with 'path''s description once loaded)
    worker_path = _typed(body, "worker_path", str, "a path on the worker's host")
    s = app_state()
    if worker_path:
        check_path_field("worker_path", worker_path)
        if s.guard.roots:
            check_root(s.guard, "worker_path", worker_path)
    if draft and draft != MTP:
        check_path_field("draft", draft)
        if s.guard.roots:
            check_root(s.guard, "draft", draft)
    inst, task = await s.models.start_load(
        path,
        name,
        dies,
        quantize,
        slots=slots,
        max_context=max_context,
        background=not wait,
        worker_path=worker_path or None,
        embeddings=embeddings,
        kv_cache_dtype=kv_cache_dtype,
        draft=draft,
    )
    if not wait:
        return json_response({"status": "loading", **instance_view(facts_of(s.project(), inst, s.dies))}, 202)
    await asyncio.shield(task)  # a client that goes away does not stop the load
    return json_response({"status": "loaded", **instance_view(facts_of(s.project(), inst, s.dies))})


@bp.post("/admin/models/unload", provide_automatic_options=False)
async def unload():
    body = await _json_object()
    target = body.get("name") or body.get("instance")
    if not isinstance(target, str) or not target:
        raise errors.invalid_param("name", "'name' must be a model name or instance id")
    timeout = body.get("drain_timeout")
    if timeout is not None and (
        not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 <= timeout <= 3600
    ):
        raise errors.invalid_param("drain_timeout", "'drain_timeout' must be seconds between 0 and 3600")
    done = await app_state().models.unload(target, timeout)
    return json_response({"status": "unloaded", "instances": [d["instance"] for d in done], "results": done})


@bp.get("/admin/models", provide_automatic_options=False)
async def models():
    s = app_state()
    rows = [instance_view(f) for f in s.project().instances]
    return json_response({"object": "list", "data": rows + s.models.recent_failures()})


@bp.get("/admin/dies", provide_automatic_options=False)
async def dies():
    s = app_state()
    total, avail = s.pressure.host_memory()
    return json_response(
        {
            "object": "list",
            "data": [die_view(f) for f in s.project().dies],
            "host": {"total_bytes": total, "available_bytes": avail, "pressure": s.pressure.host_level()},
        }
    )


@bp.post("/admin/cache/reset", provide_automatic_options=False)
async def cache_reset():
    body = await _json_object()
    name = _typed(body, "name", str, "a string") or _typed(body, "instance", str, "a string")
    done = app_state().models.reset_cache(name)
    return json_response({"status": "reset", "instances": done})


@bp.get("/admin/state", provide_automatic_options=False)
async def state():
    return Response(st.encode(app_state().snapshot()), content_type="application/json")


def _interval() -> float:
    args = request.args
    try:
        if "interval_ms" in args:
            value = float(args["interval_ms"]) / 1000
        else:
            value = float(args.get("interval", 1.0))
    except ValueError:
        raise errors.invalid_param("interval", "'interval' must be a number of seconds") from None
    if not MIN_INTERVAL_S <= value <= 3600:
        raise errors.invalid_param("interval", f"'interval' must be between {MIN_INTERVAL_S} and 3600 s")
    return value


@bp.get("/admin/events", provide_automatic_options=False)
async def events():
    interval = _interval()
    s = app_state()
    feed = s.feed
    queue = feed.subscribe()

    def frame(kind: str, data: bytes) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def stopping() -> bool:
        return s.registry.closing or s.drain.closing

    async def stream():
        try:
            yield frame("snapshot", st.encode(s.snapshot()))
            due = time.monotonic() + interval
            while not stopping():
                try:
                    ev = await asyncio.wait_for(queue.get(), max(0.0, due - time.monotonic()))
                except TimeoutError:
                    yield frame("snapshot", st.encode(s.snapshot()))
                    due = max(due + interval, time.monotonic())
                    continue
                if ev is None:
                    return
                yield frame("event", msgspec.json.encode(ev))
        finally:
            feed.unsubscribe(queue)

    resp = Response(
        stream(),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    resp.timeout = None
    return resp


@bp.post("/admin/test/pressure", provide_automatic_options=False)
async def test_pressure():
    """The pressure test seam (registered only with PANTHEON_TEST_HOOKS=1)."""
    s = app_state()
    if not s.config.test_hooks:
        raise errors.route_not_found(request.method, request.path)
    body = await _json_object()
    level, die = body.get("level"), body.get("die")
    if die is not None and not isinstance(die, str):
        raise errors.invalid_param("die", "'die' must be a die id")
    if level is None:
        s.pressure.clear()
    elif not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 3:
        raise errors.invalid_param("level", "'level' must be 0..3, or null to clear")
    else:
        s.pressure.force(level, die)
    s.registry.poke()  # waiters held by the old level may go now
    s.note_pressure()
    return json_response({"status": "ok", "forced": {str(k): v for k, v in s.pressure.forced.items()}})
