"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in), dequantized at load.

A checkpoint stores a ``[..., R, C]`` matrix as ``*_blocks`` ``[..., R, C / 32, 16]`` uint8 (two
FP4 e2m1 values a byte: the low nibble is the even column, the high nibble the odd one) and
``*_scales`` ``[..., R, C / 32]`` uint8 (an e8m0 exponent per 32 values: the block's values are
multiplied by ``2 ** (scale - 127)``), as transformers' ``integrations/mxfp4.py`` reads them.
Every dequantized value (an FP4 level times a power of two) is exact in bf16 and fp32, so the
result does not depend on the dtype it is computed in.
"""

from __future__ import annotations

import torch

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
