"""What ``qmatmul.c``'s MXFP4 kernel computes, in float64: the dequantized weight
(``workers.mxfp4.dequantize_held``, exact) times the activations as they are (fp32, or bf16
widened). Only the order of the kernel's fp32 sums differs, so a kernel that reads one nibble or
exponent from the wrong place is off by the order of the outputs, and a right one by ~1e-6.

``check()`` runs the built kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) over shapes that
reach its tiles' edges, with codes and exponents spanning the whole format (every code, negative
zero, exponents 0 (subnormal scales) to 252), and returns its worst error relative to each
output's scale, and whether each row is the same bit for bit alone, batched, and on one thread.
The kernel tests run it in a subprocess per ISA.
"""

from __future__ import annotations

import torch

from workers.kernels import qlinear
from workers.mxfp4 import dequantize_held

# K: 1 block, 3, 90 (gpt-oss-20b's 2880); N: not a multiple of the tile's 4 columns nor of a
# thread's 16; M: 1..8 rows (tiles of 4 rows on AVX-512, pairs, one alone)
SHAPES = [(32, 16), (96, 37), (2880, 50)]
ROWS = [1, 2, 3, 5, 8]


def blocks(
    n: int, k: int, g: torch.Generator, lo: int = 100, hi: int = 140
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (all 16) and exponents in [lo, hi): (qs [N, K/2], e [N, K/32]) uint8."""
    qs = torch.randint(0, 256, (n, k // 2), generator=g).to(torch.uint8)
    e = torch.randint(lo, hi, (n, k // 32), generator=g).to(torch.uint8)
    return qs, e


def ref(x: torch.Tensor, qs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (MXFP4 qs, e)^T -> [M, N] float64 (the weights exact in fp32 first: every
    exponent ``check`` draws keeps them finite)."""
    return x.double() @ dequantize_held(qs, e, torch.float64).t()


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the outputs' largest magnitude; a bf16 output is the sum
    rounded to 8 significant bits, off by at most 2^-8 of itself, not counted."""
    if not bool(torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    off = (got.double() - want).abs()
    if got.dtype == torch.bfloat16:
        off = (off - want.abs() * 2**-8).clamp(min=0)
    return float(off.max() / want.abs().max().clamp(min=1e-300))


def check() -> dict[str, float | bool | str]:
    g = torch.Generator().manual_seed(0)
    err = 0.0
    same = True
    for k, n in SHAPES:
        qs, e = blocks(n, k, g)
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=g) * 2).to(dtype)
                got = qlinear.mxfp4_linear(x, qs, e)
                assert got.dtype == dtype and got.shape == (m, n)
                err = max(err, worst(got, ref(x, qs, e)))
                for i in range(m):  # each row alone is the batched row bit for bit
                    same &= torch.equal(qlinear.mxfp4_linear(x[i : i + 1], qs, e), got[i : i + 1])
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                same &= torch.equal(qlinear.mxfp4_linear(x, qs, e), got)
                torch.set_num_threads(threads)
    # the format's ends: exponents 0 and 1 (subnormal half scales) and up to 252 (the largest
    # whose weights are all finite in fp32: 6 * 2^125), against activations that keep the
    # products finite
    for lo, hi, scale in ((0, 8, 2.0**100), (240, 253, 2.0**-100)):
        qs, e = blocks(8, 64, g, lo, hi)
        x = torch.randn(3, 64, generator=g) * scale
        err = max(err, worst(qlinear.mxfp4_linear(x, qs, e), ref(x, qs, e)))
    return {"isa": qlinear.isa(), "worst": err, "same": same}
