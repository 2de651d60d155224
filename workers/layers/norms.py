"""RMS norms: the plain one (``w * x̂``, Llama), the zero-centred one (``x̂ * (1 + w)``, Qwen3.5
and Gemma, whose checkpoints store ``w`` around 0) and the gated one of Qwen3.5's linear-attention
layers (``workers/layers/gated_delta.py``: ``gated_rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> ``rsqrt(mean(x^2) + eps)``: [..., 1] fp32, in three ops: the norm is one
    fused fp32 reduction (mean of squares = norm^2 / D), and eps + norm^2 / D one addcmul on
    [..., 1]. (torch 2.13 has no fused RMS norm on CPUs: ``F.rms_norm`` and ``_fused_rms_norm``
    decompose into seven ops there.)"""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.addcmul(r.new_full((), eps), r, r, value=1.0 / x.shape[-1]).rsqrt_()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x̂`` as transformers' Llama norm: x̂ in fp32, cast back to x's dtype before the
    weight. x: [..., D]; weight: broadcasts against x ([D], or [H, D] for per-head weights)."""
    y = x * rms_scale(x, eps)  # fp32: x * r promotes x itself
    # fp32 activations need no cast (one op less a norm on the fp32 path)
    return weight * (y if y.dtype == x.dtype else y.to(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """``x̂ * (1 + w)`` with the product in fp32 before the cast, as transformers' Qwen3.5 norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * rms_scale(x, self.eps)) * (1.0 + self.weight.float())).to(x.dtype)
