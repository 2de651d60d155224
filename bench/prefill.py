"""Prefill speed against the prompt's length: our engine in-process and ``llama-bench -p``.

    python bench/prefill.py                          # SmolLM2-135M Q4_1 GGUF, 512 .. 8192 tokens
    python bench/prefill.py --model FILE.gguf --lengths 512,2048 --threads 2 [--no-peer] [--json OUT]

For each prompt length (random token ids in the vocabulary; the longest is clamped to the
model's context less one, so that one token can be generated), the engine is given the prompt
with ``max_tokens=1`` and stepped until it finishes. Each step's time and prefill tokens are
what the engine reports to its step budget (``Engine.budget.observe``). Printed per length:
prefill tokens/s (prompt tokens over the wall time of all the steps), the number of steps, the
mean and largest step time against the step target, the chunk sizes the budget chose, and
``llama-bench -p LEN -n 0`` tokens/s on the same file (its fastest repetition; skipped when
llama.cpp is not built, see bench/peer.py) with our ratio to it.

A ratio of tokens/s at 8k to tokens/s at 512 near 1 means prefill cost grows linearly with the
prompt; attention's own quadratic part makes it drift down slowly at these sizes.
One warm-up prefill runs first. On a shared host noise only slows a run down: compare figures
of one run, and prefer ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peer  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers.engine import Engine  # noqa: E402

LENGTHS = (512, 1024, 2048, 4096, 8192)


def default_model() -> str:
    from pantheon.serve import smollm2_file

    return str(smollm2_file())


def prefill_once(eng: Engine, prompt: list[int], rid: str) -> dict:
    """Prefill ``prompt`` (one generated token); per-step seconds and prefill tokens."""
    steps: list[tuple[int, float]] = []
    observe = eng.budget.observe

    def record(n_decode: int, n_prefill: int, seconds: float, *more: float) -> None:
        steps.append((n_prefill, seconds))
        observe(n_decode, n_prefill, seconds, *more)

    eng.budget.observe = record  # type: ignore[method-assign]
    try:
        eng.submit(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while eng.has_work():
            eng.step()
        wall = time.perf_counter() - t
    finally:
        eng.budget.observe = observe  # type: ignore[method-assign]
    times = [s for _n, s in steps]
    chunks = [n for n, _s in steps]
    return {
        "tokens": len(prompt),
        "wall_s": wall,
        "tok_s": len(prompt) / wall,
        "steps": len(steps),
        "step_mean_s": sum(times) / len(times),
        "step_max_s": max(times),
        "chunk_min": min(chunks),
        "chunk_max": max(chunks),
        "step_times": times,
        "chunks": chunks,
    }


def llama_bench_pp(gguf: str, threads: int, length: int, reps: int) -> float | None:
    bins = peer.find_bins()
    if bins is None:
        return None
    out = subprocess.run(
        [str(bins / "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(length), "-n", "0"]
        + ["-r", str(reps), "-o", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for rec in json.loads(out):
        if rec.get("n_prompt") == length and rec.get("n_gen") == 0:
            return float(max(rec.get("samples_ts") or [rec["avg_ts"]]))
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the engine's step ceiling")
    ap.add_argument("--step-target", type=float, default=None, help="seconds (engine default)")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench repetitions (fastest kept)")
    ap.add_argument("--no-peer", action="store_true", help="skip llama-bench")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--cached-tail",
        type=int,
        default=512,
        help="then the longest prompt again plus this many new tokens: its prefix is cached, "
        "so its first chunk starts deep (0: skip)",
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    kw = {} if args.step_target is None else {"step_target_s": args.step_target}
    eng = Engine(
        model,
        devices=["cpu"],
        dtype=args.dtype,
        num_slots=2,
        kv_budget_bytes=1 << 30,
        prefill_chunk=args.prefill_chunk,
        **kw,
        compile_decode=False,
    )
    vocab = eng.vocab_size
    cap = eng.max_model_len - 1
    rng = random.Random(0)
    print(
        f"file {model}\n{args.threads} threads, dtype {eng.dtype}, CPU path {getattr(eng, 'cpu_path', None)}, "
        f"step target "
        f"{eng.budget.target_s:.2f} s, chunk ceiling {args.prefill_chunk}, torch {torch.__version__}",
        flush=True,
    )
    prefill_once(eng, [rng.randrange(vocab) for _ in range(256)], "warm")
    rows = []
    print(
        f"{'tokens':>7} {'tok/s':>8} {'steps':>6} {'mean step s':>11} {'max step s':>10} "
        f"{'chunks':>9} {'llama-bench':>11} {'ratio':>6}",
        flush=True,
    )
    prompt: list[int] = []
    for i, n in enumerate(lengths):
        n = min(n, cap)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        r = prefill_once(eng, prompt, f"p{i}")
        lb = None if args.no_peer else llama_bench_pp(model, args.threads, n, args.reps)
        r["llama_bench_tok_s"] = lb
        rows.append(r)
        lbs = f"{lb:11.1f} {r['tok_s'] / lb:6.2f}" if lb else f"{'-':>11} {'-':>6}"
        print(
            f"{n:7d} {r['tok_s']:8.1f} {r['steps']:6d} {r['step_mean_s']:11.3f} {r['step_max_s']:10.3f} "
            f"{r['chunk_min']:>4}-{r['chunk_max']:<4} {lbs}",
            flush=True,
        )
    if len(rows) > 1:
        print(
            f"tokens/s at {rows[-1]['tokens']} over tokens/s at {rows[0]['tokens']}: "
            f"{rows[-1]['tok_s'] / rows[0]['tok_s']:.2f} (1.0 = linear cost in the prompt)"
        )
    if args.cached_tail and prompt:
        tail = [rng.randrange(vocab) for _ in range(args.cached_tail)]
        full = (prompt + tail)[:cap]
        r = prefill_once(eng, full, "tail")
        new = len(full) - len(prompt)
        print(
            f"the longest prompt again + {new} new tokens (its prefix cached): {r['steps']} steps, "
            f"first {r['step_times'][0]:.3f} s ({r['chunks'][0]} tokens at context {len(prompt)}), "
            f"max {r['step_max_s']:.3f} s against the {eng.budget.target_s:.2f} s target"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": model, "threads": args.threads, "rows": rows}, indent=1)
        )
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
