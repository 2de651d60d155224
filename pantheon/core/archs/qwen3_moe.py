"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B: ``Qwen3MoeForCausalLM``): Qwen3's attention (per-head
q/k RMSNorm, no biases unless ``attention_bias``) with a mixture-of-experts MLP: ``num_experts``
SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token, routed by a softmax
over all experts then the top k (renormalised when ``norm_topk_prob``). A layer in
``mlp_only_layers``, or off the ``decoder_sparse_step`` schedule, has a dense MLP of
``intermediate_size``. Torch side: ``workers/models/qwen3_moe.py``; the MoE block:
``workers/layers/moe.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.archs.llama import LlamaDescription, attention_head_shape
from pantheon.core.description import (
    AttentionCache,
    ExpertSpec,
    LayerSpec,
    ModelError,
    decoder_fields,
    pos_int,
)
from pantheon.core.gguf import GGUFFile, _field


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeDescription(LlamaDescription):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse: tuple[bool, ...]  # per layer: a mixture of experts (True) or a dense MLP


def sparse_layers(raw: dict, where: str, n: int, experts: int) -> list[bool]:
    """transformers' schedule: layer i is sparse unless in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0``."""
    step = pos_int(raw, "decoder_sparse_step", where, default=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ModelError("invalid", f"{where}: mlp_only_layers must list layer indices, got {only!r}")
    return [experts > 0 and i not in only and (i + 1) % step == 0 for i in range(n)]


def describe(raw: dict, gen: dict, where: str, arch: str) -> Qwen3MoeDescription:
    window = raw.get("sliding_window")
    if window is not None and raw.get("use_sliding_window", False):
        raise ModelError(
            "unsupported", f"{where}: sliding_window {window} (sliding-window attention) is not supported"
        )
    hidden, heads, kv_heads, head_dim = attention_head_shape(raw, where)
    n = pos_int(raw, "num_hidden_layers", where)
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    experts = pos_int(raw, key, where)
    top_k = pos_int(raw, "num_experts_per_tok", where)
    if top_k > experts:
        raise ModelError("invalid", f"{where}: num_experts_per_tok {top_k} exceeds {key} {experts}")
    moe_inter = pos_int(raw, "moe_intermediate_size", where)
    inter = pos_int(raw, "intermediate_size", where, default=moe_inter)
    sparse = sparse_layers(raw, where, n, experts)
    bias = bool(raw.get("attention_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = ((q + 2 * kv, hidden), (hidden, q))
    small = 2 * hidden + 2 * head_dim + ((q + 2 * kv + hidden) if bias else 0)
    cache = AttentionCache(kv_heads, head_dim)
    moe = LayerSpec(
        kind="attention",
        linears=attn,  # the experts are stacked; the router stays dense (workers/layers/moe.py's Router)
        small=small + experts * hidden,
        cache=cache,
        experts=ExpertSpec(count=experts, top_k=top_k, intermediate=moe_inter, hidden=hidden),
    )
    dense = LayerSpec(
        kind="attention", linears=(*attn, (2 * inter, hidden), (hidden, inter)), small=small, cache=cache
    )
    fields = decoder_fields(
        raw, gen, where, head_shape=(hidden, heads, kv_heads, head_dim), default_context=32768
    )
    fields["intermediate_size"] = inter
    return Qwen3MoeDescription(
        family="qwen3_moe",
        arch=arch,
        **fields,
        layers=tuple(moe if s else dense for s in sparse),
        attention_bias=bias,
        o_bias=bias,
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse=tuple(sparse),
    )


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``qwen3moe`` GGUF file's expert fields. llama.cpp runs every layer as a mixture of
    experts and always renormalises the top-k weights (its ``qwen3moe`` graph), so the file
    means ``norm_topk_prob``."""
    a = g.arch
    raw.update(
        num_experts=_field(g, f"{a}.expert_count"),
        num_experts_per_tok=_field(g, f"{a}.expert_used_count"),
        moe_intermediate_size=_field(g, f"{a}.expert_feed_forward_length"),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures={"Qwen3MoeForCausalLM": "qwen3_moe"},
    model_types={"qwen3_moe": "qwen3_moe"},
    gguf_architectures={"qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")},
    describe=describe,
    gguf_config=gguf_config,
)
