"""Operations wiring for the Quart app: access rules, limits, per-request logs and metrics, and
graceful shutdown. ``install(app)`` is the one hook ``create_app`` calls;
the chat route calls ``check_request`` after parsing and ``attach`` once its ``Generation`` exists.

An ASGI middleware (``app.asgi_app`` wrapped) sees every HTTP request from its first byte to the
last byte of its response, streams included: it makes the request's ``RequestTrace``, answers 503
itself while the server drains, counts the requests a drain must wait for, and logs and meters each
request when it ends. The access rules run as a ``before_request`` hook, so their errors come out
through the app's OpenAI error handler.

Browsers (``Origins``): the OpenAI routes answer with CORS headers for the ``--cors-origins``
(default ``*``: any page may call them, as with vLLM and OpenAI's own API); the admin API never
sends CORS headers, refuses preflights, and refuses (403, before any work) a request whose
``Origin`` is neither the server's own (the scheme, host and port of its ``Host``) nor named in
``--cors-origins`` (``*`` does not count), or that a browser marks ``Sec-Fetch-Site: cross-site``
or ``same-site``. Without an admin key, a browser's admin request (``Origin`` or
``Sec-Fetch-Site`` sent) must also name this host by address, ``localhost``, ``--host`` or the
machine's host name (DNS rebinding). A POST to a JSON route (``/v1/*``, ``/tokenize``,
``/detokenize``, ``/admin/*``) must say ``Content-Type: application/json`` (parameters allowed;
an empty body may say nothing): anything else is a 415, so no form or ``text/plain`` "simple"
request reaches a route. Ollama's routes (``/api/*``) ask it of browsers only (a request that
sends ``Origin`` or ``Sec-Fetch-Site``, as every browser's cross-origin POST does): Ollama's own
examples are ``curl -d`` without a type, and non-browser clients cannot be made to send a
"simple" request by a web page.

Request bodies (``BodyBudget``): the router holds at most ``--max-body-in-flight`` bytes of
request bodies at once, all requests together. A body counts from its first byte until the route
has parsed it (``body_done``; at the latest when its request ends), not for a long stream's
life: a declared ``Content-Length`` is reserved before the body is read, a chunked body counts as
its chunks arrive. A request whose reservation would go past the bound gets 503
``bodies_in_flight`` (``Retry-After: 1``) before its body is read (the body is then read and
dropped, so the client sees the answer), and a chunked body that grows past it gets the same 503
at that point; one body alone always passes (``--max-body`` bounds it). ``/metrics`` shows the
count (``pantheon_body_bytes_in_flight``). After a large body's request ends, ``malloc_trim``
(glibc) hands the freed heap back to the system, at most once per ``inflight.TRIM_EVERY_S``, in a thread.
The budget and the drain's count are ``pantheon.api.inflight``'s.

Shutdown (``Drain.run``): stop admitting (every new request, ``/health`` included, gets 503
``shutting_down``; ``/metrics`` still answers), wait for the in-flight requests (``/v1/*``,
``/api/*`` and admin POSTs) up to the deadline, then end the generations still running (their streams end with an
error event and ``[DONE]``, their JSON requests with a 503) and give them a moment to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import time
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, cast

from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    HTTPScope,
    Scope,
)
from quart import Quart, Response, request
from werkzeug.datastructures import Headers

from pantheon import errors, logs
from pantheon.api import auth
from pantheon.api.admin.paths import check_path_field, check_root
from pantheon.api.inflight import BodyTicket, Trimmer
from pantheon.api.metrics import CONTENT_TYPE, Metrics
from pantheon.api.state import AppState, app_state
from pantheon.core.request import GenerationRequest
from pantheon.errors import ApiError

if TYPE_CHECKING:
    from pantheon.control.context import Prepared
    from pantheon.control.feed import Feed
    from pantheon.control.registry import Instance

log = logging.getLogger("pantheon.api.middleware")

TRACE_KEY = "pantheon.trace"
_ADMIN_BODY_CAP = 64 << 10  # admin bodies kept for the audit line (they are small)


BODY_KEY = "pantheon.body"
TRIM_MIN_BYTES = 1 << 20  # a request whose body reached this size hands memory back when it ends
_DRAIN_BODY_S = 30.0  # how long a refused request's body may take to be read and dropped


def _put(scope: HTTPScope, key: str, value: object) -> None:
    """Add ``key`` to the scope: ASGI lets a middleware extend it, the ``HTTPScope`` type does not
    name our keys (the routes read them back with ``request.scope.get``)."""
    cast(dict[str, object], scope)[key] = value


def _declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The ``Content-Length`` an ASGI scope's headers declare (None: none, or not a number)."""
    for k, v in headers:
        if k == b"content-length":
            try:
                return max(0, int(v))
            except ValueError:
                return None
    return None


# ---------------------------------------------------------------- browsers: CORS, origins, types

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = (
    "Authorization, Content-Type, X-Session-Id, OpenAI-Organization, OpenAI-Project, "
    "OpenAI-Beta, X-Stainless-Lang, X-Stainless-Package-Version, X-Stainless-OS, X-Stainless-Arch, "
    "X-Stainless-Runtime, X-Stainless-Runtime-Version, X-Stainless-Retry-Count, "
    "X-Stainless-Timeout, X-Stainless-Async"
)
JSON_POST_PREFIXES = ("/v1/", "/admin/")
JSON_POST_PATHS = ("/tokenize", "/detokenize")
OLLAMA_PREFIX = "/api/"  # Ollama's routes: JSON from browsers only, errors in Ollama's shape


def is_admin(path: str) -> bool:
    return path == "/admin" or path.startswith("/admin/")


def origin_key(value: str | None) -> str | None:
    """``scheme://host:port`` of an origin or URL (lower case, the default port filled in);
    None for anything else (``null``, an opaque origin, garbage)."""
    if not value:
        return None
    try:
        u = urllib.parse.urlsplit(value.strip())
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    host = u.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{u.scheme}://{host}:{port or (443 if u.scheme == 'https' else 80)}"


def _forbidden_origin(why: str) -> ApiError:
    return errors.origin_not_allowed(
        f"the admin API refuses this browser request: {why}. It answers pages of its own origin "
        "only, and origins named in --cors-origins"
    )


class Origins:
    """The ``--cors-origins`` rules (see the module doc)."""

    def __init__(self, origins: tuple[str, ...], bind_host: str = "", admin_key: bool = False):
        self.any = "*" in origins
        self.listed = {k for o in origins if o != "*" and (k := origin_key(o)) is not None}
        self.admin_key = admin_key
        names = {"localhost", bind_host.lower()}
        try:
            hn = socket.gethostname().lower()
            names |= {hn, socket.getfqdn(hn).lower()}
        except OSError:  # pragma: no cover - no host name
            pass
        self.local_names = {n for n in names if n}

    def allows(self, origin: str | None) -> bool:
        """May a page of ``origin`` read the OpenAI routes' answers?"""
        return self.any or origin_key(origin) in self.listed

    def listed_origin(self, origin: str | None) -> bool:
        return origin_key(origin) in self.listed

    def _local_host(self, host: str) -> bool:
        name = (urllib.parse.urlsplit("//" + host).hostname or "").lower()
        if name in self.local_names or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    def check_admin(self, method: str, scheme: str, host: str, headers: Headers) -> None:
        """403 unless this admin request may go on (see the module doc)."""
        origin = headers.get("Origin")
        site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
        if method == "OPTIONS":
            raise _forbidden_origin("the admin API takes no CORS preflight")
        listed = origin is not None and self.listed_origin(origin)
        if origin is not None and not listed and origin_key(origin) != origin_key(f"{scheme}://{host}"):
            raise _forbidden_origin(f"Origin {origin[:100]!r} is not this server's")
        if site in ("cross-site", "same-site") and not listed:
            raise _forbidden_origin(f"Sec-Fetch-Site is {site}")
        if not self.admin_key and (origin is not None or site) and not listed and not self._local_host(host):
            raise _forbidden_origin(f"Host {host[:100]!r} is not a name of this machine")

    def response_headers(self, path: str, origin: str | None) -> dict[str, str]:
        """The CORS headers of a response to ``path`` (none for the admin API)."""
        if is_admin(path):
            return {}
        if self.any:
            return {"Access-Control-Allow-Origin": "*"}
        if origin is not None and self.listed_origin(origin):
            return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        return {"Vary": "Origin"}


def takes_json(method: str, path: str, browser: bool = False) -> bool:
    """Must this request's body say it is JSON? (``browser``: it sent ``Origin`` or
    ``Sec-Fetch-Site``.)"""
    if method != "POST":
        return False
    return path.startswith(JSON_POST_PREFIXES) or path in JSON_POST_PATHS or (browser and is_ollama(path))


def is_ollama(path: str) -> bool:
    return path.startswith(OLLAMA_PREFIX)


def error_json(path: str, err: ApiError) -> dict:
    """The error object the middleware answers ``path`` with itself: Ollama's shape on its
    routes, OpenAI's elsewhere."""
    return err.ollama_body() if is_ollama(path) else err.body()


def check_json_type(content_type: str | None, has_body: bool) -> None:
    """415 unless a JSON route's body is declared JSON (an empty one may declare nothing)."""
    if not content_type:
        if not has_body:
            return
        got = "no Content-Type"
    else:
        mt = content_type.split(";", 1)[0].strip().lower()
        if mt == "application/json" or (mt.startswith("application/") and mt.endswith("+json")):
            return
        got = f"Content-Type {content_type[:100]!r}"
    raise errors.unsupported_media_type(got)


async def _send_json(send: ASGISendCallable, status: int, obj: dict, headers: dict | None = None) -> None:
    body = json.dumps(obj).encode()
    hdrs = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class OpsMiddleware:
    """The ASGI wrapper (see the module doc)."""

    def __init__(self, inner: ASGIFramework, state: AppState, origins: Origins):
        self.inner, self.state, self.origins = inner, state, origins
        self.bodies = state.bodies
        self.trimmer = Trimmer()

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        path, method = scope["path"], scope["method"]
        drain = self.state.drain
        if drain.closing and path != "/metrics":
            err = errors.shutting_down()
            origin = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"origin"), None)
            hdrs = {**err.headers, **self.origins.response_headers(path, origin)}
            if path == "/health":
                return await _send_json(send, err.status, {"status": "shutting_down"}, hdrs)
            self.state.metrics.rejected.labels("", str(err.status)).inc()
            return await _send_json(send, err.status, error_json(path, err), hdrs)
        trace = logs.RequestTrace(method, path, (scope.get("client") or (None,))[0])
        _put(scope, TRACE_KEY, trace)
        headers = scope.get("headers", ())
        declared = _declared_length(headers)
        chunked = any(k == b"transfer-encoding" and b"chunked" in v.lower() for k, v in headers)
        ticket: BodyTicket | None = None
        if declared or chunked:
            ticket = self.bodies.ticket(None if chunked else declared)
            if ticket is None:  # refused before a byte of the body is kept
                return await self._refuse_body(scope, receive, send, trace, path)
            _put(scope, BODY_KEY, ticket)
        started = False
        overflow: bool | str = False
        dropper: asyncio.Task | None = None

        async def send_(message: ASGISendEvent) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                trace.status = message["status"]
            await send(message)

        admin = method == "POST" and path.startswith("/admin/")
        chunks: list[bytes] = []

        async def receive_() -> ASGIReceiveEvent:
            nonlocal overflow
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                if ticket is not None and not ticket.arrived(len(body)):
                    overflow = message.get("more_body", False) or "done"  # the app stops here
                    ticket.release()
                    return {"type": "http.disconnect"}
                if admin and sum(map(len, chunks)) < _ADMIN_BODY_CAP:  # kept for the audit line
                    chunks.append(body)
            return message

        counted = admin or path.startswith("/v1/") or is_ollama(path)
        if counted:
            drain.enter()
        try:
            await self.inner(scope, receive_ if ticket is not None or admin else receive, send_)
            if overflow and not started:  # a chunked body went past the bound
                if overflow is True:  # the rest of it is read, not kept, while the answer goes
                    dropper = asyncio.create_task(_drop_body(receive), name="drop-body")
                trace.status = await self._send_refusal(scope, send, path)
        finally:
            if ticket is not None:
                ticket.release()
                if ticket.peak >= TRIM_MIN_BYTES or ticket.received >= TRIM_MIN_BYTES:
                    self.trimmer.request()
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
        if dropper is not None:
            await dropper

    async def _send_refusal(self, scope: HTTPScope, send: ASGISendCallable, path: str) -> int:
        err = errors.bodies_in_flight(self.bodies.limit)
        origin = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"origin"), None)
        await _send_json(
            send,
            err.status,
            error_json(path, err),
            {**err.headers, **self.origins.response_headers(path, origin)},
        )
        return err.status

    async def _refuse_body(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        trace: logs.RequestTrace,
        path: str,
    ) -> None:
        """503 ``bodies_in_flight`` at once, the body read and dropped meanwhile (a client that
        sends its whole body before reading would otherwise see a reset, not the answer, and the
        server would not get the answer out past a full receive queue); logged and metered as any
        request."""
        dropper = asyncio.create_task(_drop_body(receive), name="drop-body")
        try:
            trace.status = await self._send_refusal(scope, send, path)
            dur = time.monotonic() - trace.t0
            logs.log_request(trace, dur)
            self.state.metrics.observe(trace, dur)
            await dropper
        finally:
            dropper.cancel()


async def _drop_body(receive: ASGIReceiveCallable) -> None:
    """Read the rest of a refused request's body and keep none of it (up to ``_DRAIN_BODY_S``)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DRAIN_BODY_S):
            while (m := await receive())["type"] == "http.request" and m.get("more_body", False):
                pass


def install(app: Quart) -> None:
    """Wire the access rules, /metrics, the middleware and the feed follower into ``app``."""
    state = app_state(app)
    guard, metrics = state.guard, state.metrics

    origins = Origins(state.config.cors_origins, state.config.host, state.config.ops.admin_key is not None)

    @app.before_request
    async def access_rules():
        method, path, headers = request.method, request.path, request.headers
        admin = is_admin(path)
        if admin:  # a browser's request from another origin: refused before anything else
            origins.check_admin(method, request.scheme, request.host, headers)
        if method == "OPTIONS":  # a CORS preflight (routed or not) of a non-admin path
            return _preflight(origins, headers)
        client = (request.scope.get("client") or (None,))[0]
        guard.check(method, path, headers.get("Authorization"), client)
        browser = "Origin" in headers or "Sec-Fetch-Site" in headers
        if takes_json(method, path, browser):
            has_body = bool(request.content_length) or "chunked" in headers.get("Transfer-Encoding", "")
            check_json_type(headers.get("Content-Type"), has_body)
        if method == "POST" and path.startswith("/admin/models/load"):
            raw = await request.get_data(cache=True)
            _check_load_paths(guard, raw if isinstance(raw, bytes) else raw.encode())
        return None

    @app.after_request
    async def cors(resp: Response) -> Response:
        if is_admin(request.path):  # never: no page of another origin may read the admin API
            for k in {k for k in resp.headers.keys() if k.lower().startswith("access-control-")}:
                del resp.headers[k]
            return resp
        for k, v in origins.response_headers(request.path, request.headers.get("Origin")).items():
            if k == "Vary":
                resp.vary.add("Origin")
            else:
                resp.headers.setdefault(k, v)
        return resp

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

    app.asgi_app = OpsMiddleware(app.asgi_app, state, origins)


def _preflight(origins: Origins, headers: Headers) -> Response:
    """A CORS preflight of an OpenAI route: allowed for the ``--cors-origins``, else 403."""
    origin = headers.get("Origin")
    if origin is not None and not origins.allows(origin):
        raise errors.origin_not_allowed(f"origin {origin[:100]!r} is not allowed (--cors-origins)")
    resp = Response(json.dumps({}), content_type="application/json")
    resp.headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
    asked = headers.get("Access-Control-Request-Headers")
    resp.headers["Access-Control-Allow-Headers"] = asked[:2000] if asked else ALLOW_HEADERS
    resp.headers["Access-Control-Max-Age"] = "86400"
    return resp


def _check_load_paths(guard: auth.Guard, raw: bytes) -> None:
    """An admin load's ``path`` and ``worker_path``: a 400 naming the field for a value no file
    system takes; then the ``--models-dir`` rule (403), before the route reads anything."""
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError):  # the route answers it
        return
    if not isinstance(body, dict):
        return
    for field in ("path", "worker_path"):
        value = body.get(field)
        if isinstance(value, str) and value:
            check_path_field(field, value)
            if guard.roots:
                check_root(guard, field, value)


async def _follow(feed: Feed, metrics: Metrics) -> None:
    """Count loads, load failures, unloads and worker deaths from the feed's events."""
    q = feed.subscribe()
    try:
        while (ev := await q.get()) is not None:
            metrics.feed_event(ev.kind, ev.model, ev.message)
    finally:
        feed.unsubscribe(q)


def _trace() -> logs.RequestTrace | None:
    return request.scope.get(TRACE_KEY)


def body_done() -> None:
    """The route has parsed its request's body: its bytes leave the ``--max-body-in-flight``
    count, and the app's copy of the raw body is dropped (call after parsing, before a long
    generation)."""
    ticket = request.scope.get(BODY_KEY)
    if ticket is not None:
        ticket.release()
    request.body.clear()


def check_request(req: GenerationRequest) -> None:
    """After parsing a request: note the model it names, apply the limits (400)."""
    trace = _trace()
    if trace is not None:
        trace.model = req.model
    auth.check_limits(req, app_state().guard.limits)


class Traced(Protocol):
    """A generation as ``attach`` traces it (``pantheon.api.generation.Generation``)."""

    id: str
    inst: Instance
    prep: Prepared
    trace: logs.RequestTrace | None

    def shutdown(self) -> None: ...


def attach(gen: Traced) -> None:
    """A ``Generation`` was made for this request: trace it; past the drain deadline, end it."""
    state = app_state()
    trace = _trace()
    if trace is not None:
        trace.started(gen, gen.inst, len(gen.prep.prompt_ids))
        trace.on_gap = state.metrics.itl_observer(gen.inst.name)
        gen.trace = trace
    if state.drain.ended:
        gen.shutdown()
