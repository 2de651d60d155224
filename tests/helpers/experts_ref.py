"""What ``qmatmul.c``'s ``qm_experts`` (a MoE layer's routed experts in one call) computes, in
float64: each routed expert's dequantized gate_up and down (int4 groups, int8 rows or MXFP4,
exact in float64), the biases, the gated activation, each token's k outputs weighted and summed.
Only the order of the kernel's fp32 sums (and its fp32 activation between the matrices) differs,
so a kernel that takes a row from the wrong expert, a bias from the wrong row or a weight from
the wrong slot is off by the order of the outputs, and a right one by ~1e-6.

``check()`` runs the built kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) over each weight
kind, both activations and both dtypes, tokens that share experts and tokens alone, and returns
its worst error relative to the outputs' scale, and whether each token's row is the same bit for
bit alone, batched and on one thread. The kernel tests run it in a subprocess per ISA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels import qlinear
from workers.mxfp4 import dequantize_held
from workers.quant import int8_rows, q4_groups

from helpers.mxfp4_ref import blocks, worst

E, TOPK = 5, 2
# (H, I): gate_up [2I, H], down [H, I]; N not a multiple of a thread's 16 columns in the second
SHAPES = [(64, 96), (96, 32)]
ROWS = [1, 2, 3, 5, 9]


def stack(kind: str, n: int, k: int, g: torch.Generator) -> tuple[qlinear.Stack, torch.Tensor]:
    """E random [n, k] matrices held as ``kind``, and their dequantized values [E, n, k] float64."""
    if kind == "mxfp4":
        pairs = [blocks(n, k, g, 118, 126) for _ in range(E)]
        a, b = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        w = torch.stack([dequantize_held(p[0], p[1], torch.float64) for p in pairs])
        return qlinear.Stack(kind, a, b), w
    mats = [torch.randn(n, k, generator=g) * 0.05 for _ in range(E)]
    if kind == "int8":
        held = [int8_rows(m) for m in mats]
        a, b = torch.stack([h[0] for h in held]), torch.stack([h[1] for h in held])
        return qlinear.Stack(kind, a, b), a.double() * b.double()[..., None]
    held = [q4_groups(m) for m in mats]
    a, b = torch.stack([h[0] for h in held]), torch.stack([h[1] for h in held])
    lv = a.long().reshape(E, n, -1, 16)
    levels = torch.cat([lv & 15, lv >> 4], dim=3).double()  # [E, n, G, 32]
    d, mn = b[:, :, 0].double(), b[:, :, 1].double()  # [E, n, G]
    return qlinear.Stack(kind, a, b), (mn[..., None] + levels * d[..., None]).reshape(E, n, k)


def glu_ref(gu: torch.Tensor, glu: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    inter = gu.shape[-1] // 2
    gate, up = gu[..., :inter], gu[..., inter:]
    if glu == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def ref(x, ids, wts, w_gu, w_dn, glu, b_gu, b_dn) -> torch.Tensor:
    """The experts' weighted sum [M, H] float64 from the dequantized weights."""
    out = torch.zeros(x.shape[0], w_dn.shape[1], dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            gu = w_gu[e] @ x[m].double() + (0 if b_gu is None else b_gu[e].double())
            y = w_dn[e] @ glu_ref(gu, glu) + (0 if b_dn is None else b_dn[e].double())
            out[m] += float(wts[m, j]) * y
    return out


def check() -> dict[str, float | bool | str]:
    g = torch.Generator().manual_seed(0)
    err = 0.0
    same = True
    for kind in ("int4", "int8", "mxfp4"):
        for h, inter in SHAPES:
            gu, w_gu = stack(kind, 2 * inter, h, g)
            dn, w_dn = stack(kind, h, inter, g)
            for glu, bias in (("silu", False), ("clamped", True)):
                b_gu = torch.randn(E, 2 * inter, generator=g) * 0.1 if bias else None
                b_dn = torch.randn(E, h, generator=g) * 0.1 if bias else None
                for m in ROWS:
                    for dtype in (torch.float32, torch.bfloat16):
                        x = torch.randn(m, h, generator=g).to(dtype)
                        # each token's k experts distinct, tokens sharing some (E = 5 < 2 * 3)
                        ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(m)])
                        wts = torch.softmax(torch.randn(m, TOPK, generator=g), dim=1)
                        args = (gu, dn, glu, 1.702, 7.0, b_gu, b_dn)
                        got = qlinear.experts(x, ids, wts, *args)
                        assert got.dtype == dtype and got.shape == (m, h)
                        err = max(err, worst(got, ref(x, ids, wts, w_gu, w_dn, glu, b_gu, b_dn)))
                        for i in range(m):
                            same &= torch.equal(
                                qlinear.experts(x[i : i + 1], ids[i : i + 1], wts[i : i + 1], *args),
                                got[i : i + 1],
                            )
                        threads = torch.get_num_threads()
                        torch.set_num_threads(1)
                        same &= torch.equal(qlinear.experts(x, ids, wts, *args), got)
                        torch.set_num_threads(threads)
    return {"isa": qlinear.isa(), "worst": err, "same": same}
