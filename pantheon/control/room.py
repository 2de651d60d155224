"""Loads that wait for room: first come first served, bounded, and which instance may go.

A load that finds no room (``--models-max`` instances, or no die with the memory it needs) is
not refused while an instance it may evict will free: it waits here, in order, until one is
idle, evicts it and tries again (as Ollama queues requests while it swaps models and
llama-swap holds them until the swap). ``pantheon.control.residency`` says what each instance
is (``Holder``); ``pantheon.control.lifecycle`` places the loads.

- ``RoomQueue.turn(name)`` (an async context): every load places in its turn. It joins the
  line (429 ``queue_full`` when ``depth`` loads already wait behind the one placing) and waits
  to be at its head; with nobody waiting that is at once, and a load that fits leaves at once.
  Only the head evicts: it waits (``wait_change``) until ``poke()`` says something changed (a
  request ended, an instance went idle or away). Both waits end ``timeout_s`` after the load
  joined: 429 ``queue_timeout``, naming what holds the room;
- ``victim(for_name, holders)``: the least recently used idle evictable instance of another
  model, or None; ``will_free(for_name, holders)``: whether waiting can help (an instance of
  another model is evictable, or already being unloaded). When it cannot, the load's 507 says
  what holds the room.

Plain asyncio state on the router's event loop; no torch, no I/O.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from pantheon import errors


@dataclass(frozen=True)
class Holder:
    """An instance that holds room, as a load waiting for room sees it."""

    instance_id: str
    name: str
    evictable: bool  # loaded on demand and not pinned: it may be unloaded once idle
    idle: bool  # ready, and no request in flight, queued or on its way to a slot
    used: float = 0.0  # when it last ended a request (monotonic): the least recent goes first
    leaving: bool = False  # being unloaded already: its room frees without an eviction


def victim(for_name: str, holders: Iterable[Holder]) -> Holder | None:
    """The instance to evict for a load of ``for_name``: the least recently used idle
    evictable one of another model (the first of equals); None when none is idle now."""
    idle = [h for h in holders if h.name != for_name and h.evictable and h.idle and not h.leaving]
    return min(idle, key=lambda h: h.used) if idle else None


def will_free(for_name: str, holders: Iterable[Holder]) -> bool:
    """Whether room for ``for_name`` can free by waiting: another model's instance is
    evictable (busy now, idle later) or already leaving."""
    return any(h.name != for_name and (h.evictable or h.leaving) for h in holders)


@dataclass(eq=False)
class Turn:
    """One load's place in the line: it may place once it is the head, until ``deadline``."""

    name: str
    deadline: float
    since: float = field(default_factory=time.monotonic)
    _wake: asyncio.Future[None] | None = None


class RoomQueue:
    """The line of loads waiting to place (see the module doc). ``holders(name)`` says what
    holds the room a load of ``name`` needs, for the timeout's message."""

    def __init__(self, depth: int, timeout_s: float, holders: Callable[[str], str] = lambda name: ""):
        self.depth = depth
        self.timeout_s = timeout_s
        self.holders = holders
        self._line: collections.deque[Turn] = collections.deque()

    def __len__(self) -> int:
        """Loads in the line, the one placing included."""
        return len(self._line)

    def waiting(self) -> list[str]:
        """The model names in the line, head first."""
        return [t.name for t in self._line]

    @contextlib.asynccontextmanager
    async def turn(self, name: str) -> AsyncIterator[Turn]:
        """Join the line and wait to be its head; leaving it (however) hands the head on."""
        if len(self._line) > self.depth:
            raise errors.load_queue_full(name, len(self._line), self.depth)
        t = Turn(name, time.monotonic() + self.timeout_s)
        self._line.append(t)
        try:
            while self._line[0] is not t:
                await self._sleep(t)
            yield t
        finally:
            head = self._line[0] is t
            self._line.remove(t)
            if head:
                self.poke()  # the next load's turn

    async def wait_change(self, t: Turn) -> None:
        """The head waits until ``poke()`` (or its deadline: 429)."""
        await self._sleep(t)

    def poke(self) -> None:
        """Something changed (a request ended, an instance went idle or away): wake the head."""
        if self._line:
            fut = self._line[0]._wake
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def _sleep(self, t: Turn) -> None:
        left = t.deadline - time.monotonic()
        if left <= 0:
            raise errors.load_queue_timeout(t.name, self.timeout_s, self.holders(t.name))
        t._wake = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(t._wake, left)
        except TimeoutError:
            raise errors.load_queue_timeout(t.name, self.timeout_s, self.holders(t.name)) from None
        finally:
            t._wake = None
