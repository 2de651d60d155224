"""int8 weight-only quantization of the linear layers, applied after load.

Each output row gets one scale (absmax / 127), so a [N, K] bf16 weight becomes an int8 [N, K]
matrix plus N scales: about half the bytes, and decode on a CPU is bound by bytes read. The
CPU path uses ``torch._weight_int8pack_mm`` (int8 weights, bf16 activations); elsewhere the
weight is widened per call, which keeps the memory saving if not the speed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    weight: torch.Tensor  # buffers, declared for the type checker (nn.Module's getattr is untyped)
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [N]
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            y = torch._weight_int8pack_mm(x, self.weight, self.scale)  # pyright: ignore[reportPrivateImportUsage]  # the int8 CPU kernel
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


def quantize_int8(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` inside the decoder layers in place (the LM head stays).

    Used on CUDA dies; CPU dies reach the same layout through ``cpu_paths`` ("int8").
    """
    from workers.cpu_paths import replace_linears

    for layer in cast("Iterable[nn.Module]", model.layers):
        replace_linears(layer, Int8Linear)  # in the weights' own dtype
