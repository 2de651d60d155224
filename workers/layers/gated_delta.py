"""Gated DeltaNet building blocks of Qwen3.5's linear-attention layers, as plain torch functions.

Each linear-attention head keeps a fixed-size state ``S`` of shape ``[Dk, Dv]`` instead of a KV
cache. Per token ``t`` (q and k L2-normalised, q also scaled by ``Dk**-0.5``):

    S <- exp(g_t) * S                                  # gate: forget a little (g_t <= 0)
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T          # delta rule: write the correction only
    o_t = q_t^T S                                      # read

``k_t^T S`` is what the state already predicts for ``k_t``; writing ``beta_t`` of the error
(``beta`` in (0, 1)) moves the stored value for that key toward ``v_t`` instead of piling up
(that is the "delta" of DeltaNet). ``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` and
``beta_t = sigmoid(b_t)`` come from the layer's projections, in fp32.

- ``recurrent_gated_delta_step`` runs that recurrence for one token of B sequences (decode);
  ``gated_delta_step_slots`` the same on states held in a pool of slots, in place (a C kernel
  on the CPU: ``workers/kernels/gated_delta.c``).
- ``chunk_gated_delta_rule`` gives the same result for T tokens of one sequence (prefill), in
  chunks of ``chunk_size``: within a chunk, its sequential rank-1 updates are folded into one
  unit-lower-triangular solve (the "UT transform" of the DeltaNet paper), so the work is matmuls,
  and only the chunks are scanned in order. It continues from any state, so a prompt may be fed
  in pieces (chunked prefill) and then decoded token by token. (On the CPU Qwen3.5's layer runs
  prefill chunks through the native kernel instead, every row as a decode step: the state stays
  in the core's cache, and a chunk's rows give their decode's bits; ``workers/models/qwen3_5.py``.)
- ``causal_conv1d_prefill`` / ``causal_conv1d_step``: the depthwise causal convolution (with
  SiLU) that precedes the recurrence, carrying the last ``K - 1`` inputs between calls.
- ``gated_rms_norm``: the RMSNorm gated by ``silu(z)`` that follows it.

The reference is transformers' ``models/qwen3_5/modeling_qwen3_5.py``
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
``causal_conv1d_update``, ``Qwen3_5RMSNormGated`` and ``Qwen3_5GatedDeltaNet.forward``), which
these functions match (tests/unit/test_gated_delta.py). Unlike transformers' conv update, no
function here writes into its arguments: each returns its new state.

Dtypes: the recurrent state is fp32 (in and out); q, k, v may be bf16/fp16/fp32 and are upcast,
all recurrence math is fp32 and the output comes back in v's dtype. The conv state is kept in
the conv input's dtype (it holds raw inputs, so nothing is lost by not upcasting it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels import gdn_step

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_step",
    "chunk_gated_delta_rule",
    "gated_delta_step_slots",
    "gated_rms_norm",
    "l2norm",
    "recurrent_gated_delta_step",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim, as transformers (and the FLA kernels) do:
    eps inside the root, not a clamp of the norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised q and k (q also scaled by Dk**-0.5), one head per value head.

    q, k: [..., Hk, Dk] -> [..., Hv, Dk]. Normalising before the GQA repeat does the same math
    on Hv / Hk times fewer vectors; the repeat is ``repeat_interleave`` because each key head
    serves ``Hv // Hk`` *consecutive* value heads in Qwen3.5's checkpoints.
    """
    q = l2norm(q.float())
    k = l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    num_k_heads = k.shape[-2]
    if num_v_heads != num_k_heads:
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, continuing from ``state`` (prefill).

    Single sequence:  q, k: [T, Hk, Dk] raw (L2 norm and scaling are done here), v: [T, Hv, Dv],
    g, beta: [T, Hv] (upcast to fp32), state: [Hv, Dk, Dv] fp32 (zeros for a fresh sequence).
    Returns out: [T, Hv, Dv] in v's dtype and the state after the last token, [Hv, Dk, Dv] fp32.
    A leading batch dim on every argument (same T for all) is accepted too and kept.

    Equal (up to fp32 rounding) to ``recurrent_gated_delta_step`` applied token by token, and to
    transformers' ``torch_chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``. The
    result does not depend on ``chunk_size``, nor on how a sequence is split between calls.
    ``state`` is not modified.
    """
    single = q.dim() == 3
    if single:
        q, k, v, g, beta, state = (x.unsqueeze(0) for x in (q, k, v, g, beta, state))
    out_dtype = v.dtype
    B, T, Hv, Dv = v.shape
    if T == 0:
        out, state = v.new_empty(v.shape), state.float()
        return (out[0], state[0]) if single else (out, state)

    q, k = _prep_qk(q, k, Hv)  # [B, T, Hv, Dk] fp32
    v32, g32, beta32 = v.float(), g.float(), beta.float()

    # A sequence that fits in one chunk is one chunk of its own length: no padding to compute
    # around (the result is the same for any chunk size). Otherwise pad the tail with zeros:
    # a padded token has k = 0, beta = 0 and g = 0, so it neither decays nor writes the state.
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:
        q, k, v32 = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v32))
        g32, beta32 = (F.pad(x, (0, 0, 0, pad)) for x in (g32, beta32))
    N = (T + pad) // C

    # Lay out chunk-major, [N, B, Hv, C, D], so that the scan below reads contiguous blocks:
    # one copy from the input's [B, T, H, D] layout.
    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, N*C, Hv, D] -> [N, B, Hv, C, D]
        return x.reshape(B, N, C, Hv, x.shape[-1]).permute(1, 0, 3, 2, 4).contiguous()

    q, k, v32 = chunked(q), chunked(k), chunked(v32)
    g32 = g32.reshape(B, N, C, Hv).permute(1, 0, 3, 2)  # [N, B, Hv, C]
    beta32 = beta32.reshape(B, N, C, Hv).permute(1, 0, 3, 2)  # [N, B, Hv, C]

    # gam[..., i]: log of the decay from the chunk's start through token i (all <= 0).
    gam = g32.cumsum(dim=-1)  # [N, B, Hv, C]
    # decay[..., i, j] = exp(gam_i - gam_j): the decay between tokens j <= i of a chunk. The
    # upper triangle (j > i) is set to -inf before exp: there gam_i - gam_j >= 0 could overflow.
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # decay: [N, B, Hv, C, C]
    decay = (gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()

    k_t = k.transpose(-1, -2)  # [N, B, Hv, Dk, C]
    # The UT system (I + L): L[i, j] = beta_i exp(gam_i - gam_j) k_i.k_j for j < i. Only its
    # strict lower triangle is read (unitriangular=True), so the diagonal needs no masking.
    ut = (k @ k_t) * decay * beta32.unsqueeze(-1)  # [N, B, Hv, C, C]
    # The chunk's writes, from the UT transform (FLA's kernels compute the same two products):
    #   u = (I + L)^-1 diag(beta) v             pseudo-values: the writes on a zero state
    #   w = (I + L)^-1 diag(beta exp(gam)) k    how much of the incoming state each write cancels
    # (I + L)^-1 comes from one triangular solve against the identity (exact, no C-step forward
    # substitution loop as in transformers' export path); the diagonal scalings are folded into
    # its columns, so u and w are plain matmuls. On CPU that is about twice as fast as solving
    # for the C x (Dv + Dk) right-hand side directly: small triangular solves run far below
    # matmul speed.
    eye = torch.eye(C, dtype=torch.float32, device=q.device).expand_as(ut)
    inv_beta = torch.linalg.solve_triangular(ut, eye, upper=False, unitriangular=True)
    inv_beta = inv_beta * beta32.unsqueeze(-2)  # [N, B, Hv, C, C]: (I + L)^-1 diag(beta)
    u = inv_beta @ v32  # [N, B, Hv, C, Dv]
    w = (inv_beta * gam.exp().unsqueeze(-2)) @ k  # [N, B, Hv, C, Dk]

    # Intra-chunk attention, causal (the -inf above zeroed j > i): attn[i, j] = q_i.k_j decay_ij.
    attn = (q @ k_t) * decay  # [N, B, Hv, C, C]
    # Reads of the incoming state: token i sees it decayed by exp(gam_i).
    q_dec = q * gam.exp().unsqueeze(-1)  # [N, B, Hv, C, Dk]
    # Writes into the outgoing state: token i's key decayed to the chunk's end, exp(gam_C - gam_i).
    k_end_t = (k * (gam[..., -1:] - gam).exp().unsqueeze(-1)).transpose(-1, -2)  # [N, B, Hv, Dk, C]
    chunk_decay = gam[..., -1].exp()[..., None, None]  # [N, B, Hv, 1, 1]

    S = state.to(device=q.device, dtype=torch.float32)  # [B, Hv, Dk, Dv]
    out = torch.empty_like(u)  # [N, B, Hv, C, Dv]
    # The only sequential part: one step per chunk (T / C of them).
    for n in range(N):
        v_new = u[n] - w[n] @ S  # [B, Hv, C, Dv]: the writes, less what S already holds
        torch.add(q_dec[n] @ S, attn[n] @ v_new, out=out[n])  # inter-chunk + intra-chunk reads
        S = S * chunk_decay[n] + k_end_t[n] @ v_new

    # [N, B, Hv, C, Dv] -> [B, T, Hv, Dv], dropping the padding.
    out = out.permute(1, 0, 3, 2, 4).reshape(B, N * C, Hv, Dv)[:, :T]
    out = out.to(out_dtype, memory_format=torch.contiguous_format)
    return (out[0], S[0]) if single else (out, S)


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for each of B sequences at once (decode).

    q, k: [B, Hk, Dk] raw, v: [B, Hv, Dv], g, beta: [B, Hv] (upcast to fp32),
    state: [B, Hv, Dk, Dv] fp32. Returns out: [B, Hv, Dv] in v's dtype and the new state
    [B, Hv, Dk, Dv] fp32: a new tensor, or ``state`` itself updated in place with ``inplace``
    (a contiguous fp32 state: the engine's own slots, so the state is read and written once).
    """
    B, Hv, Dv = v.shape
    Dk = k.shape[-1]
    q, k = _prep_qk(q, k, Hv)  # [B, Hv, Dk] fp32
    v32, beta32 = v.float(), beta.float()

    # S = exp(g) * state: the gate, in the buffer the rank-1 write goes into.
    if inplace:
        S = state.mul_(g.float().exp()[..., None, None])
    else:
        S = torch.empty(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
        torch.mul(state, g.float().exp()[..., None, None], out=S)
    # Both reads of the gated state in one batched matmul: [k; q] @ S -> [B, Hv, 2, Dv].
    kq = torch.stack([k, q], dim=-2)  # [B, Hv, 2, Dk]
    read = kq @ S
    delta = (v32 - read[..., 0, :]) * beta32.unsqueeze(-1)  # [B, Hv, Dv]: the delta-rule write
    # S += k delta^T, in place on our own buffer (one pass over the state).
    S.view(B * Hv, Dk, Dv).baddbmm_(k.reshape(B * Hv, Dk, 1), delta.reshape(B * Hv, 1, Dv))
    # out = q^T S_new = q^T S + (q.k) delta: no second pass over the updated state.
    out = read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta  # [B, Hv, Dv]
    return out.to(v.dtype), S


def gated_delta_step_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor | slice,
) -> torch.Tensor:
    """``recurrent_gated_delta_step`` for B sequences whose states are slots of ``pool``
    [S, Hv, Dk, Dv] fp32 (``slots``: int64 [B], or a slice of B consecutive slots), updated there
    in place; returns out [B, Hv, Dv] in v's dtype. On the CPU by ``workers/kernels/gdn_step``'s
    kernel where it is built (each state read once and written once, no gather or scatter:
    the slots are its arguments), else torch's ops on the slice, or gathered and scattered back."""
    if gdn_step.available() and gdn_step.fits(pool, v):
        qn, kn = _prep_qk(q, k, v.shape[-2])  # [B, Hv, Dk] fp32
        if isinstance(slots, slice):
            return gdn_step.step(qn, kn, v, g, beta, pool[slots]).to(v.dtype)
        return gdn_step.step(qn, kn, v, g, beta, pool, slots).to(v.dtype)
    if isinstance(slots, slice):
        return recurrent_gated_delta_step(q, k, v, g, beta, pool[slots], inplace=True)[0]
    o, new = recurrent_gated_delta_step(q, k, v, g, beta, pool[slots], inplace=True)
    pool.index_copy_(0, slots, new)
    return o


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over T tokens of one sequence, continuing from ``conv_state``.

    x: [T, C]; weight: [C, K] (the checkpoint's conv1d.weight [C, 1, K] squeezed); conv_state:
    [C, K-1], the K-1 inputs before this chunk (zeros for a fresh sequence). Returns out: [T, C]
    in x's dtype (the conv itself runs in weight's dtype, as transformers does), and the new conv
    state [C, K-1] in x's dtype: the last K-1 inputs of ``conv_state ++ x`` (some of them from
    the old state when T < K-1).
    """
    T, C = x.shape
    K = weight.shape[-1]
    # [C, K-1+T]: the inputs this chunk's outputs see, oldest first.
    xs = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)
    # Valid (unpadded) conv over the state-prefixed inputs: exactly T outputs, output t reading
    # inputs t .. t+K-1 of xs, i.e. x[t] and the K-1 before it.
    out = F.conv1d(xs.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=C)  # [1, C, T]
    out = F.silu(out)[0].t().to(x.dtype).contiguous()  # [T, C]
    new_state = xs[:, xs.shape[-1] - (K - 1) :].contiguous()  # [C, K-1]
    return out, new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the depthwise causal conv1d + SiLU for each of B sequences (decode).

    x: [B, C]; weight: [C, K]; conv_state: [B, C, K-1]. Returns out: [B, C] in x's dtype and the
    new conv state [B, C, K-1] in x's dtype (the old one shifted left by one, x appended).
    One output per channel is a K-term dot product: a multiply and a sum over K, in the weight's
    dtype as the prefill's conv computes it (oneDNN's convolution costs ~0.25 ms a call here).
    """
    xs = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (xs.to(weight.dtype) * weight).sum(-1)  # [B, C]
    return F.silu(out).to(x.dtype), xs[..., 1:].contiguous()


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x gated by silu(z), as transformers' ``Qwen3_5RMSNormGated``.

    x, z: [..., D] (the attention output and the gate projection, per value head); weight: [D].
    The norm is in fp32, cast back to x's dtype before the weight (as the reference rounds), the
    gate multiply in fp32; returns x's dtype.
    """
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * x32.to(dtype)
    return (h * F.silu(z.float())).to(dtype)
