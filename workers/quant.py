"""Weight-only quantization of the linear layers, applied after load.

- ``Int8Linear``: each output row gets one scale (absmax / 127), so a [N, K] bf16 weight becomes
  an int8 [N, K] matrix plus N scales: about half the bytes, and decode on a CPU is bound by
  bytes read. The CPU path uses ``torch._weight_int8pack_mm`` (int8 weights, bf16 activations)
  when K (in-features) is a multiple of ``INT8_KERNEL_K``; elsewhere, and for other K, the weight
  is widened per call, which keeps the memory saving if not the speed.
- ``Int4Linear`` (CPU only): every 32 weights of a row get a scale and a zero (4-bit affine
  groups, what GGUF's Q4_0 / Q4_1 / Q4_K blocks are), run by torch's int4 CPU kernel
  (``_weight_int4pack_mm_for_cpu``): about a quarter of bf16's bytes. Requantizing a 4-bit
  file's dequantized weights this way gives back its own levels, up to bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.core.sizing import INT4_GROUP, int4_fits

# torch's int8 CPU kernel (2.13, AVX-512) reads K in steps of 16 with no tail: probed in
# subprocesses over K = 8..4000, it is right for every multiple of 16 (16 included) and for no other
# K: wrong sums (K = 8, 24, 40, 136, ...) or a segfault (K = 12, 31, 100). N and M do not matter.
INT8_KERNEL_K = 16


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
        self.kernel = self.in_features % INT8_KERNEL_K == 0  # see INT8_KERNEL_K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]
        if self.kernel and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            y = torch._weight_int8pack_mm(x, self.weight, self.scale)  # pyright: ignore[reportPrivateImportUsage]  # the int8 CPU kernel
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    weight: torch.Tensor  # [N, K/2] uint8: two 4-bit levels a byte, in the kernel's packing
    scales_zeros: torch.Tensor  # [K/32, N, 2] bf16: each group's scale and zero
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        n, k = weight.shape
        if not int4_fits(n, k):
            raise ValueError(f"int4 needs N % 16 == 0 and K % {INT4_GROUP} == 0, got [{n}, {k}]")
        w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)  # [N, G, 32]
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, G]
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # the kernel's dequantization is (q - 8) * scale + zero
        zero = lo + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 1)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] bf16 -> [M, N]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias


def replace_linears(
    module: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
) -> None:
    """Swap every ``nn.Linear`` under ``module`` for ``make(weight, bias)``, in place (here, not
    in ``cpu_paths``, which imports this module: no import cycle)."""
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, make(sub.weight, sub.bias))


def quantize_int8(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` inside the decoder layers in place (the LM head stays).

    Used on CUDA dies; CPU dies reach the same layout through ``cpu_paths`` ("int8").
    """
    for layer in cast("Iterable[nn.Module]", model.layers):
        replace_linears(layer, Int8Linear)  # in the weights' own dtype
