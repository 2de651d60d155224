"""The quantized linear kernel (``workers/kernels/qmatmul.c``) against torch's int4 / int8 CPU
kernels, per call and over a whole model's pass (issue 28 §2).

    python bench/qlinear.py                       # SmolLM2-135M's shapes
    python bench/qlinear.py --rows 1,2,4,8,16 --reps 200

Per shape and row count: ms per call, ours (int4 groups / int8 rows times int8 activations,
integer dot products) against torch's (``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``,
bf16 activations), each the best of ``--rounds``. A single shape called again and again sits in
L2; a decode step reads every layer's weights once, so "model pass" times the 120 linears of 30
SmolLM2 layers (distinct weights, as a step reads them) and then with the int8 LM head as well
(~95 MB together, more than a core's caches hold), at one row.

Both layouts are built from the same float weights; the int4 ones hold the same 4-bit levels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from workers.kernels import qlinear  # noqa: E402
from workers.quant import Int4Linear, Int8Linear  # noqa: E402

# SmolLM2-135M: hidden 576, 9 heads x 64 (3 KV heads), MLP 1536, vocab 49152
LAYER = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
HEAD = ("head", 49152, 576)


def _best(fn: Callable[[], object], reps: int, rounds: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def _pair(kind: str, n: int, k: int, g: torch.Generator, ours: bool) -> torch.nn.Module:
    os.environ["PANTHEON_LINEAR_KERNEL"] = "1" if ours else "0"
    w = torch.randn(n, k, generator=g) * 0.05
    return Int4Linear(w, None) if kind == "int4" else Int8Linear(w.bfloat16(), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not qlinear.available():
        print(f"the kernel is not here: {qlinear.describe()}", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    print(f"kernel: {qlinear.describe()}; torch {torch.__version__}, {args.threads} threads")
    g = torch.Generator().manual_seed(0)
    bf = qlinear.has_bf16()
    print("\n(ours: int8 / fp32 / bf16 activations (bf16: AVX512_BF16 only); torch: bf16 activations)")
    print("\n| layer | layout | rows | ours int8 ms | ours fp32 ms | ours bf16 ms | torch ms | fp32 / int8 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, n, k in [*LAYER, HEAD]:
        kind = "int8" if name == "head" else "int4"
        ours, theirs = _pair(kind, n, k, g, True), _pair(kind, n, k, g, False)
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            reps = max(10, args.reps // m // (8 if name == "head" else 1))
            if isinstance(ours, Int4Linear):
                w, s, xf = ours.weight, ours.scales_mins, x.float()
                a = _best(lambda: qlinear.q4_linear(x, w, s, acts="int8"), reps, args.rounds)  # noqa: B023
                af = _best(lambda: qlinear.q4_linear(xf, w, s, acts="fp32"), reps, args.rounds)  # noqa: B023
                a2 = _best(lambda: qlinear.q4_linear(x, w, s, acts="bf16"), reps, args.rounds) if bf else None  # noqa: B023
            else:
                a, af, a2 = _best(lambda: ours(x), reps, args.rounds), None, None  # noqa: B023 - called at once
            b = _best(lambda: theirs(x), reps, args.rounds)  # noqa: B023
            cf, rf = ("-", "-") if af is None else (f"{af:.4f}", f"{af / a:.2f}x")
            c2 = "-" if a2 is None else f"{a2:.4f}"
            print(f"| {name} [{n}, {k}] | {kind} | {m} | {a:.4f} | {cf} | {c2} | {b:.4f} | {rf} |")
    # a model's pass at one row: every layer's weights once, then the head
    layers = {True: [], False: []}
    for _ in range(30):
        for _name, n, k in LAYER:
            for ours in (True, False):
                layers[ours].append((k, _pair("int4", n, k, g, ours)))
    head = {ours: _pair("int8", HEAD[1], HEAD[2], g, ours) for ours in (True, False)}
    xs = {k: torch.randn(1, k, generator=g).bfloat16() for k in (576, 1536)}

    def run(ours: bool, with_head: bool) -> None:
        for k, lin in layers[ours]:
            lin(xs[k])
        if with_head:
            head[ours](xs[576])

    print(
        "\n| model pass, 1 row | activations | ours ms | torch ms | torch / ours |\n|---|---|---:|---:|---:|"
    )
    for acts in ("int8", "fp32", "bf16") if bf else ("int8", "fp32"):
        os.environ["PANTHEON_LINEAR_ACTIVATIONS"] = acts
        qlinear.activations.cache_clear()
        for with_head in (False, True):
            a = _best(lambda: run(True, with_head), 20, args.rounds)  # noqa: B023
            b = _best(lambda: run(False, with_head), 20, args.rounds)  # noqa: B023
            what = "30 layers + head" if with_head else "30 layers (120 linears)"
            print(f"| {what} | {acts} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    print(f"\nload {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
