"""Linear layers with weights prepacked for oneDNN, for decode on CPUs.

``F.linear`` on a plain [N, K] bf16 weight leaves oneDNN to re-layout or take a slow path
on every call; a weight reordered once at load into oneDNN's blocked layout streams at close
to memory bandwidth (on this machine ~26-32 GB/s against ~17 GB/s plain, see
bench/decode.py). The math is the same: results are bit-identical in bf16.
"""

from __future__ import annotations

import torch
from torch import nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held as an opaque oneDNN tensor. x: [M, K] -> [M, N]."""

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


def pack_model(model: nn.Module) -> None:
    """Replace each CPU ``nn.Linear`` of the decoder layers in place; pack the LM head too.

    With tied embeddings the embedding table stays plain for lookups and the head gets its own
    packed copy: more memory, but the head is a quarter of the bytes read per step at 0.6B.
    """
    for layer, dev in zip(model.layers, model.layer_devices):
        if dev.type != "cpu":
            continue
        for child in list(layer.modules()):
            for attr, sub in list(child.named_children()):
                if isinstance(sub, nn.Linear) and sub.weight.dtype in (torch.bfloat16, torch.float32):
                    setattr(child, attr, PackedLinear(sub.weight, sub.bias))
    head = model.head_weight()
    if head.device.type == "cpu" and head.dtype in (torch.bfloat16, torch.float32):
        model.packed_head = PackedLinear(head, None)
