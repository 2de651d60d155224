"""``AppState``: everything one router app holds, typed, built once by ``create_app``.

A route, the middleware or ``pantheon serve`` reaches it through ``app_state()`` (inside a
request) or ``app_state(app)``; nothing else is kept on the Quart app. ``build_state``
(``pantheon.api.app``) makes every part first, then the ``AppState`` with all of them: the
config, the pool and registry it was given; the die manager, pressure source, feed and
loads/unloads (``Models``) around them; the access guard, the metrics, the drain (graceful
shutdown) and the request-body budget that ``middleware.install`` wires into the app; and, for
``pantheon serve``, the supervisor (tests without one leave it None: a worker death then fails
the requests on it and nothing restarts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quart import Quart, current_app

from pantheon.control.feed import snapshot
from pantheon.control.live import Projection, project

if TYPE_CHECKING:
    from pantheon import snapshot as st
    from pantheon.api.auth import Guard
    from pantheon.api.generation import Generation
    from pantheon.api.inflight import BodyBudget, Drain
    from pantheon.api.metrics import Metrics
    from pantheon.config.settings import ServeConfig
    from pantheon.control.dies import DieManager
    from pantheon.control.feed import Feed
    from pantheon.control.lifecycle import Models
    from pantheon.control.pressure import PressureSource
    from pantheon.control.registry import Registry
    from pantheon.control.residency import Residency
    from pantheon.control.supervisor import Supervisor
    from pantheon.workerlink.pool import WorkerPool

_KEY = "pantheon"


@dataclass(frozen=True, eq=False)
class LiveView:
    """The live parts read together (``project()``): what the admin views, the snapshot and
    the metrics show. ``failed_dies``: the dies the supervisor gave up on (it adds to the set)."""

    registry: Registry
    pool: WorkerPool
    dies: DieManager
    pressure: PressureSource
    failed_dies: set[str]

    def project(self) -> Projection:
        return project(self.registry, self.pool, self.dies, self.pressure, self.failed_dies)


@dataclass(eq=False)
class AppState:
    config: ServeConfig
    pool: WorkerPool
    registry: Registry
    dies: DieManager
    pressure: PressureSource
    feed: Feed
    models: Models
    live: set[Generation]  # generations in flight, ended at once on shutdown
    note_pressure: Callable[[], None]  # a change of the overall pressure level becomes an event
    residency: Residency  # load on first request, keep-alive, eviction
    view: LiveView
    guard: Guard
    metrics: Metrics
    drain: Drain
    bodies: BodyBudget  # request-body bytes in flight (--max-body-in-flight)
    # die -> (total, free) bytes as its worker last measured (the tick copies them from the
    # pool): what the pressure of a CUDA die is computed from
    measured: dict[str, tuple[int, int]] = field(default_factory=dict)
    supervisor: Supervisor | None = None  # pantheon serve's: restarts dead workers
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)  # background tasks by name

    def project(self) -> Projection:
        """The live state read once: what the admin views, the snapshot and metrics show."""
        return self.view.project()

    def snapshot(self) -> st.Snapshot:
        return snapshot(self.project(), self.feed, self.pressure, self.registry.queue_depth, self.residency)


def install_state(app: Quart, state: AppState) -> None:
    app.extensions[_KEY] = state


def app_state(app: Quart | None = None) -> AppState:
    """The app's state: ``app``'s, or the current request's app's when none is given."""
    return (app if app is not None else current_app).extensions[_KEY]
