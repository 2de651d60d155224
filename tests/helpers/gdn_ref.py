"""What ``workers/kernels/gated_delta.c`` computes, in float64: the gated delta rule's decode step
(gate, delta-rule write, read) on states held in a pool of slots.

``check()`` runs the built kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) over shapes and
slot orders and returns its worst error relative to the outputs' and states' scale, whether the
slots it was not given stayed untouched, and whether one and two threads give the same bits.
``check_decode()`` does the same for the whole decode step (``gd_decode``: conv, norms, gates, the
step and the gated norm) against ``decode_reference``, and returns a digest of its outputs so
that the builds of two ISAs can be held to the same bits. The kernel tests run them in a
subprocess per ISA.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

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


# (B, Hk, Hv, Dk, Dv, K): Qwen3.5-0.8B's heads (16 x 128, 4 taps), GQA with odd sizes, one sequence
DECODE_SHAPES = [(3, 16, 16, 128, 128, 4), (2, 2, 4, 16, 37, 3), (1, 1, 1, 8, 8, 4)]


def decode_reference(proj, conv_w, conv, a_log, dt_bias, norm_w, ssm, heads, eps):
    """float64, the layer's decode math between its linears (workers/models/qwen3_5.py):
    returns the gated-norm output [B, Hv * Dv], the new conv states and the new states."""
    hk, hv, dk, dv = heads
    c = conv_w.shape[0]
    proj, conv_w, conv, a_log, dt_bias, norm_w, ssm = (
        t.double() for t in (proj, conv_w, conv, a_log, dt_bias, norm_w, ssm)
    )
    b = proj.shape[0]
    xs = torch.cat([conv, proj[:, :c, None]], dim=-1)  # [B, C, K]
    mixed = F.silu((xs * conv_w).sum(-1))
    q = l2norm(mixed[:, : hk * dk].view(b, hk, dk)) * dk**-0.5
    k = l2norm(mixed[:, hk * dk : 2 * hk * dk].view(b, hk, dk))
    q, k = (t.repeat_interleave(hv // hk, dim=1) for t in (q, k))
    v = mixed[:, 2 * hk * dk :].view(b, hv, dv)
    z = proj[:, c : c + hv * dv].view(b, hv, dv)
    beta = torch.sigmoid(proj[:, c + hv * dv : c + hv * dv + hv])
    g = -a_log.exp() * F.softplus(proj[:, c + hv * dv + hv :] + dt_bias)
    o, s = reference(q, k, v, g, beta, ssm)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    return (o * F.silu(z)).reshape(b, hv * dv), xs[..., 1:], s


def check_decode() -> dict:
    worst, untouched, same = 0.0, True, True
    digest = hashlib.sha256()
    g_ = torch.Generator().manual_seed(4)
    for b, hk, hv, dk, dv, taps in DECODE_SHAPES:
        c = 2 * hk * dk + hv * dv
        proj = torch.randn(b, c + hv * dv + 2 * hv, generator=g_)
        conv_w = torch.randn(c, taps, generator=g_) * 0.5
        a_log, dt_bias = torch.randn(hv, generator=g_) * 0.5, torch.randn(hv, generator=g_)
        norm_w = 1 + torch.randn(dv, generator=g_) * 0.1
        conv = torch.randn(b + 2, c, taps - 1, generator=g_)
        ssm = torch.randn(b + 2, hv, dk, dv, generator=g_) * 0.1
        slots = torch.randperm(b + 2, generator=g_)[:b]
        heads = (hk, hv, dk, dv)
        want_o, want_c, want_s = decode_reference(
            proj, conv_w, conv[slots], a_log, dt_bias, norm_w, ssm[slots], heads, 1e-6
        )
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pc, ps = conv.clone(), ssm.clone()
            out = gdn_step.decode(proj, conv_w, pc, a_log, dt_bias, norm_w, ps, slots, heads, 1e-6)
            outs.append((out, pc, ps))
            for got, want in ((out, want_o), (pc[slots], want_c), (ps[slots], want_s)):
                worst = max(worst, float((got.double() - want).abs().max() / want.abs().max()))
            others = torch.ones(b + 2, dtype=torch.bool)
            others[slots] = False
            untouched &= bool(torch.equal(pc[others], conv[others]) and torch.equal(ps[others], ssm[others]))
        same &= all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
        for t in outs[0]:
            digest.update(t.contiguous().numpy().tobytes())
    return {"worst": worst, "untouched": untouched, "same": same, "digest": digest.hexdigest()}


# (hk, hv, dk, dv, taps, runs: (rows, fresh) each): a 1-row decode run beside prefill chunks,
# a chunk shorter than the conv's state, fresh and continuing ones; C past one channel block
RUNS_SHAPES = [
    (16, 16, 128, 128, 4, [(1, False), (9, True), (2, False), (17, False)]),
    (2, 4, 16, 37, 3, [(5, True), (1, False), (1, True)]),
    (1, 1, 8, 8, 4, [(3, False)]),
]


def check_runs() -> dict:
    """``gd_runs`` (runs of rows, each a sequence's consecutive tokens) against the same kernel
    fed the same tokens one decode row at a time: the same bits (outputs, conv and recurrent
    states; a fresh run as from zero states); on one and two threads the same; a digest for the
    builds of two ISAs."""
    same_as_rows, same = True, True
    digest = hashlib.sha256()
    g_ = torch.Generator().manual_seed(5)
    for hk, hv, dk, dv, taps, spec in RUNS_SHAPES:
        c = 2 * hk * dk + hv * dv
        n = sum(r for r, _ in spec)
        proj = torch.randn(n, c + hv * dv + 2 * hv, generator=g_)
        conv_w = torch.randn(c, taps, generator=g_) * 0.5
        a_log, dt_bias = torch.randn(hv, generator=g_) * 0.5, torch.randn(hv, generator=g_)
        norm_w = 1 + torch.randn(dv, generator=g_) * 0.1
        s = len(spec) + 2
        conv = torch.randn(s, c, taps - 1, generator=g_)
        ssm = torch.randn(s, hv, dk, dv, generator=g_) * 0.1
        slots = torch.randperm(s, generator=g_)[: len(spec)]
        runs, first = [], 0
        for rows, fresh in spec:
            runs.append((first, rows, fresh))
            first += rows
        heads = (hk, hv, dk, dv)
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pc, ps = conv.clone(), ssm.clone()
            out = gdn_step.decode(proj, conv_w, pc, a_log, dt_bias, norm_w, ps, slots, heads, 1e-6, runs)
            outs.append((out, pc, ps))
        same &= all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
        # the same tokens as decode rows, one step at a time per sequence
        pc, ps = conv.clone(), ssm.clone()
        rows_out = torch.empty_like(outs[0][0])
        for (r0, rows, fresh), slot in zip(runs, slots.tolist()):
            if fresh:
                pc[slot], ps[slot] = 0, 0
            for r in range(r0, r0 + rows):
                one = torch.tensor([slot])
                rows_out[r] = gdn_step.decode(
                    proj[r : r + 1], conv_w, pc, a_log, dt_bias, norm_w, ps, one, heads, 1e-6
                )[0]
        same_as_rows &= all(torch.equal(x, y) for x, y in zip(outs[0], (rows_out, pc, ps)))
        for t in outs[0]:
            digest.update(t.contiguous().numpy().tobytes())
    return {"same_as_rows": same_as_rows, "same": same, "digest": digest.hexdigest()}
