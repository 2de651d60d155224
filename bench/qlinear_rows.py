"""The quantized linear kernel with fp32 activations (the default numerics: ``int4`` and ``int8``
paths) against the row count: one model's linears per decode step at 1, 2, 4 and 8 rows.

    python bench/qlinear_rows.py                      # Qwen3.5-0.8B's and SmolLM2-135M's linears
    python bench/qlinear_rows.py --rows 1,4,8,16 --rounds 7
    PYTHONPATH=/other/tree python bench/qlinear_rows.py   # another tree's kernel, for a before/after

Per model shape set (the linears of every layer, distinct weights so a pass reads them from
memory as a step does, and the LM head), each kernel (``q4_linear`` / ``q8_linear`` with
``acts="fp32"``: int4 groups or int8 rows against fp32 activations), ms for the whole pass at each
row count (best of ``--rounds``), and ms per row. A decode step at B streams is that pass at B rows,
so the ms per row at 8 rows against 1 is how much batching buys. Random weights: the kernel's time
does not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from workers.kernels import qlinear  # noqa: E402
from workers.quant import int8_rows, q4_groups  # noqa: E402

# (name, layers, [(out, in) per linear of a layer], head (out, in))
MODELS = {
    # Qwen3.5-0.8B: 18 linear-attention layers (in_proj 8224 x 1024, out_proj 1024 x 2048) and 6
    # full-attention ones (qkv 6144 x 1024, o 1024 x 2048), each with an MLP of 3584; vocab 248320
    "qwen3.5-0.8b": (
        [
            (18, [(8224, 1024), (1024, 2048)]),
            (6, [(6144, 1024), (1024, 2048)]),
            (24, [(7168, 1024), (1024, 3584)]),
        ],
        (248320, 1024),
    ),
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads x 64 (3 KV), MLP 1536; vocab 49152
    "smollm2-135m": ([(30, [(960, 576), (576, 576), (3072, 576), (576, 1536)])], (49152, 576)),
}


def _pass_ms(calls: list, x_of: dict[int, torch.Tensor], rounds: int) -> float:
    for fn, k in calls:  # warm: every weight once
        fn(x_of[k])
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for fn, k in calls:
            fn(x_of[k])
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not qlinear.available():
        print("the kernel is not built here", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"tree {os.environ.get('PYTHONPATH', '(this)')}  kernel {qlinear.isa()}  threads {args.threads}"
        f"  load {os.getloadavg()[0]:.2f}"
    )
    torch.manual_seed(0)
    for name in args.models.split(","):
        groups, head = MODELS[name]
        shapes = [s for n, layer in groups for _ in range(n) for s in layer] + [head]
        print(f"\n{name}: {len(shapes)} linears, {sum(o * i for o, i in shapes) / 1e6:.0f} M weights")
        print("| kernel | " + " | ".join(f"{r} rows ms (per row)" for r in rows) + " |")
        print("|---|" + "---:|" * len(rows))
        for kind in ("int8", "int4"):
            calls = []
            for o, i in shapes:
                w = torch.randn(o, i) * 0.02
                if kind == "int8":
                    q, s = int8_rows(w)
                    calls.append((lambda x, q=q, s=s: qlinear.q8_linear(x, q, s, acts="fp32"), i))
                else:
                    qs, dm = q4_groups(w)
                    calls.append((lambda x, qs=qs, dm=dm: qlinear.q4_linear(x, qs, dm, acts="fp32"), i))
            cells = []
            for r in rows:
                x_of = {k: torch.randn(r, k) for k in {i for _, i in shapes}}
                ms = _pass_ms(calls, x_of, args.rounds)
                cells.append(f"{ms:.2f} ({ms / r:.2f})")
            print(f"| {kind} x fp32 | " + " | ".join(cells) + " |")
            del calls
    return 0


if __name__ == "__main__":
    sys.exit(main())
