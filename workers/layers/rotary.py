"""Rotary position embeddings: inverse frequencies for each ``rope_scaling`` type, the per-step
tables, and the rotation itself (whole heads, or the first ``rotary_dim`` dimensions of each head
for partial rotary embeddings, as Qwen3.5's attention layers have).

The formulas follow transformers' ``modeling_rope_utils`` so that our logits match theirs;
``dynamic`` NTK scaling depends on the sequence length, so it is recomputed per sequence chunk
from the chunk's last position, as transformers does for a single sequence.
"""

from __future__ import annotations

import functools
import math

import torch

from pantheon.core.description import ModelDescription as ModelConfig


def _base_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    # inv_freq: [dim / 2]
    return 1.0 / (
        base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
    )


def _llama3(cfg: ModelConfig, s: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", cfg.max_position_embeddings)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, s: dict, dim: int) -> tuple[torch.Tensor, float]:
    base = cfg.rope.theta
    orig = s.get("original_max_position_embeddings", cfg.max_position_embeddings)
    factor = s.get("factor") or cfg.max_position_embeddings / orig

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = float(mscale_of(factor, m) / mscale_of(factor, m_all)) if m and m_all else mscale_of(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a division by zero, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency kept unscaled (extrapolated)
    return inter * (1 - keep) + extra * keep, attn


def inv_freq_for(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim / 2] fp32, attention scaling) for this config.

    ``seq_len`` matters only for ``dynamic``: past ``max_position_embeddings`` the base grows.
    """
    dim, rope = cfg.rotary_dim, cfg.rope
    s = rope.scaling
    if rope.type == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if rope.type == "linear":
        return _base_inv_freq(rope.theta, dim) / s["factor"], 1.0
    if rope.type == "dynamic":
        max_pos = cfg.max_position_embeddings
        n = max(seq_len or max_pos, max_pos)
        base = rope.theta * ((s["factor"] * n / max_pos) - (s["factor"] - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope.type == "llama3":
        return _llama3(cfg, s, _base_inv_freq(rope.theta, dim)), 1.0
    if rope.type == "yarn":
        return _yarn(cfg, s, dim)
    raise ValueError(f"unknown rope type {rope.type!r}")


class Rotary:
    """cos/sin tables for positions, cached up to the longest position seen."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.dynamic = cfg.rope.type == "dynamic"
        inv_freq, self.scale = inv_freq_for(cfg)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None):
        """positions: [N] int64 -> cos, sin: [N, head_dim / 2] fp32 (attention scaling applied).

        For ``dynamic`` RoPE, ``seq_len`` is the sequence length the chunk reaches.
        """
        inv_freq = self.inv_freq
        if self.dynamic and seq_len is not None and seq_len > self.cfg.max_position_embeddings:
            inv_freq = inv_freq_for(self.cfg, seq_len)[0].to(self.device)
        freqs = torch.outer(positions.to(torch.float32), inv_freq)  # [N, D/2]
        if self.scale == 1.0:  # (all but YaRN): two multiplies by 1 less a step
            return freqs.cos(), freqs.sin()
        return freqs.cos() * self.scale, freqs.sin() * self.scale


def qk_tables(
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv: int,
    dtype: torch.dtype,
    head_dim: int = 0,
    q_scale: float | None = None,
):
    """The per-step rotary tables for q and k heads together, built once for all layers.

    cos, sin: [N, R/2] fp32 (R rotary dimensions) -> rot_cos, rot_sin: [N, H + KV, D] in
    ``dtype``, with the softmax scale 1/sqrt(D) folded into the q heads (rotation is linear, so
    scaling q before it is the same as scaling the scores after) and sin signed for
    ``rotate``'s swapped halves. With partial rotary embeddings (R < D, ``head_dim`` = D) the
    dimensions past R get cos 1 and sin 0: they pass through, scaled like the rest of q.
    ``q_scale`` replaces 1/sqrt(D) where a model says otherwise (Gemma 3's ``query_pre_attn_scalar``).
    """
    n, half = cos.shape
    d = head_dim or 2 * half
    c = torch.cat((cos, cos), dim=-1)  # [N, R]
    s = torch.cat((-sin, sin), dim=-1)
    if d > 2 * half:
        c = torch.cat((c, c.new_ones(n, d - 2 * half)), dim=-1)  # [N, D]
        s = torch.cat((s, s.new_zeros(n, d - 2 * half)), dim=-1)
    scale = _qk_scale(n_heads, n_kv, d**-0.5 if q_scale is None else q_scale, cos.device)
    return (c[:, None, :] * scale).to(dtype), (s[:, None, :] * scale).to(dtype)


@functools.cache
def _qk_scale(n_heads: int, n_kv: int, q_scale: float, device: torch.device) -> torch.Tensor:
    """[1, H + KV, 1] fp32: ``q_scale`` on the q heads, 1 on the k heads. Made once per shape and
    device, not each step: fewer ops a step, and a CUDA graph's capture (which refuses the
    host-to-device copy that making it costs) finds it made by the warm-up before."""
    return torch.tensor([q_scale] * n_heads + [1.0] * n_kv, dtype=torch.float32).view(1, -1, 1).to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int = 0) -> torch.Tensor:
    """RoPE in the rotate-half form HF checkpoints expect, in three ops.

    x: [N, H, D] (any strides: a view of the fused qkv output is fine); cos, sin_signed:
    [N, H, D] (``qk_tables``). rotate_half(x) * sin == swap_halves(x) * sin_signed, and swapping
    the two halves of D is a roll by D/2: one op, where a flip needs a view either side of it.
    With ``rotary_dim`` R < D only the first R dimensions swap; the rest meet sin 0.
    """
    n, h, d = x.shape
    r = rotary_dim or d
    if r == d:
        swapped = torch.roll(x, d // 2, dims=-1)
    else:
        swapped = torch.cat((torch.roll(x[..., :r], r // 2, dims=-1), x[..., r:]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)
