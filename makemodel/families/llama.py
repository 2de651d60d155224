"""The Llama family: Llama (no biases), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm), the
timing presets with real models' shapes, and a Qwen3 embedding model.

tiny-qwen3-embedding is a Qwen3 decoder with last-token pooling and normalisation, as
Qwen3-Embedding (and trained for Matryoshka sizes), in the sentence-transformers layout.
"""

from __future__ import annotations

from makemodel.families.common import IDS, TINY_SHAPES
from makemodel.family import Family, TensorSpec
from makemodel.vocab import Vocabulary

COMMON = dict(
    attention_dropout=0.0,
    hidden_act="silu",
    initializer_range=0.02,
    rope_scaling=None,
    torch_dtype="bfloat16",
    use_cache=True,
    **IDS,
)


def llama_config(*, rope_theta: float, tie_word_embeddings: bool, **shapes) -> dict:
    """A Llama config: no biases; ``shapes`` (and any key of ``COMMON`` they override, such
    as ``rope_scaling``) after the common keys."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        **COMMON,
        **shapes,
    }


def qwen3_config(**shapes) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        attention_bias=False,
        max_window_layers=shapes["num_hidden_layers"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **COMMON,
        **shapes,
    )


PRESETS: dict[str, dict] = {
    # Qwen3 architecture: per-head RMSNorm on q and k, no biases, tied embeddings.
    "tiny": qwen3_config(**TINY_SHAPES),
    # Llama: untied lm_head, no biases.
    "tiny-llama": llama_config(rope_theta=500000.0, tie_word_embeddings=False, **TINY_SHAPES),
    # Qwen2: q/k/v biases (always on in Qwen2, so no attention_bias key), tied embeddings.
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        max_window_layers=TINY_SHAPES["num_hidden_layers"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **COMMON,
        **TINY_SHAPES,
    ),
    # Exactly Qwen3-0.6B's shapes (the tokenizer is ours, so only ids < 4000 are ever produced).
    "qwen3-0.6b": qwen3_config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    ),
    # SmolLM2-135M's shapes (Llama, tied embeddings), for timing runs (bench/gpu_check.py).
    "smollm2-135m": llama_config(
        rope_theta=100000.0,
        tie_word_embeddings=True,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
    ),
    # Llama-3.1-8B's shapes (untied head, llama3 RoPE scaling), for timing runs: 16 GB in bf16,
    # written with fast=True (make-model --fast-random) in seconds.
    "llama-3.1-8b": llama_config(
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),
    "tiny-qwen3-embedding": {**qwen3_config(**TINY_SHAPES), "is_matryoshka": True},
}


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Llama / Qwen2 / Qwen3 under the Hub's names (``model.layers.N.*``)."""
    arch = config["model_type"]
    h, inner = config["hidden_size"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nq
    qkv_bias = arch == "qwen2" or bool(config.get("attention_bias"))
    o_bias = arch != "qwen2" and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))

    specs: list[TensorSpec] = [("model.embed_tokens.weight", (config["vocab_size"], h), "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = [
            ("input_layernorm.weight", (h,), "norm"),
            ("self_attn.q_proj.weight", (nq * hd, h), "normal"),
            ("self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            ("self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            ("self_attn.o_proj.weight", (h, nq * hd), "normal"),
        ]
        if qkv_bias:
            layer += [
                (f"self_attn.{x}_proj.bias", (n * hd,), "normal")
                for x, n in (("q", nq), ("k", nkv), ("v", nkv))
            ]
        if o_bias:
            layer.append(("self_attn.o_proj.bias", (h,), "normal"))
        if arch == "qwen3":
            layer += [("self_attn.q_norm.weight", (hd,), "norm"), ("self_attn.k_norm.weight", (hd,), "norm")]
        layer += [
            ("post_attention_layernorm.weight", (h,), "norm"),
            ("mlp.gate_proj.weight", (inner, h), "normal"),
            ("mlp.up_proj.weight", (inner, h), "normal"),
            ("mlp.down_proj.weight", (h, inner), "normal"),
        ]
        if mlp_bias:
            layer += [
                (f"mlp.{x}_proj.bias", (n,), "normal")
                for x, n in (("gate", inner), ("up", inner), ("down", h))
            ]
        specs += [(p + name, shape, kind) for name, shape, kind in layer]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


FAMILY = Family(
    name="llama",
    model_types=frozenset({"llama", "mistral", "qwen2", "qwen3"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=Vocabulary(),
    jittered=frozenset({"tiny", "tiny-llama", "tiny-qwen2", "tiny-qwen3-embedding"}),
    pooling={"tiny-qwen3-embedding": ("pooling_mode_lasttoken", True)},
)
