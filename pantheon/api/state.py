"""``AppState``: everything one router app holds, typed, built once by ``create_app``.

A route, the middleware or ``pantheon serve`` reaches it through ``app_state()`` (inside a
request) or ``app_state(app)``; nothing else is kept on the Quart app. Who sets what:

- ``create_app`` (``pantheon.api.app``): the config, the pool and registry it was given, and
  the die manager, pressure source, feed and loads/unloads (``Models``) it makes for them;
- ``middleware.install``: the access guard, the metrics and the drain (graceful shutdown);
- ``pantheon serve``: the supervisor, once the workers are up (tests without one leave it None:
  a worker death then fails the requests on it and nothing restarts it).
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
    from pantheon.api.metrics import Metrics
    from pantheon.api.middleware import BodyBudget, Drain
    from pantheon.api.openai.service import Generation
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
    # die -> (total, free) bytes as its worker last measured (the tick copies them from the
    # pool): what the pressure of a CUDA die is computed from
    measured: dict[str, tuple[int, int]] = field(default_factory=dict)
    # set by middleware.install:
    guard: Guard = field(init=False)
    metrics: Metrics = field(init=False)
    drain: Drain = field(init=False)
    bodies: BodyBudget = field(init=False)  # request-body bytes in flight (--max-body-in-flight)
    # set by pantheon serve:
    supervisor: Supervisor | None = None
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)  # background tasks by name

    def project(self) -> Projection:
        """The live state read once: what the admin views, the snapshot and metrics show."""
        failed = self.supervisor.failed_dies if self.supervisor is not None else frozenset()
        return project(self.registry, self.pool, self.dies, self.pressure, failed)

    def snapshot(self) -> st.Snapshot:
        return snapshot(self.project(), self.feed, self.pressure, self.registry.queue_depth, self.residency)


def install_state(app: Quart, state: AppState) -> None:
    app.extensions[_KEY] = state


def app_state(app: Quart | None = None) -> AppState:
    """The app's state: ``app``'s, or the current request's app's when none is given."""
    return (app if app is not None else current_app).extensions[_KEY]
