"""What the worker says about itself: ``Hello`` (its die, memory, and on a CPU die the ISA and
which CPU linear paths work here) and ``Stats`` (memory, each instance's engine stats, steps).

The main loop sends ``Stats`` every ``BUSY_STATS_S`` while busy or loading and every
``IDLE_STATS_S`` when idle.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

import msgspec

from pantheon.core import protocol as p
from workers.devices import Die
from workers.instances import Instances
from workers.stepping import Stepper

if TYPE_CHECKING:  # the engine imports torch
    from workers.engine import Engine

log = logging.getLogger("pantheon.worker")

BUSY_STATS_S = 0.25
IDLE_STATS_S = 1.0


def hello(die: Die, engine_import_error: str | None) -> p.Hello:
    free, total = die.memory()
    isa, paths, attention, linear = "", {}, "", ""
    if die.kind == "cpu" and not engine_import_error:
        from workers import cpu_paths
        from workers.kernels import paged, qlinear

        attention = paged.describe()
        log.info("%s: decode attention: %s", die.id, attention)
        linear = qlinear.describe()
        log.info("%s: quantized linears: %s", die.id, linear)

        isa = cpu_paths.isa()
        paths = {name: why or "" for name, why in cpu_paths.probe_all().items()}
        log.info(
            "%s: isa %s; CPU paths that work: %s",
            die.id,
            isa,
            ", ".join(n for n, why in paths.items() if not why) or "none",
        )
        for name, why in paths.items():
            if why:
                log.info("%s: CPU path %s is not used here: %s", die.id, name, why)
    elif die.kind == "cuda" and not engine_import_error:
        from workers.kernels import paged_triton

        attention = paged_triton.describe()  # (imports triton, as the die's first decode would)
        log.info("%s: decode attention: %s", die.id, attention)
    return p.Hello(
        die=die.id,
        device_name=die.device_name,
        total_bytes=total,
        free_bytes=free,
        pid=os.getpid(),
        cpu_isa=isa,
        cpu_paths=paths,
        hostname=socket.gethostname(),
        attention=attention,
        linear=linear,
    )


def instance_stats(name: str, engine: Engine) -> p.InstanceStats:
    """The engine's stats of one instance, with its state pools' bytes (``Engine.state_bytes``;
    the engine's own stats leave them out)."""
    es = engine.stats(name)
    state = int(getattr(engine, "state_bytes", 0) or 0)
    return msgspec.structs.replace(es, state_bytes=state) if state and not es.state_bytes else es


def stats(die: Die, instances: Instances, stepper: Stepper) -> p.Stats:
    """``steps`` counts every step since start; ``step_ms_avg`` covers those since the last Stats."""
    free, total = die.memory()
    return p.Stats(
        free_bytes=free,
        total_bytes=total,
        instances=[instance_stats(name, inst.engine) for name, inst in instances.loaded.items()],
        steps=stepper.steps,
        step_ms_avg=stepper.take_window(),
    )
