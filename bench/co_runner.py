"""What another process's CPU costs our decode step on a small host (issue 28 §3).

    python bench/co_runner.py                      # SmolLM2-135M Q4_1 GGUF, 2 threads, 128 steps
    python bench/co_runner.py --threads 1 --rounds 3

Over HTTP the router and the client wake once per token and run for a fraction of a
millisecond (``bench/http_path.py`` prints their CPU per token). On a 2-core host the worker's
two decode threads already fill both cores, so that CPU comes out of the step. This measures the
exchange rate without HTTP: our engine in-process at batch 1 (as ``http_path.py`` (a)) while a
separate process (spawned, not forked: a forked child would share the engine's pages
copy-on-write) busy-loops ``burn`` ms every ``period`` ms, for several patterns, rounds
alternating so that every pattern sees the same host. Printed per pattern: the step p50 and
mean, the step's extra ms over the no-co-runner rounds, the co-runner's own CPU ms per step
(its own CPU clock), and their ratio (ms of step lost per ms the co-runner ran).

A ratio near 1 means the co-runner's time is simply taken from the step (a descheduled thread
holds the other at the next barrier); above 1, each wake-up costs more than the CPU it uses
(cold caches, the preempted thread's lost progress); the "wake only" pattern (20 us of work)
isolates the cost of a wake-up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import default_gguf  # noqa: E402
from bench.http_path import engine, engine_steps, load  # noqa: E402
from bench.pantheon_server import host_line  # noqa: E402

# (name, burn ms, period ms): the router + client at one stream are ~0.5-0.7 ms of CPU a token
PATTERNS = (
    ("none", 0.0, 0.0),
    ("wake only: 0.02 ms every 5.3 ms", 0.02, 5.3),
    ("0.35 ms every 5.3 ms (router-like)", 0.35, 5.3),
    ("0.7 ms every 5.3 ms (router + client)", 0.7, 5.3),
    ("0.07 ms every 1.06 ms (same CPU, 5x the wake-ups)", 0.07, 1.06),
)


def burner(burn_ms: float, period_ms: float, ready, stop, cpu) -> None:
    """Busy-loop ``burn_ms`` every ``period_ms`` (wall clock) until ``stop`` is set; ``cpu``: its
    CPU seconds so far (the process's own clock, exact where /proc counts 10 ms ticks)."""
    burn, period = burn_ms / 1e3, period_ms / 1e3
    ready.set()
    nxt = time.perf_counter()
    while not stop.is_set():
        cpu.value = time.process_time()
        nxt += period
        t = time.perf_counter()
        while time.perf_counter() - t < burn:
            pass
        wait = nxt - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        else:
            nxt = time.perf_counter()


def run(eng, tokens: int, burn_ms: float, period_ms: float) -> tuple[list[float], float]:
    """One round: the steps' seconds, and the co-runner's CPU seconds during them."""
    if not burn_ms:
        return engine_steps(eng, tokens), 0.0
    ctx = mp.get_context("spawn")
    ready, stop, cpu = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0, lock=False)
    p = ctx.Process(target=burner, args=(burn_ms, period_ms, ready, stop, cpu), daemon=True)
    p.start()
    ready.wait(60)
    time.sleep(0.2)  # its first periods
    c0 = cpu.value
    steps = engine_steps(eng, tokens)
    used = cpu.value - c0
    stop.set()
    p.join(10)
    return steps, used


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file or model folder (default: SmolLM2-135M Q4_1 GGUF)")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_gguf()
    print(f"host: {host_line()}; model {model.name}; {args.threads} threads, batch 1, eager", flush=True)
    eng = engine(model, args.threads)
    steps: dict[str, list[float]] = {name: [] for name, _, _ in PATTERNS}
    used: dict[str, float] = dict.fromkeys(steps, 0.0)
    for _ in range(args.rounds):
        for name, burn, period in PATTERNS:
            s, u = run(eng, args.tokens, burn, period)
            steps[name] += s
            used[name] += u
    base = statistics.mean(steps["none"]) * 1e3
    for name, _, _ in PATTERNS:
        s = steps[name]
        mean = statistics.mean(s) * 1e3
        line = f"{name:<52} step p50 {statistics.median(s) * 1e3:5.2f} mean {mean:5.2f} ms"
        if name != "none":
            extra, ran = mean - base, used[name] * 1e3 / len(s)
            line += f"; {extra:+.2f} ms a step for {ran:.2f} ms of co-runner CPU"
            if ran > 0:
                line += f" ({extra / ran:.1f} ms lost per ms it ran)"
        print(line)
    print(f"[load {load()}]")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
