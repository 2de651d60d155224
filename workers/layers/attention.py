"""Attention over the paged KV cache, and the step's batch description its layers read.

One forward call of a model takes a flat batch of N tokens: first one token for each decoding
sequence, then the tokens of the prefill chunks. Linear layers see all N rows at once (the weights
are read once per step, which is what decode speed on a CPU is bound by); attention runs once for
the decode rows together and once per prefill chunk. The runner builds one ``StepBatch`` per
device; each layer kind takes what it needs from it (attention: rotary tables, cache rows and
gathers; a recurrent layer: the slot of each row and where each prefill chunk starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flat batch."""

    start: int  # first row of the chunk in the flat batch
    end: int  # one past its last row
    gather: torch.Tensor  # [T] int64: cache rows of positions 0..T-1 of this sequence
    # [1, 1, C, T] bool (True = attend). None: plain causal over the gather's last C positions
    # after its first T - C (a paged chunk; ``paged_attention`` builds the mask only if it needs it)
    mask: torch.Tensor | None
    slot: int = 0  # the sequence's slot: where a recurrent layer keeps its state
    fresh: bool = True  # the chunk starts the sequence: recurrent states start from zero
    windowed: bool = False  # a sliding window's view: ``gather`` is the ring's history, ``mask`` bands it


@dataclass
class StepBatch:
    """Where each token's K/V goes and what each query attends to, on one device.

    The rotary tables cover q and k heads together (``[N, H + KV, D]``) and already hold the
    softmax scale on the q heads, so each layer rotates q and k in one pass and never scales
    its scores. ``rot_sin`` is signed for the swapped-halves form (``layers.rotary.rotate``).
    """

    rot_cos: torch.Tensor  # [N, H + KV, D]
    rot_sin: torch.Tensor  # [N, H + KV, D]: -sin on the first half of D, +sin on the second
    slot_mapping: torch.Tensor  # [N] int64: cache row that receives each token's K/V
    n_decode: int  # rows [0, n_decode) are one decode token per sequence
    decode_gather: torch.Tensor | None  # [B, T] int64 cache rows (padding points at row 0)
    decode_bias: torch.Tensor | None  # [B, 1, 1, T] fp32, -inf on padding; None when no row pads
    prefills: list[PrefillChunk]
    decode_slots: torch.Tensor | None = None  # [B] int64: each decode row's slot (recurrent layers)
    decode_slot_run: int | None = None  # when the decode slots are first, first + 1, ...: first
    # Sliding-window layers' views of this step, by window, in their rings' rows
    # (workers/layers/sliding.py: each query reads at most the window; the masks band it); the
    # rotary tables are the sliding layers' (Gemma 3's local base). Built by the runner.
    windows: dict[int, StepBatch] = field(default_factory=dict)

    def to(self, dev: torch.device) -> StepBatch:
        """The same batch description on another device (layers split across dies)."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dev, non_blocking=True)

        return StepBatch(
            self.rot_cos.to(dev, non_blocking=True),
            self.rot_sin.to(dev, non_blocking=True),
            self.slot_mapping.to(dev, non_blocking=True),
            self.n_decode,
            mv(self.decode_gather),
            mv(self.decode_bias),
            [
                PrefillChunk(c.start, c.end, c.gather.to(dev), mv(c.mask), c.slot, c.fresh, c.windowed)
                for c in self.prefills
            ],
            mv(self.decode_slots),
            self.decode_slot_run,
            {w: v.to(dev) for w, v in self.windows.items()},
        )


AttnBatch = StepBatch  # the name the attention code grew up with


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: StepBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Write the step's K/V into the cache, then attend. q: [N, H, D] (pre-scaled), k, v:
    [N, KV, D]; k_cache, v_cache: [rows, KV, D] -> [N, H, D]."""
    k_cache.index_copy_(0, b.slot_mapping, k)
    v_cache.index_copy_(0, b.slot_mapping, v)
    if not b.prefills:  # the pure decode step: no copy into a shared output
        return decode_attention(q, b, k_cache, v_cache)
    out = torch.empty_like(q)  # [N, H, D]
    if b.n_decode:
        out[: b.n_decode] = decode_attention(q[: b.n_decode], b, k_cache, v_cache)
    for c in b.prefills:
        qp = q[c.start : c.end]  # [C, H, D]
        hist = c.gather.shape[0] - (c.end - c.start)  # positions before the chunk
        if hist and c.mask is None and _SPLIT_OK.get(q.device.type, False):
            o = _prefill_split(qp, k[c.start : c.end], v[c.start : c.end], c.gather[:hist], k_cache, v_cache)
        else:
            if hist and c.mask is None:  # built once per step, then every layer's call reuses it
                c.mask = offset_causal_mask(hist, c.end - c.start, q.device)
            kk = k_cache.index_select(0, c.gather).transpose(0, 1).unsqueeze(0)  # [1, KV, T, D]
            vv = v_cache.index_select(0, c.gather).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp.transpose(0, 1).unsqueeze(0),  # [1, H, C, D]
                kk,
                vv,
                attn_mask=c.mask,
                is_causal=c.mask is None,
                enable_gqa=True,
                scale=1.0,
            )[0].transpose(0, 1)
        out[c.start : c.end] = o
    return out


def offset_causal_mask(hist: int, n: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, hist + n] bool: query row i (position hist + i) sees keys 0..hist + i."""
    q_pos = torch.arange(hist, hist + n, device=device)[:, None]
    return (torch.arange(hist + n, device=device)[None, :] <= q_pos)[None, None]


# Devices where a prefill chunk after cached history attends in two parts (``_prefill_split``):
# the CPU, whose fused SDPA kernel returns the log-sum-exp the merge needs. Elsewhere the one
# masked call serves.
_SPLIT_OK = {"cpu": hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")}


def _prefill_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hist: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Attention of a prefill chunk that follows ``P`` cached positions, in two parts merged by
    their log-sum-exp: every query sees all of the history (no mask), and the chunk's own keys
    causally. q: [C, H, D] (pre-scaled); k, v: [C, KV, D], the chunk's own (just written to the
    cache); hist: [P] cache rows of the history -> [C, H, D].

    The one-call form needs a [C, P + C] boolean mask, which SDPA turns into a float bias the
    fused CPU kernel reads block by block (a fifth of the call at 8k positions, on SmolLM2), and
    it gathers and attends to the whole sequence with grouped heads expanded. Here the history
    part folds each group's query heads into the query rows (the kernel sees KV heads and G * C
    queries, so the history's K/V are never repeated), only the history is gathered, and the
    chunk part is the kernel's causal case.

    Both parts run in fp32 and are merged there, so the result is rounded to the model's dtype
    once, like the one-call form's: with each bf16 half rounded before the merge, SmolLM2's
    greedy answer to a prefix-cached prompt differed from the uncached one. On the CPU the fp32
    kernel is as fast as the bf16 one (both accumulate in fp32); the casts are of [P, KV, D].
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    c, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    f32 = torch.float32
    # History: [1, KV, G * C, D] queries (group-major) against [1, KV, P, D] keys.
    qh = q.to(f32).view(c, kv, g, d).permute(1, 2, 0, 3).reshape(1, kv, g * c, d)
    kh = k_cache.index_select(0, hist).to(f32).transpose(0, 1).unsqueeze(0)
    vh = v_cache.index_select(0, hist).to(f32).transpose(0, 1).unsqueeze(0)
    o1, l1 = flash(qh, kh, vh, 0.0, False, scale=1.0)  # [1, KV, G*C, D], [1, KV, G*C]
    o1 = o1.reshape(h, c, d)
    l1 = l1.reshape(h, c, 1)
    # The chunk itself, causal; its K/V heads repeated for the group (C rows only).
    kc = k.to(f32).repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)  # [1, H, C, D]
    vc = v.to(f32).repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
    o2, l2 = flash(q.to(f32).transpose(0, 1).unsqueeze(0), kc, vc, 0.0, True, scale=1.0)
    o2 = o2.reshape(h, c, d)
    l2 = l2.reshape(h, c, 1)
    # o = (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2) = o2 + (o1 - o2) * sigmoid(l1 - l2)
    w1 = torch.sigmoid(l1 - l2)
    o = torch.lerp(o2, o1, w1)
    return o.to(q.dtype).transpose(0, 1)  # [C, H, D]


def decode_attention(
    q: torch.Tensor, b: StepBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """One (pre-scaled) query per sequence against its cached keys. q: [B, H, D] -> [B, H, D].

    Plain matmuls rather than SDPA: with one query row the fused CPU kernel's setup costs
    more than the arithmetic. Grouped heads share their K/V without copying them.
    """
    assert b.decode_gather is not None  # a batch with decode rows has its gather
    bsz, h, d = q.shape
    kv = k_cache.shape[1]
    flat = b.decode_gather.reshape(-1)  # index_select: several times faster than k_cache[gather]
    t = b.decode_gather.shape[1]
    k = k_cache.index_select(0, flat).view(bsz, t, kv, d).transpose(1, 2)  # [B, KV, T, D]
    v = v_cache.index_select(0, flat).view(bsz, t, kv, d).transpose(1, 2)
    qg = q.reshape(bsz, kv, h // kv, d)  # [B, KV, G, D]
    scores = torch.matmul(qg, k.transpose(2, 3))  # [B, KV, G, T]
    if b.decode_bias is not None:
        scores = scores + b.decode_bias  # fp32 from here; bias: [B, 1, 1, T]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).view(bsz, h, d)  # [B, KV, G, D]
