"""One layer's attention on a CUDA die: the Triton paged kernels against the torch paths, decode
and prefill.

    python bench/attention_cuda.py                  # cuda:0: Llama-3.1-8B's and SmolLM2's heads
    python bench/attention_cuda.py --quick          # fewer shapes and calls (under 20 s)
    TRITON_INTERPRET=1 python bench/attention_cuda.py --device cpu --quick   # the script itself

Times ``workers/kernels/paged_triton.py``'s ``paged_decode`` and the torch path it replaces
(``attention.decode_attention`` with ``PANTHEON_ATTN_KERNEL=0``: the rows' gather then matmul /
softmax / matmul, or block groups past ``DECODE_ROWS`` rows, the column ``path`` says which)
on bf16 pools, 16-row blocks shuffled in the pool, every row at the given context. Each call
gets the next of several input sets (pools, tables, queries) whose bytes together are several
times the L2 (50-60 MB on an H100 / H200), so no call finds the previous one's K/V in it.
Median of ``--reps`` calls after warm-up (the kernels' compile included there), CUDA events.
GB/s: the K and V bytes the rows attend to (B x context x KV x D x 2 x 2) over the time.

Prefill rows (``--prompt``, 4096 tokens in chunks of ``--chunk``, 512): each chunk of the prompt
as one step's only chunk, after the chunks before it (its history in the pool), through
``attention.paged_attention`` (the layer's whole call, its K/V write included) with the kernel
(``paged_prefill``; the step's tiles cut beforehand, as the step's first layer does for the
others) and without (``PANTHEON_ATTN_KERNEL=0``: the gather of every position and SDPA,
offset-causal after history). TFLOP/s: the causal scores and values' products the chunk needs
(4 x H x D x (C x p0 + C (C + 1) / 2)) over the time.

Without a CUDA device it says so and exits 0. ``--device cpu`` runs tiny shapes through
Triton's interpreter (``TRITON_INTERPRET=1``, set here when absent), wall-clock: a check of the
script, not a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from workers.kernels import paged_triton as PT
from workers.layers import attention as A

HEADS = {"llama-3.1-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # (q heads, KV heads, D)
L2_BYTES = 60 << 20
ROTATE_BYTES = 4 * L2_BYTES  # an input set is reused only after this many bytes of others
MAX_SETS = 64
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, A.StepBatch]  # q, K pool, V pool, batch


def make_set(bsz: int, ctx: int, kv: int, h: int, d: int, bs: int, dev: torch.device, seed: int) -> Inputs:
    """(q, K pool, V pool, StepBatch) for ``bsz`` rows of ``ctx`` positions over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // bs)
    pool = bsz * nb + 1
    tab = (torch.randperm(pool - 1, generator=g) + 1)[: bsz * nb].view(bsz, nb)
    gather = (tab[:, :, None] * bs + torch.arange(bs)).view(bsz, -1)[:, :ctx]
    b = A.StepBatch(
        torch.zeros(1), torch.zeros(1), torch.zeros(bsz, dtype=torch.long), bsz, gather, None, [],
        decode_blocks=tab, block_size=bs, decode_lens=torch.full((bsz,), ctx, dtype=torch.long),
    ).to(dev)  # fmt: skip
    kc = torch.randn(pool * bs, kv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(pool * bs, kv, d, device=dev, dtype=torch.bfloat16)
    q = (torch.randn(bsz, h, d, device=dev) * d**-0.5).bfloat16()
    return q, kc, vc, b


def timed(fn: Callable[[int], object], n_sets: int, reps: int, warm: int, dev: torch.device) -> float:
    """Median ms of ``fn(i)`` over ``reps`` calls, each on the next input set."""
    for i in range(warm):
        fn(i % n_sets)
    if dev.type != "cuda":
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(dev)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for i, (e0, e1) in enumerate(events):
        e0.record()
        fn(i % n_sets)
        e1.record()
    torch.cuda.synchronize(dev)
    return statistics.median(e0.elapsed_time(e1) for e0, e1 in events)


def torch_path(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: A.StepBatch) -> torch.Tensor:
    os.environ["PANTHEON_ATTN_KERNEL"] = "0"
    try:
        return A.decode_attention(q, b, kc, vc)
    finally:
        os.environ.pop("PANTHEON_ATTN_KERNEL")


def measure(sets: list[Inputs], args: argparse.Namespace, dev: torch.device) -> tuple[float, float, float]:
    """(torch path ms, kernel ms, the largest difference of their outputs) over ``sets``."""

    def kern(i: int) -> torch.Tensor:
        q, kc, vc, b = sets[i]
        assert b.decode_blocks is not None and b.decode_lens is not None
        return PT.paged_decode(q, kc, vc, b.decode_blocks, b.decode_lens, b.block_size)

    def ref(i: int) -> torch.Tensor:
        q, kc, vc, b = sets[i]
        return torch_path(q, kc, vc, b)

    err = (kern(0).float() - ref(0).float()).abs().max().item()
    t_ref = timed(ref, len(sets), args.reps, args.warmup, dev)
    t_kern = timed(kern, len(sets), args.reps, args.warmup, dev)
    return t_ref, t_kern, err


# the kernels' speedups over the torch path, by kind: the SUMMARY line (bench/gpu_check.py's table)
SPEEDUPS: dict[str, list[float]] = {"decode": [], "prefill": []}


def summary() -> str:
    """``SUMMARY`` and each kind's least / geometric mean / greatest speedup over torch."""
    parts = []
    for kind, xs in SPEEDUPS.items():
        if xs:
            geo = statistics.geometric_mean(xs)
            parts.append(f"{kind} {min(xs):.2f}x / {geo:.2f}x / {max(xs):.2f}x")
    return "SUMMARY triton over torch (least / geomean / most): " + ", ".join(parts)


def run(args: argparse.Namespace, dev: torch.device) -> None:
    cpu = dev.type == "cpu"
    if cpu:
        heads = {"tiny": (4, 2, 64)}
        batches, contexts = [1, 2], [64, 300]
    else:
        heads = {k: HEADS[k] for k in args.heads.split(",")}
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
    print(
        f"device: {torch.cuda.get_device_name(dev) if not cpu else 'cpu (Triton interpreter)'}; {PT.describe()}"
    )
    print(f"{'heads':>13} {'B':>3} {'context':>7} {'path':>6} {'torch ms':>9} {'triton ms':>9} "
          f"{'torch GB/s':>10} {'triton GB/s':>11} {'speedup':>7} {'max err':>8}")  # fmt: skip
    for name, (h, kv, d) in heads.items():
        for bsz in batches:
            for ctx in contexts:
                kv_bytes = bsz * ctx * kv * d * 2 * 2  # K and V, bf16
                n_sets = 1 if cpu else max(1, min(MAX_SETS, -(-ROTATE_BYTES // kv_bytes)))
                sets = [make_set(bsz, ctx, kv, h, d, args.block_size, dev, seed=i) for i in range(n_sets)]
                q, kc, vc, b = sets[0]
                assert b.decode_blocks is not None and b.decode_lens is not None
                assert PT.reads(q, kc, vc)
                per = max(1, A.DECODE_ROWS // (bsz * args.block_size))
                path = "rows" if b.decode_blocks.shape[1] <= per else "groups"

                t_ref, t_kern, err = measure(sets, args, dev)
                del sets, q, kc, vc, b  # (a 16k context at batch 64 is 4 GB of pool)
                gb_ref, gb_kern = kv_bytes / (t_ref * 1e6), kv_bytes / (t_kern * 1e6)
                SPEEDUPS["decode"].append(t_ref / t_kern)
                print(f"{name:>13} {bsz:>3} {ctx:>7} {path:>6} {t_ref:>9.3f} {t_kern:>9.3f} "
                      f"{gb_ref:>10.0f} {gb_kern:>11.0f} {t_ref / t_kern:>6.2f}x {err:>8.1e}", flush=True)  # fmt: skip
                if not cpu:
                    torch.cuda.empty_cache()


def prefill_step(
    p0: int, n: int, h: int, kv: int, d: int, bs: int, dev: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, A.StepBatch]:
    """(q, k, v, K pool, V pool, batch) of one prefill chunk of ``n`` positions after ``p0``, its
    blocks shuffled in a bf16 pool that holds its history; the batch carries the block ids."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-(p0 + n) // bs)
    tab = torch.randperm(nb + 1, generator=g)[:nb] + 1  # blocks 1 .. nb + 1 (block 0 unused)
    pos = torch.arange(p0 + n)
    gather = tab[pos // bs] * bs + pos % bs
    chunk = A.PrefillChunk(0, n, gather.to(dev), None, blocks=tab)
    b = A.StepBatch(
        torch.zeros(1), torch.zeros(1), gather[p0:].to(dev), 0, None, None, [chunk], block_size=bs,
    )  # fmt: skip
    kc = torch.randn((nb + 2) * bs, kv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = (torch.randn(n, h, d, device=dev) * d**-0.5).bfloat16()
    k = torch.randn(n, kv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return q, k, v, kc, vc, b


def measure_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    b: A.StepBatch,
    args: argparse.Namespace,
    dev: torch.device,
) -> tuple[float, float, float]:
    """(torch path ms, kernel ms, the largest difference of their outputs) of one chunk's step."""
    c = b.prefills[0]
    plain = A.StepBatch(
        b.rot_cos, b.rot_sin, b.slot_mapping, 0, None, None,
        [A.PrefillChunk(c.start, c.end, c.gather, None)], block_size=b.block_size,
    )  # fmt: skip

    def kern(_i: int) -> torch.Tensor:
        return A.paged_attention(q, k, v, b, kc, vc)

    def ref(_i: int) -> torch.Tensor:
        # (its offset-causal mask built by the first call and kept, as a step's first layer
        # builds it for the others; so are the kernel's tiles)
        os.environ["PANTHEON_ATTN_KERNEL"] = "0"
        try:
            return A.paged_attention(q, k, v, plain, kc, vc)
        finally:
            os.environ.pop("PANTHEON_ATTN_KERNEL")

    err = (kern(0).float() - ref(0).float()).abs().max().item()
    assert b.prefill_tiles, "the kernel did not run"
    return timed(ref, 1, args.reps, args.warmup, dev), timed(kern, 1, args.reps, args.warmup, dev), err


def run_prefill(args: argparse.Namespace, dev: torch.device) -> None:
    cpu = dev.type == "cpu"
    heads = {"tiny": (4, 2, 64)} if cpu else {k: HEADS[k] for k in args.heads.split(",")}
    prompt, chunk = (300, 128) if cpu else (args.prompt, args.chunk)
    print(f"\nprefill: a {prompt}-token prompt in chunks of {chunk}, bf16, blocks of {args.block_size}")
    print(f"{'heads':>13} {'p0':>6} {'C':>5} {'torch ms':>9} {'triton ms':>9} "
          f"{'torch TF/s':>10} {'triton TF/s':>11} {'speedup':>7} {'max err':>8}")  # fmt: skip
    for name, (h, kv, d) in heads.items():
        for p0 in range(0, prompt, chunk):
            n = min(chunk, prompt - p0)
            q, k, v, kc, vc, b = prefill_step(p0, n, h, kv, d, args.block_size, dev, seed=p0)
            t_ref, t_kern, err = measure_prefill(q, k, v, kc, vc, b, args, dev)
            flop = 4 * h * d * (n * p0 + n * (n + 1) / 2)
            SPEEDUPS["prefill"].append(t_ref / t_kern)
            print(f"{name:>13} {p0:>6} {n:>5} {t_ref:>9.3f} {t_kern:>9.3f} {flop / (t_ref * 1e9):>10.1f} "
                  f"{flop / (t_kern * 1e9):>11.1f} {t_ref / t_kern:>6.2f}x {err:>8.1e}", flush=True)  # fmt: skip
            del q, k, v, kc, vc, b
        if not cpu:
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and calls (under 20 s)")
    ap.add_argument("--heads", default=",".join(HEADS), help=f"of {', '.join(HEADS)}")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=4096, help="prefill rows: the prompt's tokens (0: none)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill rows: tokens per chunk")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to time (--device cpu runs the script through Triton's interpreter)")
        return 0
    if dev.type == "cpu":
        # before triton's first import: triton.jit reads it when it decorates
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.reps, args.warmup = 2, 1
    if not PT.available():
        print(f"the Triton kernel is unavailable: {PT.describe()}")
        return 0
    if dev.type == "cpu":
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers.triton_interp import fix  # pyright: ignore[reportMissingImports]  (tests/helpers)

        fix()
    elif args.quick:
        args.batches, args.contexts, args.reps, args.warmup = "1,32", "512,4096", 20, 3
    run(args, dev)
    if args.prompt > 0:
        run_prefill(args, dev)
    print(summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
