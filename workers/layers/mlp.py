"""The dense gated MLP every family runs: ``down(act(gate x) * up x)`` with gate and up fused into
one matrix ``gate_up_proj`` [2I, H] (gate rows first), so a step does one product for both.

``act``: SwiGLU's ``silu`` (Llama, Qwen, a mixture of experts' shared expert) or GeGLU's tanh
``gelu`` (Gemma 3 and 4). The CPU paths lay the two linears out (``workers/cpu_paths.py``) and the
fused decode layer reads them by these names (``workers/layers/decode_layer.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SILU = "silu"
GELU_TANH = "gelu_tanh"


class GatedMLP(nn.Module):
    """x [N, H] -> [N, H]: ``down(act(gate x) * up x)``, gate and up fused."""

    def __init__(self, hidden: int, inter: int, act: str = SILU):
        super().__init__()
        if act not in (SILU, GELU_TANH):
            raise ValueError(f"unknown MLP activation {act!r}")
        self.inter = inter
        self.gelu = act == GELU_TANH
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, I] each: one split, not two slices
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)
