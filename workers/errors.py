"""Errors the engine raises to its caller; each carries a machine kind and a human reason.

The kinds are the protocol's (``LoadFailed.kind``, ``Rejected.kind``): the worker sends them on as
they are, and the router refuses a message whose kind is not in its list.
"""

from __future__ import annotations

from pantheon.core.protocol import LoadFailKind, RejectKind, TokenOut


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


class StepFailed(Exception):
    """A step raised ``cause``; the requests it ran (``request_ids``) were ended. ``outs``: what
    the step finished before it raised for other requests (a truncation), to send as usual."""

    def __init__(self, request_ids: list[str], outs: list[TokenOut], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids, self.outs, self.cause = request_ids, outs, cause
