"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in): dequantized at load,
then on the bf16 CPU paths kept 4-bit in the int4 path's layout (``int4_from_fp4``).

A checkpoint stores a ``[..., R, C]`` matrix as ``*_blocks`` ``[..., R, C / 32, 16]`` uint8 (two
FP4 e2m1 values a byte: the low nibble is the even column, the high nibble the odd one) and
``*_scales`` ``[..., R, C / 32]`` uint8 (an e8m0 exponent per 32 values: the block's values are
multiplied by ``2 ** (scale - 127)``), as transformers' ``integrations/mxfp4.py`` reads them.
Every dequantized value (an FP4 level times a power of two) is exact in bf16 and fp32, so the
result does not depend on the dtype it is computed in.

Holding the experts (``pantheon.core.sizing.MXFP4_EXPERTS``, measured by
``bench/mxfp4_experts.py``; random Gaussian experts written as MXFP4, 2-core EPYC Zen 4):

- (a) int4 groups of 32 (``workers.quant.QuantExperts``, torch's int4 CPU kernel): MXFP4's blocks
  are 32 along K as the int4 groups are, but FP4's grid is not uniform, so the min/max grid
  loses ~8.8% (relative RMS against the dequantized weights); ``int4_from_fp4`` fits each
  block's grid to its FP4 values and loses ~4.7% (FP4 itself is ~12% from the floats it was
  made from). 0.625 bytes a weight (MXFP4: 0.53);
- (b) int8 rows from the dequantized values: ~0.9%, 1 byte a weight and a scale a row;
- (c) bf16, exact: 2 bytes a weight.

The logits (gpt-oss-20b's preset at hidden 1024, 2 layers, 32 experts top 4, 4 prompts' last
positions; the rest of the model bf16), against (c): (a) fitted 3.4% relative L2, cosine >= 0.9994,
top-1 4/4; (a) min/max 11.3%, 0.988, 3/4; (b) 6.1%, 0.993, 4/4 (random weights: a router's top-k
flips on small changes, so the logits' error is not monotonic in the weights'; the experts'
product errors are 4.7%, 8.8% and 0.7%). Speed, one token's 4 experts of a gpt-oss-20b layer at
one row, one thread of a loaded 2-core EPYC: (a) ~6-10x faster than bf16 prepacked, (b) ~1-1.4x.

The default is (a), fitted: the fastest, its logits close to the exact experts'. fp32 paths keep
the exact values (the int kernels take bf16 activations); ``quantize`` / the int8 path gives (b).
"""

from __future__ import annotations

import functools

import torch

from workers.quant import int4_pack

# the 16 e2m1 codes: sign bit, 2 exponent bits, 1 mantissa bit
FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[..., R, G, 16]`` uint8 blocks and ``[..., R, G]`` uint8 scales -> ``[..., R, 32 G]``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    lut = torch.tensor(FP4_LEVELS, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)  # [..., R, G, 16, 2]
    vals = vals.flatten(-2)  # [..., R, G, 32]: the low nibble first
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(vals, exp.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


# int4 grids tried for each block of FP4 values (in units of the block's scale): a step and the
# lowest level, -j * step with j in half steps (the kernel's 16 levels are lo + q * step).
_STEPS = (0.5, 0.625, 0.75, 0.875, 1.0)
_SIGNED = sorted(set(FP4_LEVELS))  # the 15 distinct values, -6 .. 6


# twice a magnitude (rounded, 0..12) -> the nearest FP4 magnitude's code (0..7: 0, 0.5, .., 6)
_MAG = torch.tensor((0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 7, 7))


@functools.cache
def _grids() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(step [C], lowest level [C], each FP4 value's int4 level [C, 15], its squared error
    [C, 15]) for every candidate grid C."""
    # lowest levels from -6.25 to -1 units: a block's largest magnitude is 4 or 6 units
    cands = [(t, -j / 2 * t) for t in _STEPS for j in range(31) if 1 <= j / 2 * t <= 6.25]
    step = torch.tensor([c[0] for c in cands])
    lo = torch.tensor([c[1] for c in cands])
    v = torch.tensor(_SIGNED)
    q = torch.round((v[None, :] - lo[:, None]) / step[:, None]).clamp(0, 15)
    err = (lo[:, None] + q * step[:, None] - v[None, :]) ** 2
    return step, lo, q, err


def int4_from_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight dequantized from MXFP4 -> the int4 kernel's (packed weight, scales_zeros)
    (``workers.quant.int4_pack``), each 32-value block (an MXFP4 block: both formats group 32
    along K) on the affine grid of 16 levels that holds its FP4 values best.

    FP4's grid is not uniform (0, 0.5, 1, 1.5, 2, 3, 4, 6 times the block's power of two), so
    the min/max grid of ``int4_groups`` (step 12/15: no level at 0) loses ~9% (relative RMS
    against the dequantized weights, random Gaussian experts); choosing per block among steps of
    0.5-1 FP4 units and offsets that keep 0 (least squares over the block's values, found from
    its histogram of 15 values against a table: no per-candidate pass over the weights) loses
    ~4.7%. Each block's values are recovered as FP4 codes from its largest magnitude (a power
    of two times 1 or 1.5: FP4's levels 4 or 6, or a level whose multiples stay on the grid);
    weights that are not MXFP4's are rounded to the nearest FP4 value first."""
    n, k = weight.shape
    g = k // BLOCK
    qs, scales, lows = [], [], []
    for rows in weight.detach().split(_CHUNK):  # a chunk's temporaries stay in the caches
        q, scale, low = _fit(rows.float().reshape(-1, BLOCK))
        qs.append(q)
        scales.append(scale)
        lows.append(low)
    return int4_pack(
        torch.cat(qs).reshape(n, k), torch.cat(scales).reshape(n, g), torch.cat(lows).reshape(n, g)
    )


# rows of a weight fitted at a time: temporaries of a few MB, and few enough parallel regions that
# their thread barriers do not dominate on a busy host (64 rows ran ~50x slower there than alone)
_CHUNK = 1024


def _fit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks [B, 32] -> (int4 levels [B, 32], step [B], lowest value [B]) of each one's grid."""
    amax = w.abs().amax(dim=1)
    top = torch.exp2(torch.floor(torch.log2(amax.clamp(min=1e-30))))
    unit = torch.where(amax / top == 1.0, amax / 4, amax / 6)  # FP4 level 4, else 6 is the largest
    unit = torch.where(amax > 0, unit, torch.ones_like(unit))
    # each value's FP4 code (its index in _SIGNED, 0..14) from twice its magnitude in units
    mag = _MAG[torch.round((w / unit[:, None]).abs() * 2).clamp(max=12).to(torch.int64)]
    idx = torch.where(w < 0, 7 - mag, 7 + mag)  # [B, 32]
    hist = torch.zeros(w.shape[0], len(_SIGNED)).scatter_add_(1, idx, torch.ones(idx.shape))
    step, lo, qtab, err = _grids()
    best = (hist @ err.t()).argmin(dim=1)  # [B]: the grid with the least squared error
    q = torch.take(qtab, best[:, None] * len(_SIGNED) + idx)  # [B, 32]
    return q, step[best] * unit, lo[best] * unit
