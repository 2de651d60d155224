"""The admin API's tables: ``GET /admin/models`` rows and ``GET /admin/dies`` rows, as JSON
objects, rendered from one ``pantheon.control.live.Projection`` (the snapshot and the metrics
render the same projection their own way)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pantheon.control.live import DieFacts, InstanceFacts, Projection, booked
from pantheon.control.pressure import NAMES

if TYPE_CHECKING:
    from pantheon.control.dies import DieManager
    from pantheon.control.registry import Instance


def instance_view(f: InstanceFacts) -> dict:
    """One row of GET /admin/models: the registry's, the worker's and the die manager's view."""
    inst, es = f.inst, f.engine
    out = inst.info()
    out.update(
        weights_bytes=f.weights_bytes,
        kv_bytes=f.kv_bytes,
        state_bytes=f.state_bytes,
        queue_depth=f.queued,
        kv_pool_tokens=inst.kv_pool_tokens,
        slots_busy=f.slots_busy,
    )
    # parameters in all and read per token (a mixture of experts reads its top-k experts only)
    out["params"] = (
        {"total": inst.estimate.total_params, "active": inst.estimate.active_params}
        if inst.estimate
        else None
    )
    if es is not None:
        block = es.kv_bytes // es.kv_blocks_total if es.kv_blocks_total else 0
        out.update(
            engine_waiting=es.waiting,
            kv_blocks_used=es.kv_blocks_used,
            kv_blocks_total=es.kv_blocks_total,
            cache={
                "blocks": es.kv_blocks_cached,
                "bytes": es.kv_blocks_cached * block,
                "hit_blocks": es.cache_hit_blocks,
                "query_blocks": es.cache_query_blocks,
                "hit_rate": f.hit_rate,
            },
            # the decode step's background compile (workers/compiled.py): state, seconds, cache
            compile={"state": es.compile_state, "seconds": es.compile_s, "cache": es.compile_cache}
            if es.compile_state
            else None,
        )
    return out


def facts_of(live: Projection, inst: Instance, dies: DieManager) -> InstanceFacts:
    """The projection's facts of one instance; an instance the registry does not list yet (a
    load that just began) gets its bookings and nothing else."""
    for f in live.instances:
        if f.inst is inst:
            return f
    w, kv, st = booked(dies, inst.instance_id)
    return InstanceFacts(inst=inst, engine=None, queued=0, weights_bytes=w, kv_bytes=kv, state_bytes=st)


def die_view(f: DieFacts) -> dict:
    """One row of GET /admin/dies."""
    d, wk = f.die, f.worker
    stats = wk.last_stats if wk is not None else None
    return {
        "die": d.id,
        "kind": d.kind,
        "device_name": d.device_name or (wk.device_name if wk is not None else ""),
        "alive": f.alive,
        # a worker on another host: its name (the die id's @NAME) and its machine's host name
        "remote": d.remote,
        "host": f.host,
        "worker": "running" if f.alive else ("dead" if wk is not None else "not started"),
        "failed": f.failed,  # its worker died more than --worker-restarts times: not restarted
        "pid": wk.pid if wk is not None else None,
        "error": wk.error if wk is not None and not wk.alive else None,
        # liveness: deaths and restarts since start, the latest death's reason (kept after
        # the restart), and the heartbeat's view of the step running now
        "deaths": wk.deaths if wk is not None else 0,
        "restarts": wk.restarts if wk is not None else 0,
        "last_death": (
            {"reason": wk.last_death, "at": wk.last_death_at} if wk is not None and wk.last_death else None
        ),
        "step_running_s": (
            round(wk.beat.turn_s, 3) if wk is not None and wk.alive and wk.beat is not None else None
        ),
        "steps": wk.beat.steps if wk is not None and wk.beat is not None else None,
        "total_bytes": d.total_bytes,
        "reserve_bytes": d.reserve_bytes,
        "budget_bytes": d.budget_bytes,
        "used_bytes": d.used_bytes,
        "weights_bytes": d.weights_bytes,
        "kv_bytes": d.kv_bytes,
        "state_bytes": d.state_bytes,  # the recurrent layers' state pools (hybrid models)
        "free_bytes": max(0, d.budget_bytes - d.used_bytes),
        "measured_free_bytes": wk.free_bytes if wk is not None else None,
        "pressure": f.pressure,
        "pressure_name": NAMES[f.pressure],
        # CPU dies: the vector ISA, which CPU paths work here, and each instance's choice
        "isa": (wk.cpu_isa or None) if wk is not None else None,
        "cpu_paths": {n: (why or "ok") for n, why in wk.cpu_paths.items()} if wk else {},
        "cpu_path": f.cpu_path or None,
        # decode attention: "kernel: built|cached PATH" (CPU), "triton: VERSION" (CUDA) or "torch: why not"
        "attention": (wk.attention or None) if wk is not None else None,
        # int4 / int8 linears: "kernel ISA: built|cached PATH" (workers/kernels) or "torch: why not"
        "linear": (wk.linear or None) if wk is not None else None,
        "step_ms_avg": stats.step_ms_avg if stats is not None else None,
        "bookings": {
            iid: {"weights_bytes": b[0], "kv_bytes": b[1], "state_bytes": b[2]}
            for iid, b in sorted(d.bookings.items())
        },
        "instances": [instance_view(i) for i in f.instances],
        # prompt-lookup speculation per instance since load (workers/speculation.py), where it ran
        "speculation": {
            i.instance: {
                "draft": i.spec_draft or None,  # the draft model's path; None: prompt lookup
                "verify_steps": i.spec_verify_steps,
                "drafted": i.spec_drafted,
                "accepted": i.spec_accepted,
                "emitted": i.spec_emitted,  # tokens the verify steps gave out
                "acceptance_rate": round(i.spec_accepted / i.spec_drafted, 4) if i.spec_drafted else None,
                "tokens_per_step": round(i.spec_emitted / i.spec_verify_steps, 3),
            }
            for i in (stats.instances if stats is not None else [])
            if i.spec_verify_steps
        },
    }
