"""Errors the engine raises to its caller; each carries a machine kind and a human reason.

The kinds are the protocol's (``LoadFailed.kind``, ``Rejected.kind``): the worker sends them on as
they are, and the router refuses a message whose kind is not in its list.
"""

from __future__ import annotations

from pantheon.core.protocol import LoadFailKind, RejectKind


class LoadError(Exception):
    """A model folder could not be loaded. ``kind``: not_found | unsupported | invalid | out_of_memory."""

    def __init__(self, kind: LoadFailKind, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class RequestRejected(Exception):
    """A request the engine will not take. ``kind``: context_length | invalid | duplicate."""

    def __init__(self, kind: RejectKind, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
