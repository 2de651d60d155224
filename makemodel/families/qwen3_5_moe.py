"""Qwen3.5-MoE (Qwen3.6-35B-A3B): Qwen3.5's hybrid layers with a mixture of experts as every
layer's MLP (no dense MLP, no intermediate_size): num_experts routed experts, top
num_experts_per_tok renormalised, and a shared expert behind a sigmoid gate. Hub layout:
Qwen3_5MoeForConditionalGeneration, experts fused (mlp.experts.gate_up_proj [E, 2I, H],
mlp.experts.down_proj [E, H, I]). Tokenizer and override rules are Qwen3.5's.
"""

from __future__ import annotations

from makemodel.families import qwen3_5
from makemodel.families.common import TINY_VOCAB
from makemodel.family import Family, TensorSpec


def text_model(**shapes) -> dict:
    moe = {k: shapes.pop(k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    shared = shapes.pop("shared_expert_intermediate_size")
    config = qwen3_5.text_model(intermediate_size=0, **shapes)
    del config["intermediate_size"]
    config.update(
        model_type="qwen3_5_moe_text",
        shared_expert_intermediate_size=shared,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        **moe,
    )
    return dict(sorted(config.items()))


def vlm(text: dict, vision: dict) -> dict:
    config = qwen3_5.vlm(text, dict(vision, model_type="qwen3_5_moe_vision"))
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    return config


_TINY_TEXT = text_model(
    hidden_size=64,
    num_hidden_layers=4,  # linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=4096,
    tie_word_embeddings=False,  # as Qwen3.6-35B-A3B
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

PRESETS: dict[str, dict] = {
    # Tiny, as the Hub ships Qwen3.6-35B-A3B: 3 DeltaNet layers + 1 full attention, 8 experts (top 2)
    # and a shared expert in each, a 2-block vision tower, one MTP layer, untied head (as the 35B).
    "tiny-qwen3.5-moe": vlm(
        _TINY_TEXT,
        qwen3_5.vision_model(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            num_position_embeddings=64,
            out_hidden_size=_TINY_TEXT["hidden_size"],
        ),
    ),
    # Exactly Qwen3.6-35B-A3B's text shapes (40 layers of 256 experts, 8 per token, plus a shared
    # expert; tokenizer ours), text only: the decode benchmark cuts it to a few layers.
    "qwen3.6-35b-a3b-text": dict(
        architectures=["Qwen3_5MoeForCausalLM"],
        torch_dtype="bfloat16",
        **text_model(
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            vocab_size=248320,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        ),
    ),
}


def moe_mlp(t: dict) -> list[TensorSpec]:
    """Router, fused experts (as the Hub's), shared expert."""
    h = t["hidden_size"]
    e, mi, si = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    return [
        ("mlp.experts.down_proj", (e, h, mi), "normal"),
        ("mlp.experts.gate_up_proj", (e, 2 * mi, h), "normal"),
        ("mlp.gate.weight", (e, h), "normal"),
        ("mlp.shared_expert.down_proj.weight", (h, si), "normal"),
        ("mlp.shared_expert.gate_proj.weight", (si, h), "normal"),
        ("mlp.shared_expert.up_proj.weight", (si, h), "normal"),
        ("mlp.shared_expert_gate.weight", (1, h), "normal"),
    ]


def tensor_specs(config: dict) -> list[TensorSpec]:
    return qwen3_5.tensor_specs(config, mlp=moe_mlp)


FAMILY = Family(
    name="qwen3_5_moe",
    model_types=frozenset({"qwen3_5_moe", "qwen3_5_moe_text"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=qwen3_5.TOKENIZER,
    jittered=frozenset({"tiny-qwen3.5-moe"}),
    follow_overrides=qwen3_5.follow_overrides,
)
