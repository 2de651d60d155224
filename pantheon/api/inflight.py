"""What the router has in flight, counted for its bounds: request-body bytes (``BodyBudget``,
``--max-body-in-flight``, with ``Trimmer`` handing a large body's heap back to the system) and
requests (``Drain``, which shutdown waits for). ``pantheon.api.middleware`` feeds both (see its
module doc); ``AppState`` holds them and ``/metrics`` reads the bytes.

A leaf of ``pantheon.api``: it imports nothing of it, so the state, the metrics and the
middleware can all name these types without importing each other.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
import time
from collections.abc import Callable, Collection
from typing import Protocol

log = logging.getLogger("pantheon.api.middleware")

_END_GRACE_S = 5.0  # after ending the generations, how long the last responses may take
TRIM_EVERY_S = 2.0  # at most one malloc_trim per this many seconds (a later one is deferred)


class BodyTicket:
    """One request's share of the ``BodyBudget``: ``held`` bytes until ``release``."""

    __slots__ = ("budget", "held", "received", "peak", "released")

    def __init__(self, budget: BodyBudget, held: int):
        self.budget, self.held, self.received, self.peak, self.released = budget, held, 0, held, False

    def arrived(self, n: int) -> bool:
        """``n`` more bytes of the body came; False when they take the budget past its bound."""
        self.received += n
        if self.released or self.received <= self.held or self.received > self.budget.max_body + n:
            return True  # reserved already, or dropped by the app (over --max-body): not held
        grow = self.received - self.held
        if not self.budget.take(grow, self.held):
            return False
        self.held += grow
        self.peak = max(self.peak, self.held)
        return True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget.give(self.held)
            self.held = 0


class BodyBudget:
    """The router-wide bound on request-body bytes in flight (see the module doc)."""

    def __init__(self, limit: int, max_body: int):
        self.limit, self.max_body = limit, max_body
        self.in_flight = 0

    def take(self, n: int, mine: int = 0) -> bool:
        """Reserve ``n`` bytes for a body already holding ``mine``; refused past the bound unless
        that body is the only one in flight."""
        if self.in_flight + n > self.limit and self.in_flight > mine:
            return False
        self.in_flight += n
        return True

    def give(self, n: int) -> None:
        self.in_flight = max(0, self.in_flight - n)

    def ticket(self, declared: int | None) -> BodyTicket | None:
        """A ticket for a body of ``declared`` bytes (None: chunked, counted as it comes); None
        when the bound refuses it. A declared size over ``--max-body`` reserves nothing (the app
        answers 413 without keeping the body)."""
        want = declared if declared is not None and declared <= self.max_body else 0
        if want and not self.take(want):
            return None
        return BodyTicket(self, want)


def _load_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


class Trimmer:
    """Hands the heap freed by large bodies back to the system: ``malloc_trim(0)`` in a thread,
    at most once per ``every_s`` (a request in between gets one when the interval ends)."""

    def __init__(self, every_s: float = TRIM_EVERY_S):
        self.every_s = every_s
        self.fn = _load_trim()
        self.last = -1e9
        self.count = 0
        self._pending: asyncio.Task | None = None

    def request(self) -> None:
        if self.fn is None or (self._pending is not None and not self._pending.done()):
            return
        self._pending = asyncio.get_running_loop().create_task(self._run(), name="malloc-trim")

    async def _run(self) -> None:
        wait = self.last + self.every_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self.last = time.monotonic()
        if self.fn is None:
            return
        try:
            await asyncio.to_thread(self.fn, 0)
            self.count += 1
        except Exception:  # noqa: BLE001 - memory hygiene, never an error
            log.debug("malloc_trim failed", exc_info=True)


class Endable(Protocol):
    """A generation in flight, as the drain ends it."""

    def shutdown(self) -> None: ...


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

    async def run(self, live: Collection[Endable], deadline_s: float) -> None:
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
