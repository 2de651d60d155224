"""One layer's decode attention, the native paged kernel against the torch path, same run.

    python bench/paged_kernel.py                        # SmolLM2-135M's heads (9 q, 3 KV, D 64)
    python bench/paged_kernel.py --depths 64,8192 --batches 1 --kinds bf16 --heads 32,8,128

Times ``decode_attention`` (``workers/layers/attention.py``) on a pool of ``--kinds`` rows
(bf16 / fp32 / q8_0 / q4_0), at each depth (context positions per sequence, distinct blocks per
sequence, shuffled in the pool) and batch, with ``PANTHEON_ATTN_KERNEL=0`` (the torch path:
the rows' gather, or block groups past ``DECODE_ROWS``) and with the kernel at 1 thread and at
``--threads``. Best of ``--reps`` calls, in ms, and the ratios torch / kernel.

``--threshold`` also times the kernel at small depths with its parallel region forced on and
off (``paged.MIN_PARALLEL``), the data behind that constant.

2026-12-05, 2-core Xeon (AVX-512, AMX; shared with other work, load 3.4), SmolLM2's heads, 16-row
blocks, ms per call, torch path / kernel at 2 threads: bf16 x1 depth 8192 2.06 / 0.77 (2.7x),
x8 12.6 / 7.2 (1.8x); q8_0 x1 2.87 / 0.53 (5.4x), x8 19.9 / 6.7 (3.0x); q4_0 x1 3.47 / 0.53
(6.5x), x8 25.1 / 6.1 (4.1x); at depth 2048 2.2x - 6.3x.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.kernels import paged  # noqa: E402
from workers.kernels.kv_quant import QuantRows  # noqa: E402
from workers.layers import attention as A  # noqa: E402


def batch(lens: list[int], bs: int, seed: int = 0) -> tuple[A.StepBatch, int]:
    g = torch.Generator().manual_seed(seed)
    nb = -(-max(lens) // bs)
    pool = len(lens) * nb + 1
    tab = (torch.randperm(pool - 1, generator=g) + 1)[: len(lens) * nb].view(len(lens), nb)
    t = max(lens)
    gather = (tab[:, :, None] * bs + torch.arange(bs)).view(len(lens), -1)[:, :t]
    b = A.StepBatch(
        torch.zeros(1), torch.zeros(1), torch.zeros(len(lens), dtype=torch.long), len(lens), gather, None, [],
        decode_blocks=tab, block_size=bs, decode_lens=torch.tensor(lens),
    )  # fmt: skip
    return b, pool * bs


def pools(kind: str, rows: int, kv: int, d: int):
    k, v = torch.randn(rows, kv, d), torch.randn(rows, kv, d)
    if kind in ("q8_0", "q4_0"):
        out = []
        for x in (k, v):
            c = QuantRows.empty(kind, rows, kv, d, torch.device("cpu"))
            c.write(torch.arange(rows), x)
            out.append(c)
        return out[0], out[1], torch.bfloat16
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[kind]
    return k.to(dt), v.to(dt), dt


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="9,3,64", help="H,KV,D")
    ap.add_argument("--kinds", default="bf16,q8_0,q4_0")
    ap.add_argument("--depths", default="64,512,2048,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threshold", action="store_true")
    args = ap.parse_args()
    h, kv, d = (int(x) for x in args.heads.split(","))
    bs = args.block_size
    print(f"kernel: {paged.status()}; load {os.getloadavg()[0]:.2f}", flush=True)
    for kind in args.kinds.split(","):
        for bsz in (int(x) for x in args.batches.split(",")):
            for depth in (int(x) for x in args.depths.split(",")):
                b, rows = batch([depth] * bsz, bs)
                kc, vc, dt = pools(kind, rows, kv, d)
                q = (torch.randn(bsz, h, d) * 0.3).to(dt)
                reps = args.reps if depth * bsz <= 4096 else max(3, args.reps // 4)

                call = functools.partial(A.decode_attention, q, b, kc, vc)
                torch.set_num_threads(args.threads)
                os.environ["PANTHEON_ATTN_KERNEL"] = "0"
                t_torch = best_ms(call, reps)
                os.environ["PANTHEON_ATTN_KERNEL"] = "1"
                t_k = best_ms(call, reps)
                torch.set_num_threads(1)
                t_k1 = best_ms(call, reps)
                torch.set_num_threads(args.threads)
                print(
                    f"  {kind:<5} x{bsz} depth {depth:>5}: torch {t_torch:8.3f} ms  kernel {t_k:7.3f} ms "
                    f"({args.threads} thr; 1 thr {t_k1:7.3f})  torch/kernel {t_torch / t_k:6.2f}x",
                    flush=True,
                )
    if args.threshold:
        print("parallel region on vs off (bf16, batch 1), ms:", flush=True)
        torch.set_num_threads(args.threads)
        keep = paged.MIN_PARALLEL
        for depth in (16, 64, 128, 256, 512, 1024, 2048):
            b, rows = batch([depth], bs)
            kc, vc, dt = pools("bf16", rows, kv, d)
            q = (torch.randn(1, h, d) * 0.3).to(dt)
            got = {}
            for name, lim in (("serial", 1 << 40), ("parallel", 0)):
                paged.MIN_PARALLEL = lim
                got[name] = best_ms(functools.partial(A.decode_attention, q, b, kc, vc), 200)
            print(
                f"  depth {depth:>5} (x{kv} KV heads = {depth * kv:>6}): serial {got['serial']:.4f}  "
                f"parallel {got['parallel']:.4f}",
                flush=True,
            )
        paged.MIN_PARALLEL = keep


if __name__ == "__main__":
    main()
