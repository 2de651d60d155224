"""What ``workers/kernels/qmatmul.c`` computes, in torch, from the same integers: activations
quantized per group of 32 (scale absmax / 127, round half to even), integer dot products per
group, float scales after; or the activations as they are (fp32) or rounded to bf16 against the
dequantized weights, in float64. Only the order of the float sums differs from the kernel's, so a
kernel that reads one byte from the wrong place is off by the order of the outputs, and one
that is right by ~1e-6 of them.

``check()`` runs the built kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) over shapes
that reach each of its code paths and returns its worst relative error and whether each row's
output is the same bit for bit alone, batched, and on one or two threads. The kernel tests run
it in a subprocess per ISA.
"""

from __future__ import annotations

import torch

from workers.kernels import qlinear
from workers.quant import q4_groups

# K: 18 groups (blocks of 4, then a pair), 3 (a pair and one alone), 1, 5 (a block and one
# alone), 48; N: not a multiple of the tile's 4 columns nor of a thread's 16; M: rows in tiles
# of every size (the fp32 kernels' fours on AVX-512, then a pair, then one alone: 7 = 4 + 2 + 1)
SHAPES = [(576, 50), (96, 37), (32, 16), (160, 64), (1536, 24)]
ROWS = [1, 2, 3, 4, 5, 7, 9]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (levels [M, G, 32] int64, scales [M, G], sums [M, G]) as the kernel makes them."""
    m, k = x.shape
    v = x.float().reshape(m, k // 32, 32)
    amax = v.abs().amax(dim=2)
    # a tensor divided by a tensor: ``127.0 / amax`` is a reciprocal times 127 in torch, one
    # rounding more than the kernel's division, which moves ties (63.5) by a level
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(v * inv[..., None]).long(), amax / 127.0, v.sum(dim=2)


def levels(qs: torch.Tensor) -> torch.Tensor:
    """int4 groups qs [N, K/2] -> their levels [N, G, 32] float64 (byte j: level j low, j + 16 high)."""
    b = qs.long().reshape(qs.shape[0], -1, 16)
    return torch.cat([b & 15, b >> 4], dim=2).double()


def q4_ref(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (int4 groups qs [N, K/2], dm [N, 2, G])^T -> [M, N] fp32 (float64 sums)."""
    xq, xd, xs = quantize(x)
    dots = torch.einsum("mgi,ngi->mng", xq.double(), levels(qs))  # exact integers
    d, mn = dm[:, 0].double(), dm[:, 1].double()  # [N, G]
    y = (dots * (d[None] * xd.double()[:, None])).sum(-1) + (mn[None] * xs.double()[:, None]).sum(-1)
    return y.float()


def q4_ref_float(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight against the activations as ``dtype`` holds them (no int8 step): what the
    fp32 kernel (``dtype`` fp32: x as it is) and the AVX512_BF16 one (bf16) compute, in float64."""
    w = (dm[:, 1].double()[..., None] + levels(qs) * dm[:, 0].double()[..., None]).reshape(qs.shape[0], -1)
    return (x.to(dtype).double() @ w.t()).float()


def q8_ref(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (int8 rows w [N, K] times ws [N])^T -> [M, N] fp32."""
    xq, xd, _ = quantize(x)
    n, k = w.shape
    dots = torch.einsum("mgi,ngi->mng", xq.double(), w.reshape(n, k // 32, 32).double())
    return ((dots * xd.double()[:, None]).sum(-1) * ws.double()[None]).float()


def q8_ref_float(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """x [M, K] as it is @ (int8 rows w [N, K] times ws [N])^T -> [M, N] fp32 (float64 sums)."""
    return ((x.double() @ w.double().t()) * ws.double()[None]).float()


def check() -> dict[str, float | bool | str]:
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    same = True
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        qs, dm = q4_groups(w)
        w8 = torch.round(torch.randn(n, k, generator=g) * 40).clamp(-127, 127).to(torch.int8)
        ws = torch.rand(n, generator=g) * 0.01 + 1e-3
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=g) * 2).to(dtype)
                cases = [
                    (qlinear.q4_linear(x, qs, dm, acts="int8"), q4_ref(x, qs, dm)),
                    (qlinear.q4_linear(x, qs, dm, acts="fp32"), q4_ref_float(x, qs, dm, torch.float32)),
                    (qlinear.q8_linear(x, w8, ws, acts="int8"), q8_ref(x, w8, ws)),
                    (qlinear.q8_linear(x, w8, ws, acts="fp32"), q8_ref_float(x, w8, ws)),
                ]
                if qlinear.has_bf16():
                    cases.append(
                        (qlinear.q4_linear(x, qs, dm, acts="bf16"), q4_ref_float(x, qs, dm, torch.bfloat16))
                    )
                for got, want in cases:
                    assert got.dtype == dtype and got.shape == (m, n)
                    # a bf16 output is the sum rounded to 8 significant bits: off by at most
                    # 2^-8 of itself, which is not counted against the kernel
                    off = (got.float() - want).abs()
                    if dtype == torch.bfloat16:
                        off = (off - want.abs() * 2**-8).clamp(min=0)
                    worst = max(worst, float(off.max() / want.abs().max()))
                # each row alone, and on one thread, is the batched row bit for bit
                for acts in ("int8", "fp32", "bf16") if qlinear.has_bf16() else ("int8", "fp32"):
                    batched = qlinear.q4_linear(x, qs, dm, acts=acts)
                    batched8 = qlinear.q8_linear(x, w8, ws, acts=acts)
                    for i in range(m):
                        same &= torch.equal(
                            qlinear.q4_linear(x[i : i + 1], qs, dm, acts=acts), batched[i : i + 1]
                        )
                        same &= torch.equal(
                            qlinear.q8_linear(x[i : i + 1], w8, ws, acts=acts), batched8[i : i + 1]
                        )
                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                    same &= torch.equal(qlinear.q4_linear(x, qs, dm, acts=acts), batched)
                    same &= torch.equal(qlinear.q8_linear(x, w8, ws, acts=acts), batched8)
                    torch.set_num_threads(threads)
    return {"isa": qlinear.isa(), "bf16": qlinear.has_bf16(), "worst": worst, "same": same}


def fp32_digest() -> dict[str, str]:
    """A digest of the fp32-activation kernels' outputs (int4 groups and int8 rows, and a mixture
    of experts' call over both) on fixed inputs, over every shape and row count ``check`` takes:
    qmatmul.c sums in one order on every build, so every ISA's digest is the same."""
    import hashlib

    from helpers.experts_ref import stack

    h = hashlib.sha256()
    g = torch.Generator().manual_seed(1)
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        qs, dm = q4_groups(w)
        w8 = torch.round(torch.randn(n, k, generator=g) * 40).clamp(-127, 127).to(torch.int8)
        ws = torch.rand(n, generator=g) * 0.01 + 1e-3
        for m in ROWS:
            x = torch.randn(m, k, generator=g) * 2
            h.update(qlinear.q4_linear(x, qs, dm, acts="fp32").numpy().tobytes())
            h.update(qlinear.q8_linear(x, w8, ws, acts="fp32").numpy().tobytes())
    for kind in ("int4", "int8"):
        gu, _ = stack(kind, 192, 64, g)
        dn, _ = stack(kind, 64, 96, g)
        x = torch.randn(7, 64, generator=g)
        ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(7)])
        wts = torch.softmax(torch.randn(7, 2, generator=g), dim=1)
        h.update(qlinear.experts(x, ids, wts, gu, dn, "silu").numpy().tobytes())
    return {"isa": qlinear.isa(), "digest": h.hexdigest()}
