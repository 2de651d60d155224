"""Attention with learned sinks (gpt-oss): each head has one more logit in its softmax, a learned
``sink`` with no value, so a query may put part of its weight nowhere:

    p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)),    out = sum_j p_j v_j

which equals plain attention's output times ``sigmoid(lse - sink)`` (lse: the log-sum-exp of the
scores). It is computed here as transformers' ``eager_attention_forward`` does: the sink as one
more column of the scores, dropped after the softmax.

The same cache kinds as plain attention: the paged pool (``paged_sink_attention``, full layers)
and a sliding window's ring (``ring_sink_attention``), with the same writes and reads as
``workers/layers/attention.py::paged_attention`` and ``workers/layers/sliding.py::ring_attention``.
Decode rows go through the shared ``decode_attention`` (its ``sinks`` argument); a CUDA step's
plain paged prefill chunks through the shared Triton kernel (``attention.prefill_kernel``, its
``sinks`` argument), any other prefill chunk through ``attend_with_sinks``: explicit matmuls in
blocks of query rows (SDPA takes no sink and returns no log-sum-exp), each block's scores at most
``_SCORES`` values.
"""

from __future__ import annotations

import torch

from workers.kernels.kv_quant import KvRows, read_rows, write_rows
from workers.layers.attention import StepBatch, decode_attention, prefill_kernel

_SCORES = 1 << 24  # fp32 scores per block of query rows (64 MiB)


def attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor
) -> torch.Tensor:
    """q: [C, H, D] (pre-scaled); k, v: [T, KV, D]; mask: [C, T] bool (True: attend), None for
    causal with the queries at the last C of the T positions; sinks: [H] -> [C, H, D]."""
    c, h, d = q.shape
    t, kv, _ = k.shape
    g = h // kv
    kt = k.permute(1, 2, 0).unsqueeze(1)  # [KV, 1, D, T]
    vv = v.transpose(0, 1).unsqueeze(1)  # [KV, 1, T, D]
    sink = sinks.float().view(kv, g, 1, 1)
    out = torch.empty_like(q)
    rows = max(1, _SCORES // (h * t))
    for r0 in range(0, c, rows):
        r1 = min(c, r0 + rows)
        qg = q[r0:r1].reshape(r1 - r0, kv, g, d).permute(1, 2, 0, 3)  # [KV, G, R, D]
        scores = torch.matmul(qg, kt).float()  # [KV, G, R, T]
        if mask is None:
            q_pos = torch.arange(t - c + r0, t - c + r1, device=q.device)[:, None]
            seen = torch.arange(t, device=q.device)[None, :] <= q_pos  # [R, T]
        else:
            seen = mask[r0:r1]
        scores = scores.masked_fill(~seen, float("-inf"))
        scores = torch.cat((scores, sink.expand(kv, g, r1 - r0, 1)), dim=-1)  # [KV, G, R, T + 1]
        probs = torch.softmax(scores, dim=-1)[..., :-1].to(v.dtype)
        o = torch.matmul(probs, vv)  # [KV, G, R, D]
        out[r0:r1] = o.permute(2, 0, 1, 3).reshape(r1 - r0, h, d)
    return out


def paged_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: StepBatch,
    k_cache: KvRows,
    v_cache: KvRows,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``paged_attention`` with sinks: write the step's K/V into the pool, then attend.
    q: [N, H, D] (pre-scaled), k, v: [N, KV, D]; k_cache, v_cache: [rows, KV, D] (or their
    quantized rows) -> [N, H, D]."""
    write_rows(k_cache, b.slot_mapping, k)
    write_rows(v_cache, b.slot_mapping, v)
    nd = b.n_decode
    if not b.prefills:
        return decode_attention(q, b, k_cache, v_cache, sinks)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], b, k_cache, v_cache, sinks)
    if prefill_kernel(q, b, k_cache, v_cache, out, sinks):  # a CUDA step's plain paged chunks
        return out
    for c in b.prefills:
        kk = read_rows(k_cache, c.gather, q.dtype)  # [T, KV, D]
        vv = read_rows(v_cache, c.gather, q.dtype)
        mask = None if c.mask is None else c.mask[0, 0]
        out[c.start : c.end] = attend_with_sinks(q[c.start : c.end], kk, vv, mask, sinks)
    return out


def ring_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: StepBatch,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``ring_attention`` with sinks, on a window view (``workers/layers/sliding.py``): decode
    rows write their K/V first and attend; a prefill chunk attends to its ring history and
    itself (the view's band mask), then writes its newest ``window`` positions.
    k_ring, v_ring: [slots + 1, window, KV, D] -> [N, H, D]."""
    nd, window = b.n_decode, k_ring.shape[1]
    k_ring, v_ring = k_ring.flatten(0, 1), v_ring.flatten(0, 1)  # views: [(slots + 1) * window, KV, D]
    if nd:
        k_ring.index_copy_(0, b.slot_mapping[:nd], k[:nd])
        v_ring.index_copy_(0, b.slot_mapping[:nd], v[:nd])
        if not b.prefills:
            return decode_attention(q, b, k_ring, v_ring, sinks)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], b, k_ring, v_ring, sinks)
    for c in b.prefills:
        s, e = c.start, c.end
        kk = torch.cat((k_ring.index_select(0, c.gather), k[s:e]))  # [P + C, KV, D]
        vv = torch.cat((v_ring.index_select(0, c.gather), v[s:e]))
        mask = None if c.mask is None else c.mask[0, 0]
        out[s:e] = attend_with_sinks(q[s:e], kk, vv, mask, sinks)
        tail = max(s, e - window)  # at most a ring's worth: no row written twice
        k_ring.index_copy_(0, b.slot_mapping[tail:e], k[tail:e])
        v_ring.index_copy_(0, b.slot_mapping[tail:e], v[tail:e])
    return out
