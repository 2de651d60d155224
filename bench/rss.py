"""Resident memory of a running ``pantheon serve``: the router's and each worker's, sampled over time.

Used by ``bench/soak.py``. The router is the process the bench started; the workers' pids come
from ``GET /admin/dies`` at every sample (a restarted worker has a new pid). Each sample reads
``/proc/<pid>/status``: ``VmRSS`` (all resident pages) and ``RssAnon`` (the heap, tensors and
arenas: the part that grows when something leaks; ``RssFile`` is mapped files such as a GGUF's
weights and shared libraries, which the kernel can drop and re-read).

Growth per 1000 requests is the least-squares slope of RSS against requests finished, over
the samples after the warm-up (the first ``warmup`` share of the run: one-off costs such as
oneDNN's kernels for new shapes, llguidance's tokenizer and the first grammars land there).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MIB = 1 << 20


@dataclass(frozen=True)
class Mem:
    rss: int  # bytes resident (VmRSS)
    anon: int  # of which anonymous (RssAnon)


@dataclass
class Sample:
    t: float  # seconds since the soak began
    requests: int  # requests finished by then
    router: Mem | None
    workers: dict[str, Mem] = field(default_factory=dict)  # die id -> its worker's memory


def read_mem(pid: int) -> Mem | None:
    """``VmRSS`` and ``RssAnon`` of ``pid`` in bytes; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            kb[key] = int(rest.split()[0])
    if "VmRSS" not in kb:
        return None  # a zombie has no memory lines
    return Mem(kb["VmRSS"] * 1024, kb.get("RssAnon", kb["VmRSS"]) * 1024)


def worker_pids(url: str) -> dict[str, int]:
    """Die id -> worker pid, for the dies whose worker runs."""
    dies = httpx.get(url + "/admin/dies", timeout=10).json()["data"]
    return {d["die"]: d["pid"] for d in dies if d.get("pid") and d.get("alive")}


def take(t: float, requests: int, router_pid: int, pids: dict[str, int]) -> Sample:
    workers = {die: m for die, pid in pids.items() if (m := read_mem(pid)) is not None}
    return Sample(t, requests, read_mem(router_pid), workers)


class Sampler:
    """Samples every ``every`` seconds while ``run`` is awaited; ``count()`` says how many
    requests have finished so far."""

    def __init__(self, url: str, router_pid: int, every: float, count):
        self.url, self.router_pid, self.every, self.count = url, router_pid, every, count
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()

    async def sample(self, keep: bool = True) -> Sample:
        try:
            pids = await asyncio.to_thread(worker_pids, self.url)
        except (httpx.HTTPError, ValueError, KeyError):
            pids = {}
        s = take(time.monotonic() - self.t0, self.count(), self.router_pid, pids)
        if keep:
            self.samples.append(s)
        return s

    async def run(self, stop_at: float) -> None:
        self.t0 = time.monotonic()
        while time.monotonic() < stop_at:
            await self.sample()
            await asyncio.sleep(min(self.every, max(0.0, stop_at - time.monotonic())))


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def growth_per_1000(samples: list[Sample], pick, warmup: float = 1 / 3) -> float | None:
    """Bytes per 1000 finished requests of ``pick(sample)`` (a Mem or None) after the warm-up."""
    if not samples:
        return None
    end = samples[-1].t
    pts = [(s.requests, m) for s in samples if s.t >= warmup * end and (m := pick(s)) is not None]
    if len(pts) < 2:
        return None
    return 1000 * slope([float(r) for r, _ in pts], [float(m) for _, m in pts])


def dies_of(samples: list[Sample]) -> list[str]:
    return sorted({d for s in samples for d in s.workers})


def table(samples: list[Sample], warmup: float = 1 / 3, idle: Sample | None = None) -> str:
    """RSS over time, in MiB (RssAnon in brackets), then ``idle`` (a sample once the load is
    over, left out of the fit), then the growth per 1000 requests."""
    dies = dies_of(samples)
    head = f"{'t s':>6} {'requests':>8}  {'router MiB':>16}" + "".join(f"  {d + ' MiB':>16}" for d in dies)
    lines = [head]

    def cell(m: Mem | None) -> str:
        return f"{m.rss / MIB:7.0f} ({m.anon / MIB:6.0f})" if m is not None else f"{'-':>16}"

    for s in samples:
        row = f"{s.t:6.0f} {s.requests:8d}  {cell(s.router)}"
        row += "".join(f"  {cell(s.workers.get(d))}" for d in dies)
        lines.append(row)
    if idle is not None:
        row = f"{'idle':>6} {idle.requests:8d}  {cell(idle.router)}"
        row += "".join(f"  {cell(idle.workers.get(d))}" for d in dies)
        lines.append(row)

    def per_k(pick) -> str:
        g = growth_per_1000(samples, pick, warmup)
        return f"{g / MIB:+16.1f}" if g is not None else f"{'-':>16}"

    grow = f"{'':>6} {'/1000 req':>8}  " + per_k(lambda s: s.router.rss if s.router else None)
    grow += "".join(f"  {per_k(lambda s, d=d: s.workers[d].rss if d in s.workers else None)}" for d in dies)
    anon = f"{'':>6} {'anon':>8}  " + per_k(lambda s: s.router.anon if s.router else None)
    anon += "".join(f"  {per_k(lambda s, d=d: s.workers[d].anon if d in s.workers else None)}" for d in dies)
    lines += [grow, anon]
    return "\n".join(lines)
