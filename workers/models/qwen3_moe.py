"""Qwen3-MoE (Qwen3-30B-A3B) in plain torch: the Llama family's Qwen3 attention (fused q/k/v,
per-head q/k RMSNorm) and, in its sparse layers, the shared mixture-of-experts block
(``workers/layers/moe.py``: softmax router, top-k, renormalised when ``norm_topk_prob``, experts
stacked ``[E, ...]`` and run per active expert); a dense SwiGLU MLP in ``mlp_only_layers``.
Description: ``pantheon/core/archs/qwen3_moe.py``.

Checkpoint names: the Hub's per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what
transformers 5 writes back too), transformers 5's fused ``mlp.experts.gate_up_proj`` /
``down_proj`` (``[E, 2I, H]`` / ``[E, H, I]``), and llama.cpp's ``qwen3moe`` GGUF names: the
merged ``ffn_{gate,up,down}_exps`` (or ``ffn_gate_up_exps``) and the router ``ffn_gate_inp``.
Stacked tensors are split into the per-expert targets at load (``stacked`` / ``unstack``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pantheon.core.archs.qwen3_moe import Qwen3MoeDescription
from pantheon.core.description import ModelDescription
from workers.cache import LayerCache
from workers.layers.attention import StepBatch
from workers.layers.mlp import GatedMLP
from workers.layers.moe import MoE
from workers.layers.norms import RMSNorm
from workers.models import Target
from workers.models import llama as _llama
from workers.models.base import DecoderLayer, DecoderLM
from workers.models.llama import Attention, attention_targets, gguf_name_from, mlp_targets, top_targets


class Qwen3MoeLayer(DecoderLayer):
    def __init__(self, cfg: Qwen3MoeDescription, sparse: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MoE | GatedMLP = (
            MoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
            )
            if sparse
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), b, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, Qwen3MoeDescription)
    layers: list[nn.Module] = [Qwen3MoeLayer(desc, s) for s in desc.sparse]
    norm = RMSNorm(desc.hidden_size, desc.rms_norm_eps)
    return DecoderLM(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)


# ---------------------------------------------------------------- checkpoint names


def moe_targets(t: dict[str, Target], p: str, moe: MoE, hidden: int) -> None:
    """The router, and each expert's gate / up / down (per-expert names) in the stacked rows."""
    i = moe.inter
    t[f"{p}mlp.gate.weight"] = Target(moe.gate.weight, 0, moe.num_experts)
    for e in range(moe.num_experts):
        x = f"{p}mlp.experts.{e}."
        t[f"{x}gate_proj.weight"] = Target(moe.gate_up[e], 0, i)
        t[f"{x}up_proj.weight"] = Target(moe.gate_up[e], i, i)
        t[f"{x}down_proj.weight"] = Target(moe.down[e], 0, hidden)


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name -> the parameter rows it fills (experts by their per-expert names)."""
    assert isinstance(desc, Qwen3MoeDescription)
    t = top_targets(model, desc)
    hidden = desc.hidden_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, Qwen3MoeLayer)
        p = f"model.layers.{i}."
        a = layer.self_attn
        attention_targets(t, p, a, desc, qkv_bias=desc.attention_bias, o_bias=desc.o_bias)
        assert a.q_norm is not None and a.k_norm is not None  # Qwen3's q/k norms
        t[f"{p}self_attn.q_norm.weight"] = Target(a.q_norm.weight, 0, desc.head_dim)
        t[f"{p}self_attn.k_norm.weight"] = Target(a.k_norm.weight, 0, desc.head_dim)
        if isinstance(layer.mlp, MoE):
            moe_targets(t, p, layer.mlp, hidden)
        else:
            mlp_targets(t, p, layer.mlp, hidden)
        t[f"{p}input_layernorm.weight"] = Target(layer.input_layernorm.weight, 0, hidden)
        t[f"{p}post_attention_layernorm.weight"] = Target(layer.post_attention_layernorm.weight, 0, hidden)
    return t


def checkpoint_name(name: str) -> str | None:
    return name


# Stacked expert tensors: transformers 5's fused names, and the GGUF merged ones (named so here).
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|gate_proj|up_proj|down_proj)")


def stacked(name: str) -> bool:
    return _STACKED.fullmatch(name) is not None


def unstack(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[E, ...]`` -> each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` (views):
    ``gate_up_proj`` ``[E, 2I, H]`` holds gate rows then up rows per expert."""
    m = _STACKED.fullmatch(name)
    assert m is not None  # the loader asks only for stacked() names
    prefix, kind = m.groups()
    if kind != "gate_up_proj":
        return [(f"{prefix}{e}.{kind}.weight", tensor[e]) for e in range(tensor.shape[0])]
    inter = tensor.shape[1] // 2
    out = []
    for e in range(tensor.shape[0]):
        out.append((f"{prefix}{e}.gate_proj.weight", tensor[e, :inter]))
        out.append((f"{prefix}{e}.up_proj.weight", tensor[e, inter:]))
    return out


GGUF_LAYER = _llama.GGUF_LAYER | {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
}


def gguf_name(name: str) -> str | None:
    return gguf_name_from(name, _llama.GGUF_TOP, GGUF_LAYER)


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """``qwen3moe`` files keep the Hugging Face row order (no q/k permutation)."""
    return tensor
