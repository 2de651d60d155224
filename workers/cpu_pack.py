"""Linear layers with weights prepacked for oneDNN, for decode on CPUs.

``F.linear`` on a plain [N, K] bf16 weight leaves oneDNN to re-layout or take a slow path
on every call; a weight reordered once at load into oneDNN's blocked layout streams at close
to memory bandwidth (on this machine ~26-32 GB/s against ~17 GB/s plain, see
bench/decode.py). The math is the same: results are bit-identical in bf16. Whether the
reorder works on a host is found by running it (``workers/cpu_paths.py``), never assumed.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held as an opaque oneDNN tensor. x: [M, K] -> [M, N]."""

    weight: torch.Tensor  # buffers, declared for the type checker
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._nbytes = weight.numel() * weight.element_size()

    @property
    def nbytes(self) -> int:
        return self._nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every weight under ``module``, prepacked ones included (their opaque tensors
    have no numel)."""
    total = 0
    for m in module.modules():
        if isinstance(m, PackedLinear):
            total += m.nbytes
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            total += t.numel() * t.element_size()
    return total
