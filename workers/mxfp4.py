"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in), held as they are and
multiplied by our kernel (``workers/kernels/qmatmul.c``'s ``qm_mxfp4_linear``).

A checkpoint stores a ``[..., R, C]`` matrix as ``*_blocks`` ``[..., R, C / 32, 16]`` uint8 (two
FP4 e2m1 values a byte: the low nibble is the even column, the high nibble the odd one) and
``*_scales`` ``[..., R, C / 32]`` uint8 (an e8m0 exponent per 32 values: the block's values are
multiplied by ``2 ** (scale - 127)``), as transformers' ``integrations/mxfp4.py`` reads them.
llama.cpp's converter keeps them so in a GGUF (``MXFP4`` blocks: the exponent byte, then 16 bytes
whose low nibbles are values 0-15 and high nibbles 16-31). Every dequantized value (an FP4 level
times a power of two) is exact in bf16 and fp32, so the result does not depend on the dtype it is
computed in.

Held (``MxExperts``): each block's codes in ggml's order (``from_hub`` reorders the Hub's nibbles,
a permutation: no value changes) and its exponent, 17 bytes a block of 32 (0.53 bytes a weight,
against int4 groups' 0.625 and bf16's 2). The kernel looks the codes up in a 16-entry table (as
llama.cpp's MXFP4 dot product) and multiplies them by the activations as they are (fp32): the
dequantized experts' product up to the order of the sums, on every CPU path and every ISA build.
CUDA dies dequantize them at load (``MoE.unpack_mxfp4``), where no kernel reads them.

Before (``bench/mxfp4_experts.py`` still runs it as the baseline): the bf16 paths refitted the
dequantized experts into int4 groups (``int4_from_fp4``: each block's affine grid fitted to its
FP4 values, ~4.7% relative RMS from the exact weights; ~20 minutes a thread to fit a real 20b)
after a full bf16 load. Measured there (gpt-oss-20b's preset at hidden 1024, 2 layers, bf16-packed
path, 2-core EPYC Zen 4 shared with other work, decode timings interleaved): logits against the
bf16 experts' 0.17% relative L2 (the kernel's fp32 products against bf16's rounding; int4-fitted
3.4%), decode 1.13x the fitted path's tok/s and 2.0x bf16's, 13 MB of experts read a step (16,
50), load 8 s (121 s with the fit).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from workers.kernels import qlinear
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


def from_hub(blocks: torch.Tensor) -> torch.Tensor:
    """The Hub's ``[..., G, 16]`` blocks (byte j: values 2j low, 2j + 1 high) -> the kernel's
    ``[..., G * 16]`` (byte j: values j low, j + 16 high, ggml's order): the same codes."""
    b = blocks.to(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [..., G, 32] in order
    return (codes[..., :16] | (codes[..., 16:] << 4)).flatten(-2)


def dequantize_held(qs: torch.Tensor, e: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernel's ``qs [..., R, C / 2]`` and ``e [..., R, C / 32]`` -> ``[..., R, C]``."""
    b = qs.reshape(*qs.shape[:-1], -1, BLOCK // 2)  # [..., R, G, 16]
    lut = torch.tensor(FP4_LEVELS, dtype=torch.float32, device=qs.device)
    vals = torch.cat((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)  # [..., R, G, 32]
    return torch.ldexp(vals, (e.to(torch.int32) - 127).unsqueeze(-1)).flatten(-2).to(dtype)


class MxExperts(nn.Module):
    """``E`` stacked ``[N, K]`` matrices in MXFP4, as the file holds them (``qs`` [E, N, K/2]
    uint8 in ggml's nibble order, ``e`` [E, N, K/32] uint8 exponents), filled by the loader
    expert by expert. ``experts[e](x)``: x [M, K] (fp32 or bf16) -> [M, N] in x's dtype, by
    ``qlinear.mxfp4_linear`` (exact: the dequantized weight's product), reading only expert
    ``e``'s bytes; where the kernel is not built, by that expert dequantized for the call (the
    same values, slowly: a host without a C compiler)."""

    qs: torch.Tensor
    e: torch.Tensor

    def __init__(self, num_experts: int, n: int, k: int):
        super().__init__()
        if k % BLOCK:
            raise ValueError(f"MXFP4 matrices have whole blocks of {BLOCK} along K, got K = {k}")
        self.num_experts, self.out_features, self.in_features = num_experts, n, k
        self.register_buffer("qs", torch.empty(num_experts, n, k // 2, dtype=torch.uint8))
        self.register_buffer("e", torch.empty(num_experts, n, k // BLOCK, dtype=torch.uint8))
        self.kernel = qlinear.fits(k) and qlinear.available()

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, e: int):
        return lambda x: self.mm(e, x)

    def mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ expert ``e``'s [N, K]^T -> [M, N]."""
        if self.kernel and x.device.type == "cpu":
            return qlinear.mxfp4_linear_op(x, self.qs[e], self.e[e])
        return torch.nn.functional.linear(x, dequantize_held(self.qs[e], self.e[e], x.dtype))

    def stack(self) -> qlinear.Stack | None:
        """The stack as ``qlinear.experts`` takes it, when the kernel is built."""
        return qlinear.Stack("mxfp4", self.qs, self.e) if self.kernel else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's matrix, ``[E, N, K]`` in ``dtype`` (exact), one expert at a time."""
        out = torch.empty(
            self.num_experts, self.out_features, self.in_features, dtype=dtype, device=self.qs.device
        )
        for i in range(self.num_experts):
            out[i] = dequantize_held(self.qs[i], self.e[i], dtype)
        return out

    def expert_bytes(self) -> int:
        """Bytes of one expert's matrix as held (its codes and exponents)."""
        return self.qs[0].numel() + self.e[0].numel()


# The former holding (the baseline bench/mxfp4_experts.py measures the kernel against): int4
# grids tried for each block of FP4 values (in units of the block's scale): a step and the
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
