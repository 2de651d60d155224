"""Memory pressure: a level from 0 (normal) to 3 (critical) for the host and for each die.

A level is how many of the three thresholds (fractions of memory in use; default 0.85, 0.92 and
0.97, ``--pressure-thresholds``) the memory in use has reached:

- the host: ``1 - available / total`` from ``psutil.virtual_memory()``, read at most every
  100 ms (the gate asks before every request; psutil costs a system call);
- a CUDA die: the share of its *headroom* in use, where the headroom is what the instances
  did not book (``total - booked``: the weights and KV pools are allocated once, at load, and
  never grow) and in use is what the worker measures beyond the bookings
  (``total - free - booked``: activations, the allocator's cache, other processes). A die
  packed to the brim with pools but with its small remainder idle is NORMAL: an H200 with
  136 GB booked of 141 GB and 4 GiB free is at level 0, not 3. With nothing booked this is the
  plain ``1 - free / total``;
- a CPU die lives in host RAM, so its level is the host's. (Bookings are not pressure: a die
  whose budget is fully booked by preallocated KV pools is working as designed.)

What the levels do: at CRITICAL the slot gate takes no request on its fast path (requests wait
in the queue, and a full queue answers 503 instead of 429). The lower levels are reported
(``/admin/dies``, the dashboard, ``/metrics``) and change nothing else.

Test seam: ``force(level, die=None)`` overrides the measured level of the host (``die=None``:
everything) or of one die until ``clear()``. The admin API exposes it only when the server runs
with ``PANTHEON_TEST_HOOKS=1``, so tests can reach CRITICAL without eating memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

from pantheon.config.values import parse_thresholds  # noqa: F401 - re-exported; it lives with the other settings parsers
from pantheon.core.protocol import die_host, die_kind

NORMAL, ELEVATED, HIGH, CRITICAL = 0, 1, 2, 3
NAMES = ("normal", "elevated", "high", "critical")
DEFAULT_THRESHOLDS = (0.85, 0.92, 0.97)
_HOST_EVERY_S = 0.1


def level_for(used_fraction: float, thresholds: tuple[float, float, float]) -> int:
    return sum(1 for t in thresholds if used_fraction >= t)


def headroom_used(total: int, free: int, booked: int) -> float:
    """The share of a die's unbooked memory in use, 0..1 (see the module doc)."""
    booked = max(0, min(booked, total))
    headroom = total - booked
    if headroom <= 0:
        return 1.0 if free <= 0 else 0.0
    beyond = total - free - booked  # in use but not booked
    return min(1.0, max(0.0, beyond / headroom))


class PressureSource:
    """Levels for the host and the dies; see the module doc."""

    def __init__(
        self,
        thresholds: tuple[float, float, float] = DEFAULT_THRESHOLDS,
        *,
        host_probe: Callable[[], tuple[int, int]] | None = None,
        die_probe: Callable[[str], tuple[int, int] | None] | None = None,
        booked_probe: Callable[[str], int] | None = None,
    ):
        """``host_probe() -> (total, available)``; ``die_probe(die) -> (total, free)`` for a
        CUDA die (None when unknown); ``booked_probe(die) -> bytes`` the instances booked on
        it (0 when not given)."""
        self.thresholds = thresholds
        self._host_probe = host_probe or _psutil_host
        self.die_probe = die_probe
        self.booked_probe = booked_probe
        self._host: tuple[int, int] = (0, 0)
        self._host_at = 0.0
        self._forced: dict[str | None, int] = {}

    # ------------------------------------------------------------ the test seam

    def force(self, level: int, die: str | None = None) -> None:
        if not NORMAL <= level <= CRITICAL:
            raise ValueError(f"pressure level {level} is not between 0 and 3")
        self._forced[die] = level

    def clear(self) -> None:
        self._forced.clear()

    @property
    def forced(self) -> dict[str | None, int]:
        return dict(self._forced)

    # ------------------------------------------------------------ readings

    def host_memory(self) -> tuple[int, int]:
        """``(total, available)`` bytes of host RAM, at most 100 ms old."""
        now = time.monotonic()
        if now - self._host_at >= _HOST_EVERY_S or not self._host[0]:
            self._host = self._host_probe()
            self._host_at = now
        return self._host

    def host_level(self) -> int:
        if None in self._forced:
            return self._forced[None]
        total, avail = self.host_memory()
        return level_for(1 - avail / total, self.thresholds) if total else NORMAL

    def die_level(self, die: str) -> int:
        if die in self._forced:
            return max(self._forced[die], self._forced.get(None, NORMAL))
        if None in self._forced:
            return self._forced[None]
        if die_kind(die) == "cuda" or die_host(die):  # measured by its worker (CUDA, another host)
            got = self.die_probe(die) if self.die_probe is not None else None
            if got is None or got[0] <= 0:
                return NORMAL
            total, free = got
            booked = self.booked_probe(die) if self.booked_probe is not None else 0
            return level_for(headroom_used(total, free, booked), self.thresholds)
        return self.host_level()  # a local CPU die lives in host RAM

    def level(self, dies: Iterable[str] = ()) -> int:
        """The worst of the host and ``dies``: what the gate of an instance on them sees."""
        return max([self.host_level(), *(self.die_level(d) for d in dies)])


def _psutil_host() -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)
