"""One Gated DeltaNet layer's recurrence on a CUDA die: flash-linear-attention's kernels
(``workers/kernels/fla_gdn.py``) against our torch functions (``workers/layers/gated_delta.py``).

    python bench/gdn_cuda.py            # cuda:0, Qwen3.5-0.8B's linear-attention heads
    python bench/gdn_cuda.py --quick    # fewer calls (a few seconds)

Prefill: one sequence's chunk of T tokens (``chunk``), ms and tokens/ms. Decode: one token of
B sequences from their states (``step``), ms and GB/s of state moved: each sequence's fp32
state [Hv, Dk, Dv] read once and written once at the least (the torch step makes ~5 passes).
Median of CUDA-event timings after warm-up (the kernels' compile and autotuning there); states
rotate over several sets so the L2 does not hold them. The last line, ``SUMMARY``, is what
``bench/gpu_check.py`` puts in its table. Without CUDA, or without ``fla``, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from workers.kernels import fla_gdn
from workers.layers.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_step

HK, HV, DK, DV = 16, 16, 128, 128  # Qwen3.5-0.8B's linear-attention heads


def timed(fn: Callable[[int], object], reps: int, sets: int) -> float:
    """Median ms of ``fn(i)`` (i: the input set) over ``reps`` calls, CUDA events."""
    for i in range(3):
        fn(i % sets)
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i % sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def inputs(
    lead: tuple[int, ...], state: tuple[int, ...], dev: torch.device, dt: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Fresh random (q, k, v, g, beta, state): q, k [*lead, HK, DK], v [*lead, HV, DV] in ``dt``;
    log decays g and betas [*lead, HV] fp32; fp32 states [*state, HV, DK, DV]. ``lead``: (T,)
    for one sequence's prefill, (B,) for a decode step; ``state``: () or (B,) to match."""
    return (
        torch.randn(*lead, HK, DK, device=dev, dtype=dt),
        torch.randn(*lead, HK, DK, device=dev, dtype=dt),
        torch.randn(*lead, HV, DV, device=dev, dtype=dt),
        -torch.rand(*lead, HV, device=dev) * 0.5,
        torch.rand(*lead, HV, device=dev),
        torch.randn(*state, HV, DK, DV, device=dev) * 0.1,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return 0
    dev = torch.device("cuda:0")
    probe = torch.zeros(1, device=dev)
    if not fla_gdn.available(probe):
        print("flash-linear-attention is not importable here (or PANTHEON_FLA=0): nothing to compare")
        print("SUMMARY fla not importable: the torch path serves")
        return 0
    reps = 10 if args.quick else 50
    dt = torch.bfloat16
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}, bf16, heads {HK}/{HV} x {DK}/{DV}")
    print(f"{'case':<22}{'torch ms':>10}{'fla ms':>10}{'speedup':>9}{'fla GB/s':>10}")
    summary = []
    for t in (512,) if args.quick else (512, 4096):
        sets = 2
        ins = [inputs((t,), (), dev, dt) for _ in range(sets)]
        ours = timed(lambda i, ins=ins: chunk_gated_delta_rule(*ins[i]), reps, sets)
        fla = timed(lambda i, ins=ins: fla_gdn.chunk(*ins[i]), reps, sets)
        print(f"{'prefill T=' + str(t):<22}{ours:>10.3f}{fla:>10.3f}{ours / fla:>8.2f}x{'':>10}")
        summary.append(f"prefill {t}: {ours / fla:.2f}x")
    for bsz in (1, 8, 64):
        state_bytes = bsz * HV * DK * DV * 4
        sets = max(2, (256 << 20) // (2 * state_bytes))  # ~256 MB of states over the sets
        sets = min(sets, 16)
        ins = [inputs((bsz,), (bsz,), dev, dt) for _ in range(sets)]
        ours = timed(lambda i, ins=ins: recurrent_gated_delta_step(*ins[i]), reps, sets)
        fla = timed(lambda i, ins=ins: fla_gdn.step(*ins[i]), reps, sets)
        gbs = 2 * state_bytes / (fla / 1e3) / 1e9
        print(f"{'decode B=' + str(bsz):<22}{ours:>10.3f}{fla:>10.3f}{ours / fla:>8.2f}x{gbs:>10.0f}")
        summary.append(f"decode {bsz}: {ours / fla:.2f}x")
    print("SUMMARY fla over torch: " + ", ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
