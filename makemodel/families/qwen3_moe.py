"""Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP in every layer (decoder_sparse_step
1, no mlp_only_layers): a router ``mlp.gate`` [E, H] and per-expert SwiGLU weights under the Hub's
names ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (transformers 5 fuses them on load and writes
them back so).
"""

from __future__ import annotations

from makemodel.families import llama
from makemodel.families.common import TINY_SHAPES
from makemodel.family import Family, TensorSpec
from makemodel.vocab import Vocabulary


def qwen3_moe_config(**shapes) -> dict:
    config = llama.qwen3_config(**shapes)
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        tie_word_embeddings=False,  # as Qwen3-30B-A3B
    )
    config.pop("max_window_layers", None)
    return dict(sorted(config.items()))


PRESETS: dict[str, dict] = {
    "tiny-qwen3-moe": qwen3_moe_config(
        **{**TINY_SHAPES, "num_hidden_layers": 3},
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    # Exactly Qwen3-30B-A3B's shapes (48 layers of 128 experts, 8 per token; tokenizer ours). The
    # decode benchmark cuts it to a few layers with num_hidden_layers.
    "qwen3-30b-a3b": qwen3_moe_config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
}


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Qwen3's tensors, with each sparse layer's MLP replaced by the router and the experts
    (per-expert names, as the Hub's checkpoints)."""
    from pantheon.core.archs.qwen3_moe import sparse_layers

    h, n = config["hidden_size"], config["num_hidden_layers"]
    experts, inter = config["num_experts"], config["moe_intermediate_size"]
    sparse = sparse_layers(config, "config", n, experts)
    specs = []
    for name, shape, kind in llama.tensor_specs({**config, "model_type": "qwen3"}):
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "mlp" and sparse[int(parts[2])]:
            if parts[4] == "gate_proj":  # the dense MLP's place: router, then the experts
                p = ".".join(parts[:4])
                specs.append((f"{p}.gate.weight", (experts, h), "normal"))
                for e in range(experts):
                    specs += [
                        (f"{p}.experts.{e}.gate_proj.weight", (inter, h), "normal"),
                        (f"{p}.experts.{e}.up_proj.weight", (inter, h), "normal"),
                        (f"{p}.experts.{e}.down_proj.weight", (h, inter), "normal"),
                    ]
            continue
        specs.append((name, shape, kind))
    return specs


FAMILY = Family(
    name="qwen3_moe",
    model_types=frozenset({"qwen3_moe"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=Vocabulary(),
    jittered=frozenset({"tiny-qwen3-moe"}),
)
