"""Sliding-window attention over a ring of ``window`` positions per slot.

A query at position p reads keys p - window + 1 .. p (transformers' ``sliding_window_overlay``:
``kv_idx > q_idx - window``). So a sliding layer never needs more than its sequence's last
``window`` positions: it keeps them in a ring (``workers/cache.py``: ``[slots + 1, window, KV, D]``,
position p of slot s in row ``s * window + p % window`` of the flat view), and its KV memory per
sequence is bounded by the window whatever the context, while full-attention layers keep every
position in the paged pool. The ring is checkpointed at block boundaries for the prefix cache like
a recurrent state.

The step's view for a window (``window_view``) is a ``StepBatch`` in ring rows:

- ``slot_mapping``: each token's ring row;
- decode rows: row b (slot s, length L) reads positions max(0, L - window) .. L - 1, a
  [B, min(max L, window)] gather; positions past a row's end are padding under a -inf bias;
- a prefill chunk of positions p0 .. p1 - 1: ``gather`` is its history in the ring, positions
  max(0, p0 - window + 1) .. p0 - 1; its own keys come from the step (a chunk longer than the window
  would overwrite, in the ring, history its first queries still read); ``mask`` bands history and
  chunk (None: plain causal, a first chunk no longer than the window).

``ring_attention`` writes decode rows' K/V first and attends; a prefill chunk attends to its
history and itself, then writes its last ``window`` positions. A query only ever reads positions
its own sequence wrote (or a restored checkpoint holds), so a ring is never cleared.

Under a quantized KV cache type (``--kv-cache-dtype``) rings stay at the compute dtype: a ring's
bytes are bounded by its window whatever the context, the router books them as states at the
compute dtype, and decode reads a ring through ``decode_attention``'s row gather (at most the
window), not by the paged pool's blocks (``workers/cache.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.layers.attention import PrefillChunk, StepBatch, decode_attention


def window_view(
    b: StepBatch,
    window: int,
    decode: list[tuple[int, int]],
    chunks: list[tuple[int, int, int]],
    rot: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepBatch:
    """``b``'s view for layers of this ``window``, in ring rows. ``decode``: each decode row's
    (slot, length: its position + 1); ``chunks``: each prefill chunk's (slot, p0, p1), in
    ``b.prefills``' order; ``rot``: the sliding layers' rotary tables when they differ from ``b``'s."""
    cos, sin = rot if rot is not None else (b.rot_cos, b.rot_sin)
    dev = b.slot_mapping.device
    mapping: list[int] = [s * window + (n - 1) % window for s, n in decode]
    for slot, p0, p1 in chunks:
        mapping += [slot * window + p % window for p in range(p0, p1)]
    gather = bias = None
    if decode:
        slots = torch.tensor([s for s, _n in decode], dtype=torch.long, device=dev)  # [B]
        lens = torch.tensor([n for _s, n in decode], dtype=torch.long, device=dev)  # [B]
        width = min(max(n for _s, n in decode), window)
        pos = (lens - window).clamp_(min=0)[:, None] + torch.arange(width, device=dev)[None, :]  # [B, W]
        pad = pos >= lens[:, None]
        gather = slots[:, None] * window + pos % window
        if bool(pad.any()):
            bias = torch.zeros(pad.shape, dtype=torch.float32, device=dev)
            bias = bias.masked_fill_(pad, float("-inf"))[:, None, None, :]  # [B, 1, 1, W]
    pre = []
    for c, (slot, p0, p1) in zip(b.prefills, chunks):
        k0 = max(0, p0 - window + 1)  # the first key any query of the chunk reads
        hist = torch.tensor([slot * window + p % window for p in range(k0, p0)], dtype=torch.long, device=dev)
        mask = None
        if p0 or p1 > window:
            q_pos = torch.arange(p0, p1, device=dev)[:, None]
            k_pos = torch.arange(k0, p1, device=dev)[None, :]
            mask = ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]  # [1, 1, C, P + C]
        pre.append(PrefillChunk(c.start, c.end, hist, mask, c.slot, c.fresh, windowed=True))
    slot_mapping = torch.tensor(mapping, dtype=torch.long, device=dev)
    return StepBatch(cos, sin, slot_mapping, b.n_decode, gather, bias, pre, b.decode_slots, b.decode_slot_run)


def decode_window_view(
    b: StepBatch,
    window: int,
    slots: torch.Tensor,
    lens: torch.Tensor,
    rot: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepBatch:
    """``window_view`` of a pure decode step, from tensors alone: no value read on the host, so a
    CUDA graph can hold it (``workers/cuda_graphs.py``). slots, lens: [B] int64, each row's ring
    slot and length (its position + 1). Every row reads the ring's whole window, [B, window], the
    positions past its end under a -inf bias (the eager view cuts the width to the longest row's
    length instead: the same attention, a shape that depends on the lengths)."""
    cos, sin = rot if rot is not None else (b.rot_cos, b.rot_sin)
    dev = lens.device
    pos = (lens - window).clamp(min=0)[:, None] + torch.arange(window, device=dev)[None, :]  # [B, W]
    gather = slots[:, None] * window + pos % window
    bias = torch.zeros(pos.shape, dtype=torch.float32, device=dev)
    bias = bias.masked_fill_(pos >= lens[:, None], float("-inf"))[:, None, None, :]  # [B, 1, 1, W]
    mapping = slots * window + (lens - 1) % window  # [B]: each row's own ring row
    return StepBatch(cos, sin, mapping, b.n_decode, gather, bias, [], b.decode_slots, None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: StepBatch,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    write_prefills: bool = True,
) -> torch.Tensor:
    """Sliding-window attention on a window view (``window_view``). q: [N, H, D] (pre-scaled),
    k, v: [N, KV, D]; k_ring, v_ring: [slots + 1, window, KV, D] (a ring state) -> [N, H, D].

    ``write_prefills=False`` leaves the prefill chunks' K/V out of the ring, for a ring that later
    layers of the same step read too (Gemma 4's KV sharing: a chunk's write may overwrite history
    their queries still read); the caller writes them after the last reader (``ring_write_prefills``)."""
    nd, window = b.n_decode, k_ring.shape[1]
    k_ring, v_ring = k_ring.flatten(0, 1), v_ring.flatten(0, 1)  # views: [(slots + 1) * window, KV, D]
    if nd:
        k_ring.index_copy_(0, b.slot_mapping[:nd], k[:nd])
        v_ring.index_copy_(0, b.slot_mapping[:nd], v[:nd])
        if not b.prefills:
            return decode_attention(q, b, k_ring, v_ring)
    out = torch.empty_like(q)  # [N, H, D]
    if nd:
        out[:nd] = decode_attention(q[:nd], b, k_ring, v_ring)
    for c in b.prefills:
        s, e = c.start, c.end
        kk = torch.cat((k_ring.index_select(0, c.gather), k[s:e]))  # [P + C, KV, D]
        vv = torch.cat((v_ring.index_select(0, c.gather), v[s:e]))
        out[s:e] = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),  # [1, H, C, D]
            kk.transpose(0, 1).unsqueeze(0),  # [1, KV, P + C, D]
            vv.transpose(0, 1).unsqueeze(0),
            attn_mask=c.mask,
            is_causal=c.mask is None,
            enable_gqa=True,
            scale=1.0,
        )[0].transpose(0, 1)
    if write_prefills:
        _write_prefills(k, v, b, k_ring, v_ring, window)
    return out


def _write_prefills(
    k: torch.Tensor, v: torch.Tensor, b: StepBatch, k_ring: torch.Tensor, v_ring: torch.Tensor, window: int
) -> None:
    # each chunk's newest positions into the ring (at most a ring's worth: no row written twice)
    for c in b.prefills:
        tail = max(c.start, c.end - window)
        k_ring.index_copy_(0, b.slot_mapping[tail : c.end], k[tail : c.end])
        v_ring.index_copy_(0, b.slot_mapping[tail : c.end], v[tail : c.end])


def ring_write_prefills(
    k: torch.Tensor, v: torch.Tensor, b: StepBatch, k_ring: torch.Tensor, v_ring: torch.Tensor
) -> None:
    """The prefill chunks' K/V into the ring, as ``ring_attention`` writes them (after it, when it
    was told not to). k, v: [N, KV, D]; k_ring, v_ring: [slots + 1, window, KV, D]."""
    _write_prefills(k, v, b, k_ring.flatten(0, 1), v_ring.flatten(0, 1), k_ring.shape[1])
