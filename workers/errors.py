"""Errors the engine raises to its caller; each carries a machine kind and a human reason."""


class LoadError(Exception):
    """A model folder could not be loaded. ``kind``: not_found | unsupported | invalid | out_of_memory."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class RequestRejected(Exception):
    """A request the engine will not take. ``kind``: context_length | invalid | duplicate."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
