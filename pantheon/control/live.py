"""One projection of the router's live state: dies, instances, slots and queues, read once.

Three readers show the same facts in three shapes: ``GET /admin/dies`` and ``/admin/models``
(``pantheon.api.admin.views``), the dashboard's ``Snapshot`` (``pantheon.control.feed``) and the
Prometheus gauges (``pantheon.api.metrics``). Each of them starts from ``project(...)``, so a
number (what an instance booked, how deep its queue is, which worker a die has) is worked out in
one place and the three can never disagree about it.

Nothing here talks to a worker: the worker side of the facts is each worker's last ``Stats``
and heartbeat as the pool keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: this module needs none of them at run time
    from pantheon.control.dies import Die, DieManager
    from pantheon.control.pressure import PressureSource
    from pantheon.control.registry import Instance, ModelQueue, Registry
    from pantheon.core.protocol import InstanceStats


@dataclass(frozen=True)
class InstanceFacts:
    """One instance as the registry, its worker's engine and the die manager see it."""

    inst: Instance
    engine: InstanceStats | None  # the worker's last stats of it; None before the first
    queued: int  # requests waiting in its model's queue (shared by the model's replicas)
    weights_bytes: int  # booked over all its dies
    kv_bytes: int
    state_bytes: int = 0  # its recurrent layers' state pools (0 for a model without such layers)

    @property
    def slots_busy(self) -> int:
        """Slots doing work: the engine's count when it reported, else the registry's gate."""
        if self.engine is None:
            return self.inst.gate.active
        return sum(1 for s in self.engine.slots if s.state != "idle")

    @property
    def hit_rate(self) -> float | None:
        """The prefix cache's blocks reused over blocks looked up; None before any lookup."""
        es = self.engine
        if es is None or not es.cache_query_blocks:
            return None
        return es.cache_hit_blocks / es.cache_query_blocks


@dataclass(frozen=True)
class DieFacts:
    """One die: its budget and bookings, its worker (if one was started) and its pressure."""

    die: Die
    worker: Any  # pantheon.workerlink.pool.DieInfo, or None when no worker was started for it
    pressure: int  # 0 normal .. 3 critical
    hosted: list[str]  # ids of instances with memory on it (the registry's and the bookings')
    cpu_path: str  # CPU dies: the linear-layer paths its instances run, comma-joined; else ""
    instances: list[InstanceFacts]  # the registry's instances placed on it
    failed: bool = False  # the supervisor gave up on it (more deaths than --worker-restarts)

    @property
    def alive(self) -> bool:
        return bool(self.worker is not None and self.worker.alive)

    @property
    def host(self) -> str | None:
        """A remote die's machine, as its worker named it in its Hello; None for a local die."""
        w = self.worker
        return (w.hostname or None) if self.die.remote and w is not None else None


@dataclass(frozen=True)
class Projection:
    """Everything live, read at one moment."""

    dies: list[DieFacts]
    instances: list[InstanceFacts]  # in the registry's order
    queues: dict[str, ModelQueue]  # model name -> its slot queue
    workers: list[Any]  # every worker the pool has (DieInfo), in the pool's order


def engine_stats(pool: Any) -> dict[str, InstanceStats]:
    """``{instance id: InstanceStats}`` from every worker's last ``Stats``."""
    out: dict[str, InstanceStats] = {}
    for d in pool.dies() if pool is not None else []:
        stats = getattr(d, "last_stats", None)
        for es in stats.instances if stats is not None else []:
            out[es.instance] = es
    return out


def booked(dies: DieManager, instance_id: str) -> tuple[int, int, int]:
    """``(weights, kv, state)`` bytes an instance has booked over all its dies."""
    w = kv = st = 0
    for d in dies.dies():
        bw, bkv, bst = d.bookings.get(instance_id, (0, 0, 0))
        w, kv, st = w + bw, kv + bkv, st + bst
    return w, kv, st


def die_cpu_paths(registry: Registry) -> dict[str, str]:
    """Die -> the CPU paths its instances run, sorted and comma-joined (dies without one absent)."""
    chosen: dict[str, set[str]] = {}
    for inst in registry.instances():
        if inst.cpu_path:
            for d in inst.dies:
                chosen.setdefault(d, set()).add(inst.cpu_path)
    return {d: ",".join(sorted(v)) for d, v in chosen.items()}


def project(
    registry: Registry,
    pool: Any,
    dies: DieManager,
    pressure: PressureSource,
    failed_dies: frozenset[str] | set[str] = frozenset(),
) -> Projection:
    """Read the registry, the pool's workers, the die manager and the pressure source once
    (``failed_dies``: the dies the supervisor gave up on)."""
    workers = list(pool.dies()) if pool is not None else []
    by_die = {w.die: w for w in workers}
    engine = engine_stats(pool)
    queues = registry.queues()
    insts = []
    for inst in registry.instances():
        q = queues.get(inst.name)
        w, kv, st = booked(dies, inst.instance_id)
        insts.append(
            InstanceFacts(
                inst=inst,
                engine=engine.get(inst.instance_id),
                queued=len(q) if q is not None else 0,
                weights_bytes=int(w),
                kv_bytes=int(kv),
                state_bytes=int(st),
            )
        )
    paths = die_cpu_paths(registry)
    die_facts = []
    for d in dies.dies():
        on_it = [f for f in insts if d.id in f.inst.dies]
        hosted = sorted({f.inst.instance_id for f in on_it} | set(d.bookings))
        die_facts.append(
            DieFacts(
                die=d,
                worker=by_die.get(d.id),
                pressure=pressure.die_level(d.id),
                hosted=hosted,
                cpu_path=paths.get(d.id, ""),
                instances=on_it,
                failed=d.id in failed_dies,
            )
        )
    return Projection(dies=die_facts, instances=insts, queues=queues, workers=workers)
