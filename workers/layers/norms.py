"""RMS norms: the plain one (``w * x̂``, Llama), the zero-centred one (``x̂ * (1 + w)``, Qwen3.5
and Gemma, whose checkpoints store ``w`` around 0) and the gated one of Qwen3.5's linear-attention
layers (``workers/layers/gated_delta.py``: ``gated_rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 and cast back before the weight, as transformers does it, in six ops: the
        # norm is one fused fp32 reduction (mean of squares = norm^2 / dim), the rsqrt of
        # eps + norm^2 / dim is an addcmul on [N, 1], and x * r promotes x to fp32 itself.
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        r = torch.addcmul(r.new_full((), self.eps), r, r, value=1.0 / x.shape[-1]).rsqrt_()
        return self.weight * (x * r).to(x.dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """``x̂ * (1 + w)`` with the product in fp32 before the cast, as transformers' Qwen3.5 norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        r = torch.addcmul(r.new_full((), self.eps), r, r, value=1.0 / x.shape[-1]).rsqrt_()
        return ((x * r) * (1.0 + self.weight.float())).to(x.dtype)
