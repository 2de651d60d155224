"""What ``workers/kernels/gated_delta.c`` computes, in float64: the gated delta rule's decode step
(gate, delta-rule write, read) on states held in a pool of slots.

``check()`` runs the built kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) over shapes and
slot orders and returns its worst error relative to the outputs' and states' scale, whether the
slots it was not given stayed untouched, and whether one and two threads give the same bits.
The kernel tests run it in a subprocess per ISA.
"""

from __future__ import annotations

import torch

from workers.kernels import gdn_step
from workers.layers.gated_delta import l2norm

# (B, H, Dk, Dv): Qwen3.5's heads (128 x 128), an odd Dv (no whole vector), one sequence
SHAPES = [(3, 4, 128, 128), (2, 3, 16, 37), (1, 1, 8, 8), (5, 2, 64, 96)]


def reference(q, k, v, g, beta, state):
    """float64: out [B, H, Dv] and the new states [B, H, Dk, Dv]."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    S = S * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, S)) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def check() -> dict:
    worst, untouched, same = 0.0, True, True
    g_ = torch.Generator().manual_seed(0)
    for b, h, dk, dv in SHAPES:
        q = l2norm(torch.randn(b, h, dk, generator=g_)) * dk**-0.5
        k = l2norm(torch.randn(b, h, dk, generator=g_))
        v = torch.randn(b, h, dv, generator=g_)
        g = -torch.rand(b, h, generator=g_) * 2
        beta = torch.rand(b, h, generator=g_)
        pool = torch.randn(b + 3, h, dk, dv, generator=g_)
        slots = torch.randperm(b + 3, generator=g_)[:b]
        want_out, want_s = reference(q, k, v, g, beta, pool[slots])
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p = pool.clone()
            out = gdn_step.step(q, k, v, g, beta, p, slots)
            outs.append((out, p))
            worst = max(
                worst,
                float((out.double() - want_out).abs().max() / want_out.abs().max()),
                float((p[slots].double() - want_s).abs().max() / want_s.abs().max()),
            )
            others = torch.ones(b + 3, dtype=torch.bool)
            others[slots] = False
            untouched &= bool(torch.equal(p[others], pool[others]))
        same &= torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        # consecutive slots (slots None: slot b), as a run of the pool
        p = pool.clone()
        out = gdn_step.step(q, k, v, g, beta, p[:b])
        want_out, want_s = reference(q, k, v, g, beta, pool[:b])
        worst = max(worst, float((out.double() - want_out).abs().max() / want_out.abs().max()))
        worst = max(worst, float((p[:b].double() - want_s).abs().max() / want_s.abs().max()))
    return {"worst": worst, "untouched": untouched, "same": same}
