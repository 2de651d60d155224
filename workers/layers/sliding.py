"""Sliding-window attention: a step's view for the layers that read at most ``window`` positions.

A query at position p reads keys p - window + 1 .. p (transformers' ``sliding_window_overlay``:
``kv_idx > q_idx - window``). The view is the step's ``StepBatch`` with each query's gather cut to
its window, so a sliding layer reads at most ``window`` cache rows per query however long the
context is, and ``paged_attention`` runs on it unchanged:

- decode rows: row b (length L_b) reads positions max(0, L_b - window) .. L_b - 1, as a
  [B, min(max L, window)] gather; positions past a row's end are padding under a -inf bias;
- a prefill chunk of positions p0 .. p1 - 1 reads keys from max(0, p0 - window + 1) with a band
  mask (causal, and no key ``window`` or more behind its query); plain causal needs none.
"""

from __future__ import annotations

import torch

from workers.layers.attention import PrefillChunk, StepBatch


def window_view(
    b: StepBatch,
    window: int,
    decode_lens: list[int],
    spans: list[tuple[int, int]],
    rot: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepBatch:
    """``b``'s view for layers of this ``window``. ``decode_lens``: each decode row's length
    (its position + 1); ``spans``: each prefill chunk's (p0, p1) positions, in ``b.prefills``'
    order; ``rot``: the sliding layers' rotary tables when they differ from ``b``'s."""
    cos, sin = rot if rot is not None else (b.rot_cos, b.rot_sin)
    gather = bias = None
    if decode_lens:
        assert b.decode_gather is not None  # decode rows always have their gather
        dev = b.decode_gather.device
        lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)  # [B]
        first = (lens - window).clamp_(min=0)  # [B]
        width = min(max(decode_lens), window)
        pos = first[:, None] + torch.arange(width, device=dev)[None, :]  # [B, W]
        pad = pos >= lens[:, None]
        gather = b.decode_gather.gather(1, pos.clamp(max=b.decode_gather.shape[1] - 1))
        if bool(pad.any()):
            bias = torch.zeros(pad.shape, dtype=torch.float32, device=dev)
            bias = bias.masked_fill_(pad, float("-inf"))[:, None, None, :]  # [B, 1, 1, W]
    chunks = []
    for c, (p0, p1) in zip(b.prefills, spans):
        k0 = max(0, p0 - window + 1)  # the first key any query of the chunk reads
        mask = None
        if p0 or p1 > window:
            dev = c.gather.device
            q_pos = torch.arange(p0, p1, device=dev)[:, None]
            k_pos = torch.arange(k0, p1, device=dev)[None, :]
            mask = ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]  # [1, 1, C, T]
        chunks.append(PrefillChunk(c.start, c.end, c.gather[k0:p1], mask, c.slot, c.fresh, windowed=True))
    return StepBatch(
        cos, sin, b.slot_mapping, b.n_decode, gather, bias, chunks, b.decode_slots, b.decode_slot_run
    )
