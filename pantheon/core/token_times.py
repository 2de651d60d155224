"""Per-token timestamps for ``bench/http_path.py``, behind ``PANTHEON_DEBUG_TOKEN_TIMES=DIR``.

Off (the env var unset) every ``stamp`` is one attribute test. On, each process appends
``<kind> <time.monotonic()> [<n>]`` lines to ``DIR/<role>-<pid>.txt`` (line buffered: a worker
that is killed still leaves its lines). CLOCK_MONOTONIC is one clock for every process on a
Linux host, so the bench lines the worker's step end up against the router's receive, the
router's write and the client's read of the same token. Kinds: ``s`` a worker step that sends
tokens (stamped just before the send; its start, its end, the tokens), ``r`` the router received a ``StepOutput``, ``w`` the
router handed one streamed chunk to the HTTP server.

Torch-free and dependency-free: the worker imports it too.
"""

from __future__ import annotations

import os
import time
from typing import TextIO

ENV = "PANTHEON_DEBUG_TOKEN_TIMES"


class TokenTimes:
    """One process's stamp file, or nothing when ``ENV`` is unset."""

    def __init__(self, role: str):
        self.role = role
        self._out: TextIO | None = None
        self._dir = os.environ.get(ENV) or None
        self.on = self._dir is not None

    def stamp(self, kind: str, *values: float) -> None:
        if not self.on:
            return
        if self._out is None:
            assert self._dir is not None
            path = os.path.join(self._dir, f"{self.role}-{os.getpid()}.txt")
            self._out = open(path, "a", buffering=1)  # noqa: SIM115 (kept for the process's life)
        now = time.monotonic()
        self._out.write(" ".join([kind, repr(now), *map(repr, values)]) + "\n")


router_times = TokenTimes("router")
