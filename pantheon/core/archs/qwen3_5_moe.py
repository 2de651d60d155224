"""Qwen3.5-MoE / Qwen3.6-MoE (Qwen3.6-35B-A3B: ``Qwen3_5MoeForConditionalGeneration``, and the text-only
``Qwen3_5MoeForCausalLM``): Qwen3.5's hybrid layers (``pantheon/core/archs/qwen3_5.py``: Gated
DeltaNet and gated full attention) with a mixture-of-experts MLP in every layer: ``num_experts``
routed SwiGLU experts of ``moe_intermediate_size`` (softmax over all, top ``num_experts_per_tok``,
always renormalised) plus a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid
gate. Torch side: ``workers/models/qwen3_5_moe.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.archs import qwen3_5 as _qwen35
from pantheon.core.archs.qwen3_5 import Qwen35Description, text_config
from pantheon.core.description import ExpertSpec, ModelError, pos_int
from pantheon.core.gguf import GGUFFile, _field


@dataclass(frozen=True, kw_only=True)
class Qwen35MoeDescription(Qwen35Description):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # ``intermediate_size`` is the same (the shared expert's)


def describe(raw: dict, gen: dict, where: str, arch: str) -> Qwen35MoeDescription:
    t = text_config(raw)
    experts = pos_int(t, "num_experts", where)
    top_k = pos_int(t, "num_experts_per_tok", where)
    if top_k > experts:
        raise ModelError("invalid", f"{where}: num_experts_per_tok {top_k} exceeds num_experts {experts}")
    moe_inter = pos_int(t, "moe_intermediate_size", where)
    shared = pos_int(t, "shared_expert_intermediate_size", where)
    # Qwen3.5's description with its dense MLP sized as the shared expert: the same two linears
    inner = dict(t, intermediate_size=shared)
    base = _qwen35.describe(
        {**raw, "text_config": inner} if "text_config" in raw else inner, gen, where, arch
    )
    h = base.hidden_size
    moe = ExpertSpec(count=experts, top_k=top_k, intermediate=moe_inter, hidden=h)
    layers = tuple(
        # the shared expert's gate a linear; the router dense on every path
        dataclasses.replace(s, linears=(*s.linears, (1, h)), small=s.small + experts * h, experts=moe)
        for s in base.layers
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(family="qwen3_5_moe", layers=layers)
    return Qwen35MoeDescription(
        **fields,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared,
    )


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``qwen35moe`` file: ``qwen35``'s fields (``qwen3_5.gguf_config``) and the experts'."""
    _qwen35.gguf_config(g, raw)
    a = g.arch
    raw.update(
        num_experts=_field(g, f"{a}.expert_count"),
        num_experts_per_tok=_field(g, f"{a}.expert_used_count"),
        moe_intermediate_size=_field(g, f"{a}.expert_feed_forward_length"),
        shared_expert_intermediate_size=_field(g, f"{a}.expert_shared_feed_forward_length"),
    )


FAMILY = Family(
    name="qwen3_5_moe",
    hf_architectures={
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    },
    model_types={"qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"},
    gguf_architectures={"qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")},
    describe=describe,
    gguf_config=gguf_config,
)
