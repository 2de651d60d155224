"""The errors the router's side of the worker link raises.

``WorkerPool`` (pool.py) raises them and re-exports them: ``from pantheon.workerlink.pool import
WorkerDied`` and the like keep working.
"""

from __future__ import annotations

from pantheon.core.protocol import LoadFailKind, RejectKind


class PoolError(Exception):
    """Base class of the errors the worker link raises."""


class WorkerStartError(PoolError):
    """A worker did not come up (did not spawn, exited, or sent no Hello in time)."""


class WorkerDied(PoolError):
    """The worker that owned a request, a load or an unload died (or was declared dead)."""

    def __init__(self, die: str, reason: str):
        super().__init__(f"worker for {die} died: {reason}")
        self.die = die
        self.reason = reason


class LoadFailedError(PoolError):
    """The worker could not load a model. ``kind``: not_found | unsupported | invalid | out_of_memory
    | internal | cancelled (``protocol.LoadFailKind``)."""

    def __init__(self, kind: LoadFailKind, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class RequestRejectedError(PoolError):
    """The worker would not run a request. ``kind``: context_length | no_instance | invalid |
    duplicate | internal (a step that ran it failed) (``protocol.RejectKind``)."""

    def __init__(self, kind: RejectKind, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason
