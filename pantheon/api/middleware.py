"""Operations wiring for the Quart app: access rules, limits, per-request logs and metrics, and
graceful shutdown. ``install(app)`` is the one hook ``create_app`` calls;
the chat route calls ``check_request`` after parsing and ``attach`` once its ``Generation`` exists.

An ASGI middleware (``app.asgi_app`` wrapped) sees every HTTP request from its first byte to the
last byte of its response, streams included: it makes the request's ``RequestTrace``, answers 503
itself while the server drains, counts the requests a drain must wait for, and logs and meters each
request when it ends. The access rules run as a ``before_request`` hook, so their errors come out
through the app's OpenAI error handler.

Shutdown (``Drain.run``): stop admitting (every new request, ``/health`` included, gets 503
``shutting_down``; ``/metrics`` still answers), wait for the in-flight requests (``/v1/*`` and admin
POSTs) up to the deadline, then end the generations still running (their streams end with an
error event and ``[DONE]``, their JSON requests with a 503) and give them a moment to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from quart import Quart, Response, request

from pantheon import errors, logs
from pantheon.api import auth
from pantheon.api.metrics import CONTENT_TYPE, Metrics
from pantheon.api.state import AppState, app_state

log = logging.getLogger("pantheon.api.middleware")

TRACE_KEY = "pantheon.trace"
_ADMIN_BODY_CAP = 64 << 10  # admin bodies kept for the audit line (they are small)
_END_GRACE_S = 5.0  # after ending the generations, how long the last responses may take


class Drain:
    """Requests in flight, and the shutdown sequence."""

    def __init__(self) -> None:
        self.closing = False  # no new requests
        self.ended = False  # past the deadline: generations end at once
        self.active = 0
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active <= 0 and self._idle is not None:
            self._idle.set()

    async def _wait_idle(self, timeout: float) -> bool:
        if self.active <= 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def run(self, live: set, deadline_s: float) -> None:
        """Stop admitting, let in-flight requests finish up to ``deadline_s``, end the rest."""
        self.closing = True
        t0 = time.monotonic()
        log.info("shutting down: %d request(s) in flight, waiting up to %g s", self.active, deadline_s)
        if await self._wait_idle(deadline_s):
            log.info("all requests finished in %.1f s", time.monotonic() - t0)
            return
        self.ended = True
        log.warning("drain deadline (%g s) passed: ending %d generation(s)", deadline_s, len(live))
        for gen in list(live):
            gen.shutdown()
        await self._wait_idle(_END_GRACE_S)


async def _send_json(send, status: int, obj: dict, headers: dict | None = None) -> None:
    body = json.dumps(obj).encode()
    hdrs = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"access-control-allow-origin", b"*"),
        (b"connection", b"close"),
    ]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class OpsMiddleware:
    """The ASGI wrapper (see the module doc)."""

    def __init__(self, inner, state: AppState):
        self.inner, self.state = inner, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        path, method = scope["path"], scope["method"]
        drain = self.state.drain
        if drain.closing and path != "/metrics":
            err = errors.shutting_down()
            if path == "/health":
                return await _send_json(send, err.status, {"status": "shutting_down"}, err.headers)
            self.state.metrics.rejected.labels("", str(err.status)).inc()
            return await _send_json(send, err.status, err.body(), err.headers)
        trace = logs.RequestTrace(method, path, (scope.get("client") or (None,))[0])
        scope[TRACE_KEY] = trace

        async def send_(message):
            if message["type"] == "http.response.start":
                trace.status = message["status"]
            await send(message)

        admin = method == "POST" and path.startswith("/admin/")
        chunks: list[bytes] = []

        async def keep_body():  # an admin body, kept for the audit line
            message = await receive()
            if message["type"] == "http.request" and sum(map(len, chunks)) < _ADMIN_BODY_CAP:
                chunks.append(message.get("body", b""))
            return message

        counted = admin or path.startswith("/v1/")
        if counted:
            drain.enter()
        try:
            await self.inner(scope, keep_body if admin else receive, send_)
        finally:
            if counted:
                drain.leave()
            dur = time.monotonic() - trace.t0
            try:
                if admin:
                    with contextlib.suppress(ValueError, RecursionError):
                        body = json.loads(b"".join(chunks) or b"{}")
                        trace.admin = body if isinstance(body, dict) else None
                    logs.log_admin(trace, dur)
                else:
                    logs.log_request(trace, dur)
                self.state.metrics.observe(trace, dur)
            except Exception:
                log.exception("accounting for %s %s failed", method, path)


def install(app: Quart) -> None:
    """Wire the access rules, /metrics, the middleware and the feed follower into ``app``."""
    state = app_state(app)
    guard = state.guard = auth.Guard(state.config.ops)
    metrics = state.metrics = Metrics(state)
    state.drain = Drain()

    @app.before_request
    async def access_rules():
        client = (request.scope.get("client") or (None,))[0]
        guard.check(request.method, request.path, request.headers.get("Authorization"), client)
        if request.method == "POST" and guard.roots and request.path.startswith("/admin/"):
            raw = await request.get_data(cache=True)
            guard.check_admin_body(request.path, raw if isinstance(raw, bytes) else raw.encode())

    @app.get("/metrics", provide_automatic_options=False)
    async def metrics_route():
        return Response(metrics.render(), content_type=CONTENT_TYPE)

    @app.before_serving
    async def follow_feed():
        # load, unload and failure events, for the counters
        state.tasks["follow"] = asyncio.create_task(_follow(state.feed, metrics), name="ops-feed")

    @app.after_serving
    async def stop_following():
        task = state.tasks.pop("follow", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app.asgi_app = OpsMiddleware(app.asgi_app, state)


async def _follow(feed: Any, metrics: Metrics) -> None:
    """Count loads, load failures, unloads and worker deaths from the feed's events."""
    q = feed.subscribe()
    try:
        while (ev := await q.get()) is not None:
            metrics.feed_event(ev.kind, ev.model, ev.message)
    finally:
        feed.unsubscribe(q)


def _trace() -> logs.RequestTrace | None:
    return request.scope.get(TRACE_KEY)


def check_request(req: Any) -> None:
    """After parsing a chat request: note the model it names, apply the limits (400)."""
    trace = _trace()
    if trace is not None:
        trace.model = req.model
    auth.check_limits(req, app_state().guard.limits)


def attach(gen: Any) -> None:
    """A ``Generation`` was made for this request: trace it; past the drain deadline, end it."""
    state = app_state()
    trace = _trace()
    if trace is not None:
        trace.started(gen, gen.inst, len(gen.prep.prompt_ids))
        trace.on_gap = state.metrics.itl_observer(gen.inst.name)
        gen.trace = trace
    if state.drain.ended:
        gen.shutdown()
