"""Qwen3.5-MoE / Qwen3.6-MoE (Qwen3.6-35B-A3B) in plain torch: Qwen3.5's hybrid layers
(``workers/models/qwen3_5.py``) with the shared mixture-of-experts block (``workers/layers/moe.py``)
as every layer's MLP: softmax router, top k renormalised, stacked experts run per active expert,
and a shared expert behind a sigmoid gate. Description: ``pantheon/core/archs/qwen3_5_moe.py``.

Checkpoint names: the text model's (``model.language_model.*`` in the Hub's multimodal layout,
vision tower and MTP head skipped as for Qwen3.5), experts either fused as transformers 5 and the
Hub store them (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) or
per expert; ``mlp.gate`` (router), ``mlp.shared_expert.{gate,up,down}_proj``,
``mlp.shared_expert_gate``. GGUF: llama.cpp's ``qwen35moe``: ``qwen35``'s names and
transformations plus ``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``, ``ffn_{gate,up,down}_shexp``
and ``ffn_gate_inp_shexp``.
"""

from __future__ import annotations

import torch
from torch import nn

from pantheon.core.archs.qwen3_5_moe import Qwen35MoeDescription
from pantheon.core.description import ModelDescription
from workers.layers.moe import MoE
from workers.layers.norms import ZeroCenteredRMSNorm
from workers.models import Target
from workers.models import qwen3_5 as _qwen35
from workers.models import qwen3_moe as _qwen3_moe
from workers.models.base import DecoderLM
from workers.models.llama import GGUF_TOP, gguf_name_from
from workers.models.qwen3_5 import Qwen35Layer


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, Qwen35MoeDescription)

    def moe() -> MoE:
        return MoE(
            desc.hidden_size,
            desc.moe_intermediate_size,
            desc.num_experts,
            desc.num_experts_per_tok,
            norm_topk_prob=True,
            shared_inter=desc.shared_expert_intermediate_size,
        )

    layers: list[nn.Module] = [Qwen35Layer(desc, t, moe()) for t in desc.layer_types]
    norm = ZeroCenteredRMSNorm(desc.hidden_size, desc.rms_norm_eps)
    return DecoderLM(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Qwen3.5's targets, plus each layer's router, experts (per-expert names), shared expert and
    its gate."""
    t = _qwen35.targets(model, desc)
    hidden = desc.hidden_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, Qwen35Layer) and isinstance(layer.mlp, MoE)
        p = f"model.layers.{i}."
        m = layer.mlp
        _qwen3_moe.moe_targets(t, p, m, hidden)
        assert m.shared_expert is not None and m.shared_expert_gate is not None
        s = m.shared_expert
        t[f"{p}mlp.shared_expert.gate_proj.weight"] = Target(s.gate_up_proj.weight, 0, s.inter)
        t[f"{p}mlp.shared_expert.up_proj.weight"] = Target(s.gate_up_proj.weight, s.inter, s.inter)
        t[f"{p}mlp.shared_expert.down_proj.weight"] = Target(s.down_proj.weight, 0, hidden)
        t[f"{p}mlp.shared_expert_gate.weight"] = Target(m.shared_expert_gate.weight, 0, 1)
    return t


checkpoint_name = _qwen35.checkpoint_name
stacked = _qwen3_moe.stacked
unstack = _qwen3_moe.unstack

GGUF_LAYER = _qwen35.GGUF_LAYER | {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}


def gguf_name(name: str) -> str | None:
    if _qwen35._NEXTN.fullmatch(name):
        return "mtp." + name  # the multi-token-prediction head's own tensors: read by workers/mtp.py only
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER)


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """``qwen35``'s transformations undone (``qwen3_5.from_gguf``); the shared expert's gate, a
    ``[1, H]`` matrix, may be stored as a vector."""
    if name.endswith("mlp.shared_expert_gate.weight") and tensor.dim() == 1:
        return tensor.unsqueeze(0)
    return _qwen35.from_gguf(name, tensor, desc, arch)
