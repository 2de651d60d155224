"""The worker's memory outside its tensors: oneDNN's shape caches, glibc's free heap, and a debug
report that tells a Python leak from native growth.

Issue 23 §7 saw a CPU worker's RSS grow from 1.10 to 2.15 GB over a 5-minute soak while 529 MB
was booked. Two causes, both native (``tracemalloc`` and the per-request tables stayed flat):

1. **oneDNN's caches.** Every oneDNN primitive torch creates (a bf16 matmul or linear on the
   CPU) is kept, keyed by its shapes, in two LRU caches of 1024 entries each: oneDNN's own
   primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's computation cache
   (``LRU_CACHE_CAPACITY``), each entry ~0.1-0.5 MB (its jitted kernels). Decode attention's
   bf16 matmuls have a shape that is new at every step (the context ``T`` grows by one) and
   every linear one per distinct row count, so a soak of varied prompts filled both: ~4.5 MB
   per request on SmolLM2, towards gigabytes. ``cap_caches`` lowers both to
   ``CACHE_CAPACITY``: one step creates at most ~10 distinct shapes (its linears at one row
   count, the LM head, two attention matmuls) and reuses them over all its layers, and a
   steady decode batch keeps its linears' shapes from step to step; a past step's attention
   shapes never come back. It must run before the process's first oneDNN op (both capacities
   are read once): ``pantheon worker`` calls it first thing, before torch is imported. A
   positive value the operator set for either variable is kept (0, no cache at all, crashes
   torch's ideep here: it is replaced too).
2. **glibc's free heap.** Tensors of varying sizes leave freed pages in the heap that glibc
   keeps; the load itself leaves ~100 MB of them (the CPU path timing, the weights' staging).
   ``Trimmer`` calls ``malloc_trim(0)`` when the worker goes idle after work (at most every
   ``TRIM_EVERY_S``), every ``TRIM_BUSY_EVERY_S`` while it never goes idle (a trim takes
   ~10 ms on a 1 GB heap), and after a model is unloaded, as the router does for large bodies
   (``pantheon/api/middleware.py``). Without the busy trims a soak's RSS crept up by ~0.2 MB a
   request that an idle trim then gave back in one go.

``PANTHEON_DEBUG_MEMORY=SECONDS`` (a debug knob, not a setting): the worker starts
``tracemalloc`` and logs every SECONDS its RSS, anonymous RSS, the bytes Python allocated, and
the size of every per-request table (``Worker.owner``, each engine's samplers, constraints,
scheduler index and queue, grammar failures): what grows there is a Python leak, what grows
only in RSS is native.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays unimported until the worker has capped the caches
    from workers.engine import Engine

log = logging.getLogger("pantheon.worker")

CACHE_CAPACITY = 64  # oneDNN primitives / ideep computations kept per process
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
TRIM_EVERY_S = 5.0  # at most one malloc_trim per this many seconds when idle
TRIM_BUSY_EVERY_S = 30.0  # and one per this many while the work never stops
DEBUG_VARIABLE = "PANTHEON_DEBUG_MEMORY"


def cap_caches(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Cap oneDNN's two shape caches at ``CACHE_CAPACITY`` unless ``env`` already sets them;
    returns the values in force. Call before the process's first oneDNN op."""
    for name in CACHE_VARIABLES:
        value = env.get(name, "").strip()
        if not value.isdigit() or int(value) < 1:
            env[name] = str(CACHE_CAPACITY)
    return {name: env[name] for name in CACHE_VARIABLES}


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


class Trimmer:
    """``malloc_trim(0)`` once the worker is idle after work, at most every ``every_s``.

    The main loop calls ``worked(now)`` after a turn that stepped (which trims too when the
    last trim is ``busy_every_s`` old) and ``idle(now)`` on a turn that did not; a trim that is
    due but too soon after the last one happens on a later idle turn (the loop wakes at least
    once a second to send Stats)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, busy_every_s: float = TRIM_BUSY_EVERY_S):
        self.every_s, self.busy_every_s = every_s, busy_every_s
        self.fn = _malloc_trim()
        self.dirty = True  # the load left garbage too: trim on the first idle turn
        self.last = -1e9
        self.count = 0
        self.seconds = 0.0  # spent trimming, in all

    def worked(self, now: float) -> bool:
        """Note work done; trim if the last trim is ``busy_every_s`` old. True if it did."""
        self.dirty = True
        return self.fn is not None and now - self.last >= self.busy_every_s and self.trim(now)

    def idle(self, now: float) -> bool:
        """Trim if there was work since the last trim and it is not too soon; True if it did."""
        if not self.dirty or self.fn is None or now - self.last < self.every_s:
            return False
        return self.trim(now)

    def trim(self, now: float | None = None) -> bool:
        if self.fn is None:
            return False
        t0 = time.perf_counter()
        try:
            self.fn(0)
        except Exception:  # noqa: BLE001 - memory hygiene, never an error
            log.debug("malloc_trim failed", exc_info=True)
            return False
        self.seconds += time.perf_counter() - t0
        self.last = time.monotonic() if now is None else now
        self.dirty = False
        self.count += 1
        return True


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``RssFile`` of a process in bytes (empty off Linux)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def request_tables(owner: Mapping[str, str], engines: Mapping[str, Engine]) -> dict[str, int]:
    """The size of every table that holds something per request, the worker's and each
    engine's (``Engine.request_tables``): all 0 when no request runs."""
    sizes = {"owner": len(owner)}
    for name, e in engines.items():
        sizes.update({f"{name}.{k}": v for k, v in e.request_tables().items()})
    return sizes


class DebugReport:
    """``PANTHEON_DEBUG_MEMORY=SECONDS``: the log line described in the module docstring."""

    def __init__(self, every_s: float):
        import tracemalloc

        self.every_s = every_s
        self.next = 0.0
        tracemalloc.start()

    @classmethod
    def from_env(cls) -> DebugReport | None:
        raw = os.environ.get(DEBUG_VARIABLE, "").strip()
        try:
            every = float(raw) if raw else 0.0
        except ValueError:
            every = 0.0
        return cls(every) if every > 0 else None

    def due(self, now: float) -> bool:
        if now < self.next:
            return False
        self.next = now + self.every_s
        return True

    def report(self, tables: Mapping[str, int], trim: Trimmer) -> None:
        import tracemalloc

        mem = process_memory()
        traced, peak = tracemalloc.get_traced_memory()
        tables_text = " ".join(f"{k}={v}" for k, v in tables.items())
        log.info(
            "memory: rss %.1f MiB, anon %.1f MiB, file %.1f MiB, python %.1f MiB (peak %.1f), "
            "trims %d (%.3f s in all); tables %s",
            mem.get("VmRSS", 0) / 2**20,
            mem.get("RssAnon", 0) / 2**20,
            mem.get("RssFile", 0) / 2**20,
            traced / 2**20,
            peak / 2**20,
            trim.count,
            trim.seconds,
            tables_text,
        )
