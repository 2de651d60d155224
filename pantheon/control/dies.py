"""The die manager: which dies exist, their budgets, what each instance has booked on them, and
where a new instance goes.

A die is ``cpu:N`` (a virtual die whose total is the configured CPU die budget) or ``cuda:N``
(its total is what its worker reports in ``Hello``/``Stats``). A die of a worker on another
host, ``cpu:N@NAME`` or ``cuda:N@NAME``, exists once that worker joined, and both kinds take
their total and free memory from its reports (its host's RAM is not ours). Its budget is the total minus a
reserve (``--die-reserve``; by default 1 GiB on CUDA dies for the context and transients, nothing
on CPU dies). Every instance books ``(weights, kv, state)`` bytes on each die it uses (its
weights, its share of the KV pool, its share of the recurrent layers' state pools, 0 for a model
without such layers): an estimate while it loads (``sizing.estimate``), the worker's real figures
once ``Loaded`` arrives; a failed load or an unload gives the booking back. Bookings are plain
bookkeeping on the event loop: admission and booking happen in one synchronous step, so two
concurrent loads can never both take the last free bytes.

Placement: explicit (every listed die must have room for its share, else a 507 that names the
die and how much it lacks) or automatic (the die where the whole model fits with the most free
memory). ``free`` is the budget minus bookings, and no more than the memory the die really has
free (a CUDA die shared with another process, host RAM for CPU dies).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pantheon import errors
from pantheon.core.protocol import die_host, die_kind, parse_die

GiB = 1 << 30
DEFAULT_CUDA_RESERVE = 1 * GiB


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def gpu_count() -> int:
    """CUDA devices the NVIDIA driver lists, without importing torch."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def default_cpu_budget(cpu_dies: int, total_bytes: int | None = None) -> int:
    """Each CPU die's budget when none is configured: the machine's RAM less a headroom for the
    OS, the router and the page cache (an eighth, at least 2 GiB), shared equally by the dies."""
    if total_bytes is None:
        import psutil

        total_bytes = int(psutil.virtual_memory().total)
    headroom = max(2 * GiB, total_bytes // 8)
    return max(GiB // 4, (total_bytes - headroom) // max(1, cpu_dies))


def default_worker_threads(cpu_dies: int, explicit: int | None) -> int | None:
    """Torch threads per worker: an explicit value wins; with several CPU dies on one machine
    each worker gets an equal share of the cores, so the workers do not oversubscribe them."""
    if explicit:
        return explicit
    if cpu_dies > 1:
        return max(1, (os.cpu_count() or 1) // cpu_dies)
    return None


Booking = tuple[int, int, int]  # bytes of weights, KV cache, recurrent state


def _parts(b: tuple[int, ...]) -> Booking:
    """``(w, kv)`` or ``(w, kv, state)`` as ``(w, kv, state)``."""
    w, kv, *rest = b
    return int(w), int(kv), int(rest[0]) if rest else 0


def booking(
    est: Any, dies: tuple[str, ...], *, weights: int | None = None, kv: int = 0, state: int = 0
) -> dict[str, Booking]:
    """``{die: (w, kv, state)}`` of a replica over ``dies``: ``est.split`` (a
    ``sizing.Estimate``) books the KV pool and the state pool together as each die's cache; the
    state's share is split out again so that the dies can show it apart from the KV cache."""
    both = est.split(dies, weights=weights, kv=kv, state=state)
    states = est.split(dies, state=state) if state else {}
    out = {}
    for die, (w, cache) in both.items():
        st = states[die][1] if states else 0
        out[die] = (int(w), int(cache - st), int(st))
    return out


def booked_of(est: Any, dies: tuple[str, ...], loaded: Any) -> dict[str, Booking]:
    """What an instance books once its worker said ``Loaded``: the real weights, KV pool and
    state pools, shared over ``dies`` as the estimate ``est`` shares them."""
    return booking(
        est,
        dies,
        weights=loaded.weight_bytes,
        kv=loaded.kv_bytes,
        state=getattr(loaded, "state_bytes", 0) or 0,
    )


def _what(w: int, kv: int, st: int) -> str:
    """``weights 1.0 GiB + KV cache 256 MiB [+ recurrent state 24 MiB]``."""
    out = f"weights {fmt_bytes(w)} + KV cache {fmt_bytes(kv)}"
    return out + (f" + recurrent state {fmt_bytes(st)}" if st else "")


@dataclass
class Die:
    id: str
    kind: str  # cpu | cuda
    total_bytes: int = 0  # 0: a CUDA die whose worker has not said Hello yet
    reserve_bytes: int = 0
    device_name: str = ""
    measured_free: int | None = None  # what the worker last reported free (CUDA only)
    bookings: dict[str, Booking] = field(default_factory=dict)  # instance -> (w, kv, state)

    @property
    def remote(self) -> bool:
        """A die of a worker on another host (``cpu:0@NAME``)."""
        return bool(die_host(self.id))

    @property
    def measured(self) -> bool:
        """Its size comes from its worker's reports (CUDA, or any die on another host)."""
        return self.kind == "cuda" or self.remote

    @property
    def known(self) -> bool:
        return self.total_bytes > 0

    @property
    def budget_bytes(self) -> int:
        return max(0, self.total_bytes - self.reserve_bytes)

    @property
    def weights_bytes(self) -> int:
        return sum(b[0] for b in self.bookings.values())

    @property
    def kv_bytes(self) -> int:
        return sum(b[1] for b in self.bookings.values())

    @property
    def state_bytes(self) -> int:
        """Booked by the recurrent layers' state pools."""
        return sum(b[2] for b in self.bookings.values())

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes


class DieManager:
    """Dies, budgets, bookings and placement (see the module doc)."""

    def __init__(
        self,
        *,
        cpu_dies: int = 0,
        cpu_budget: int | None = None,
        reserve: int | None = None,
        cuda_count: int | None = None,
        host_available: Callable[[], int] | None = None,
    ):
        # None: from the machine; dies created later (cpu:N named in a load) get the same share
        self.cpu_budget = cpu_budget or default_cpu_budget(cpu_dies)
        self.reserve = reserve
        self.cuda_count = gpu_count() if cuda_count is None else cuda_count
        self._host_available = host_available
        self._dies: dict[str, Die] = {}
        for i in range(cpu_dies):
            self._add(f"cpu:{i}")

    # ------------------------------------------------------------ discovery

    def _add(self, die_id: str) -> Die:
        kind = die_kind(die_id)
        reserve = (
            self.reserve if self.reserve is not None else (DEFAULT_CUDA_RESERVE if kind == "cuda" else 0)
        )
        local_cpu = kind == "cpu" and not die_host(die_id)
        d = Die(die_id, kind, reserve_bytes=reserve, total_bytes=self.cpu_budget if local_cpu else 0)
        self._dies[die_id] = d
        return d

    def check(self, die_id: str) -> str:
        """The die's canonical id if this machine has it; else a 400."""
        try:
            kind, n = parse_die(die_id)
        except ValueError:
            raise errors.not_a_die(die_id) from None
        host = die_host(die_id)
        die_id = f"{kind}:{n}" + (f"@{host}" if host else "")
        if host and die_id not in self._dies:
            raise errors.remote_die_not_joined(die_id)
        if die_id not in self._dies:
            if kind == "cpu":
                raise errors.no_such_die(die_id, "cpu", self.cpu_count)
            if n >= self.cuda_count:
                raise errors.no_such_die(die_id, "cuda", self.cuda_count)
            self._add(die_id)
        return die_id

    @property
    def cpu_count(self) -> int:
        return sum(1 for d in self._dies.values() if d.kind == "cpu" and not d.remote)

    def on_worker(self, die_id: str, total_bytes: int, free_bytes: int, device_name: str = "") -> None:
        """What a worker said in Hello or Stats: the real size of a CUDA die."""
        d = self._dies.get(die_id) or self._add(die_id)
        if device_name:
            d.device_name = device_name
        if d.measured and total_bytes > 0:
            d.total_bytes = total_bytes
            d.measured_free = free_bytes

    def get(self, die_id: str) -> Die | None:
        return self._dies.get(die_id)

    def dies(self) -> list[Die]:
        return sorted(
            self._dies.values(), key=lambda d: (d.remote, die_host(d.id), d.kind, parse_die(d.id)[1])
        )

    # ------------------------------------------------------------ room

    def free(self, die: Die) -> int:
        """Bytes an instance may still book on ``die``."""
        room = die.budget_bytes - die.used_bytes
        if die.measured and die.measured_free is not None:
            room = min(room, die.measured_free - die.reserve_bytes)
        if die.kind == "cpu" and not die.remote and self._host_available is not None:
            # CPU dies share the host's RAM: their budgets may add up to more than it has
            room = min(room, self._host_available())
        return max(0, room)

    def place(
        self,
        need: Callable[[tuple[str, ...]], Mapping[str, tuple[int, ...]]],
        dies: tuple[str, ...] = (),
        candidates: list[str] | None = None,
    ) -> tuple[str, ...]:
        """Dies for a new instance; ``need(dies)`` gives its ``{die: (w, kv[, state])}`` split
        there.

        Explicit ``dies``: each must have room for its share. Automatic: the single die with
        room and the most free memory, among ``candidates`` (the alive ones; default all known).
        Raises 507 naming what is short."""
        if dies:
            lacks = []
            for die_id, b in need(dies).items():
                w, kv, st = _parts(b)
                d = self._dies[die_id]
                if not d.known:
                    continue  # a CUDA die learns its size from its worker's Hello
                room = self.free(d)
                if w + kv + st > room:
                    lacks.append(
                        f"{die_id} lacks {fmt_bytes(w + kv + st - room)} (needs "
                        f"{fmt_bytes(w + kv + st)}: {_what(w, kv, st)}; {fmt_bytes(room)} of its "
                        f"{fmt_bytes(d.budget_bytes)} budget free)"
                    )
            if lacks:
                raise errors.insufficient_memory("the model does not fit: " + "; ".join(lacks))
            return tuple(dies)
        ids = candidates if candidates is not None else [d.id for d in self.dies() if d.known]
        pool = [self._dies[i] for i in ids if i in self._dies and self._dies[i].known]
        if not pool:
            raise errors.no_die_available()
        fits, short = [], []
        for d in pool:
            w, kv, st = _parts(need((d.id,))[d.id])
            room = self.free(d)
            if w + kv + st <= room:
                fits.append((room, d))
            else:
                short.append(f"{d.id} lacks {fmt_bytes(w + kv + st - room)} ({fmt_bytes(room)} free)")
        if not fits:
            w, kv, st = _parts(need((pool[0].id,))[pool[0].id])
            raise errors.insufficient_memory(
                f"no die has room for the model ({_what(w, kv, st)}): " + "; ".join(short)
            )
        best = max(fits, key=lambda t: t[0])  # max() keeps the first of equals: lowest id
        return (best[1].id,)

    # ------------------------------------------------------------ bookings

    def book(self, instance: str, split: Mapping[str, tuple[int, ...]]) -> None:
        """Book (or re-book, replacing the old figures) ``instance`` on its dies: ``{die: (w, kv)}``
        or ``{die: (w, kv, state)}``."""
        self.release(instance)
        for die_id, b in split.items():
            (self._dies.get(die_id) or self._add(die_id)).bookings[instance] = _parts(b)

    def release(self, instance: str) -> None:
        for d in self._dies.values():
            d.bookings.pop(instance, None)

    def bookings(self) -> dict[str, dict[str, Booking]]:
        """``{die: {instance: (w, kv, state)}}``: for tests and the admin view."""
        return {d.id: dict(d.bookings) for d in self.dies()}
