"""The HTTP server: the Quart app factory ``create_app(config, pool, registry)``.

Routes (spec: serve-architecture.md): ``GET /``, ``GET /health``, ``OPTIONS`` anywhere (CORS
preflight; the responses carry the CORS headers of ``--cors-origins``, the admin API's none: see
``pantheon.api.middleware``), the OpenAI API
(``pantheon.api.openai.routes``: ``/v1/models``, ``/v1/chat/completions``; ``completions``:
``/v1/completions``; ``responses``: ``/v1/responses``; ``tokenize``:
``/tokenize``, ``/detokenize``), Ollama's API (``pantheon.api.ollama.routes``: ``/api/*``, its
errors in Ollama's shape), the admin API
(``pantheon.api.admin.routes``) and ``/metrics`` (``pantheon.api.middleware``). Every error is
an OpenAI error object. Cheap routes never wait on a generation.

``create_app`` builds the app's ``AppState`` (``pantheon.api.state``) once: the die manager, the
pressure source, the feed and the loads/unloads around the given pool and registry. One
background task re-runs the queues and copies the workers' memory figures a few times a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from quart import Quart, request
from werkzeug.exceptions import HTTPException

from pantheon import errors
from pantheon.api import inflight
from pantheon.api import middleware as ops
from pantheon.api.admin.routes import bp as admin_bp
from pantheon.api.auth import Guard
from pantheon.api.metrics import Metrics
from pantheon.api.ollama.routes import bp as ollama_bp
from pantheon.api.openai.completions import bp as completions_bp
from pantheon.api.openai.embeddings import bp as embeddings_bp
from pantheon.api.openai.responses import bp as responses_bp
from pantheon.api.openai.routes import bp as openai_bp
from pantheon.api.openai.tokenize import bp as tokenize_bp
from pantheon.api.responses import error_response, json_response
from pantheon.api.state import AppState, LiveView, app_state, install_state
from pantheon.config.settings import ServeConfig
from pantheon.control.catalog import CONFIGURED, Catalog, CatalogEntry
from pantheon.control.dies import DieManager
from pantheon.control.feed import Feed
from pantheon.control.lifecycle import Models
from pantheon.control.pressure import NAMES as LEVEL_NAMES
from pantheon.control.pressure import PressureSource
from pantheon.control.registry import Registry
from pantheon.control.residency import Residency
from pantheon.control.supervisor import Supervisor
from pantheon.errors import ApiError
from pantheon.workerlink.pool import WorkerPool

log = logging.getLogger("pantheon.server")

TICK_S = 0.25  # how often the queues re-run and the dies' figures refresh


def build_state(
    config: ServeConfig, pool: WorkerPool, registry: Registry, *, supervised: bool = False
) -> AppState:
    """The app's state around ``pool`` and ``registry``: every part made first (dies, pressure,
    feed, loads, access guard, metrics, drain, body budget; with ``supervised``, the supervisor
    that restarts dead workers, as ``pantheon serve`` has), then the state with all of them."""
    measured: dict[str, tuple[int, int]] = {}  # die -> (total, free) as its worker last measured
    pressure = PressureSource(config.pressure_thresholds, die_probe=measured.get)
    dies = DieManager(
        cpu_dies=config.cpu_dies,
        cpu_budget=config.cpu_die_budget,
        reserve=config.die_reserve,
        host_available=lambda: pressure.host_memory()[1],
    )
    pressure.booked_probe = lambda die: getattr(dies.get(die), "used_bytes", 0)
    registry.pressure = pressure.level
    feed = Feed()
    live: set = set()
    failed_dies: set[str] = set()  # the supervisor adds the dies it gives up on
    models = Models(config, pool, registry, dies, feed, live, failed_dies=failed_dies)
    view = LiveView(registry, pool, dies, pressure, failed_dies)
    bodies = inflight.BodyBudget(config.body_in_flight_limit, config.max_body_bytes)
    metrics = Metrics(view, bodies)
    supervisor = (
        _supervisor(config, pool, registry, models, metrics, feed, failed_dies) if supervised else None
    )
    return AppState(
        config=config,
        pool=pool,
        registry=registry,
        dies=dies,
        pressure=pressure,
        feed=feed,
        models=models,
        live=live,
        note_pressure=_pressure_notes(pressure, dies, feed),
        measured=measured,
        residency=Residency(
            Catalog(_entries(config), config.ops.models_dirs),
            models,
            registry,
            feed,
            keep_alive_s=config.keep_alive_s,
            models_max=config.models_max,
            load_timeout_s=config.load_timeout_s,
        ),
        view=view,
        guard=Guard(config.ops),
        metrics=metrics,
        drain=inflight.Drain(),
        bodies=bodies,
        supervisor=supervisor,
    )


def _pressure_notes(pressure: PressureSource, dies: DieManager, feed: Feed) -> Callable[[], None]:
    """``note_pressure``: a change of the overall pressure level becomes an event (the tick,
    the test seam)."""
    level_seen = [0]

    def note_pressure() -> None:
        level = pressure.level(d.id for d in dies.dies())
        if level != level_seen[0]:
            feed.event("pressure", f"memory pressure {LEVEL_NAMES[level_seen[0]]} -> {LEVEL_NAMES[level]}")
            level_seen[0] = level

    return note_pressure


def _supervisor(
    config: ServeConfig,
    pool: WorkerPool,
    registry: Registry,
    models: Models,
    metrics: Metrics,
    feed: Feed,
    failed_dies: set[str],
) -> Supervisor:
    """The supervisor of ``pantheon serve``: requests wait for a model that restarts, and no load
    goes round its restart limit (``failed_dies``). The pool, made before, reports to it."""
    supervisor = Supervisor(
        models,
        registry,
        pool,
        max_restarts=config.ops.worker_restarts,
        backoff_s=config.ops.restart_backoff_s,
        metrics=metrics,
        feed=feed,
        failed_dies=failed_dies,
    )
    pool.on_worker_dead = supervisor.worker_dead
    pool.on_worker_joined = models.worker_joined
    return supervisor


def _entries(config: ServeConfig) -> list[CatalogEntry]:
    """The catalog's configured entries: the ``--model`` flags or the ``[[models]]`` tables."""
    return [
        CatalogEntry(
            name=m.name,
            path=m.path,
            aliases=m.aliases,
            dies=m.dies,
            preload=m.preload,
            keep_alive=m.keep_alive,
            pin=m.pin,
            params=dict(m.params),
            quantize=m.quantize,
            slots=m.slots,
            max_context=m.max_context,
            embeddings=m.embeddings,
            kv_cache_dtype=m.kv_cache_dtype,
            draft=m.draft,
            origin=CONFIGURED,
        )
        for m in config.models
    ]


async def _tick(state: AppState) -> None:
    """Re-run the queues (pressure may have dropped), refresh the dies' figures, and note a
    change of the pressure level."""
    while True:
        await asyncio.sleep(TICK_S)
        try:
            for d in state.pool.dies():
                state.measured[d.die] = (d.total_bytes, d.free_bytes)
            state.models.sync_dies()
            state.registry.poke()
            state.residency.tick()
            state.note_pressure()
        except Exception:  # noqa: BLE001 - the ticker must go on
            log.exception("the registry tick failed")


def create_app(
    config: ServeConfig, pool: WorkerPool, registry: Registry, *, supervised: bool = False
) -> Quart:
    app = Quart("pantheon")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    state = build_state(config, pool, registry, supervised=supervised)
    install_state(app, state)
    app.register_blueprint(openai_bp)
    app.register_blueprint(tokenize_bp)
    app.register_blueprint(completions_bp)
    app.register_blueprint(embeddings_bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(ollama_bp)
    app.register_blueprint(admin_bp)

    @app.before_serving
    async def start_tick():
        state.tasks["tick"] = asyncio.create_task(_tick(state), name="tick")

    @app.after_serving
    async def stop_tick():
        task = state.tasks.pop("tick", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        state.feed.close()
        await state.residency.close()
        await state.models.close()

    # access rules (origins, CORS and preflights, keys, JSON content types), limits, /metrics,
    # request logs, graceful shutdown
    ops.install(app)
    _install_errors(app, config)

    @app.get("/", provide_automatic_options=False)
    async def root():
        return json_response({"service": "pantheon", "status": "ok"})

    @app.get("/health", provide_automatic_options=False)
    async def health():
        state = app_state()
        reg = state.registry
        # ready: a model is, or the start-up is done and the catalog has models to load on demand
        ok = reg.has_ready or (state.residency.started and bool(state.residency.catalog.entries()))
        return json_response({"status": "ok" if ok else "loading", "models": reg.names()}, 200 if ok else 503)

    return app


def _install_errors(app: Quart, config: ServeConfig) -> None:
    """Every error leaves as an OpenAI error object: ours, Quart's HTTP ones, and the rest (the
    Ollama blueprint's own handlers give its routes Ollama's shape)."""

    @app.errorhandler(ApiError)
    async def api_error(e: ApiError):
        return error_response(e)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException):
        code = e.code or 500
        if code == 404:
            err = errors.route_not_found(request.method, request.path)
        elif code == 413:
            err = errors.body_too_large(config.max_body_bytes)
        else:
            err = errors.http_error(code, e.description or e.name)
        return error_response(err)

    @app.errorhandler(Exception)
    async def internal(e: Exception):
        log.exception("unhandled error")
        return error_response(errors.internal_error(e))
