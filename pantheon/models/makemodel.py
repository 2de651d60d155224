"""``pantheon make-model``: random-weight Hugging Face model folders from presets.

A folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``tokenizer.json`` and ``tokenizer_config.json``, and loads as-is
with transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer`` (a Qwen3.5 VLM folder also with
``Qwen3_5ForConditionalGeneration``, as the Hub's checkpoints). The tokenizer is our small trained
one, or with ``--vocab FILE.gguf`` a real vocabulary read from a GGUF file (``RealVocab``).

Weights are seeded per tensor (the seed and the tensor's name), generated in row chunks and
streamed straight into the safetensors file, so the same seed gives byte-identical files and a
1.2 GB model never sits in memory twice. torch is imported only inside the writer: importing this
module keeps the router free of torch.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from pantheon.models import tokenizer_train as tt

# ---------------------------------------------------------------------------------------- presets

_TINY_VOCAB = -(-tt.VOCAB_SIZE // 64) * 64  # 4032: the tokenizer's size rounded up to 64
_IDS = dict(
    bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
    eos_token_id=tt.TOKEN_IDS[tt.EOS_TOKEN],
)
_TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=_TINY_VOCAB,
    max_position_embeddings=4096,
)
_COMMON = dict(
    attention_dropout=0.0,
    hidden_act="silu",
    initializer_range=0.02,
    rope_scaling=None,
    torch_dtype="bfloat16",
    use_cache=True,
    **_IDS,
)


def _llama(*, rope_theta: float, tie_word_embeddings: bool, **shapes) -> dict:
    """A Llama config: no biases; ``shapes`` (and any key of ``_COMMON`` they override, such
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
        **_COMMON,
        **shapes,
    }


def _qwen3(**shapes) -> dict:
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
        **_COMMON,
        **shapes,
    )


# ------------------------------------------------------------------------------------- Qwen3.5
#
# Qwen3.5 is a hybrid: three Gated DeltaNet (linear attention) layers, then one gated full-attention
# layer (q_proj also yields a per-head output gate), repeated; RMSNorms are zero-centred (weight 0
# is the identity: x * (1 + w)), except the DeltaNet's gated output norm (plain, weight 1). The Hub
# checkpoints are Qwen3_5ForConditionalGeneration: a nested text_config / vision_config, weights
# model.language_model.* (text), model.visual.* (vision tower), lm_head.weight (when untied) and
# mtp.* (one multi-token-prediction layer, which transformers skips on load; vLLM/SGLang use it
# for speculative decoding).

# The vision markers of Qwen's tokenizer, added after ours for the Qwen3.5 presets (4000..4004), so
# that the image/video ids of the config are real tokens (the real ids are 248053..248057).
QWEN35_VISION_TOKENS = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN35_TOKEN_IDS = {**tt.TOKEN_IDS, **{t: tt.VOCAB_SIZE + i for i, t in enumerate(QWEN35_VISION_TOKENS)}}
QWEN35_VOCAB_SIZE = tt.VOCAB_SIZE + len(QWEN35_VISION_TOKENS)  # 4005


def _layer_types(num_layers: int, interval: int) -> list[str]:
    """Qwen3.5's schedule: every ``interval``-th layer full attention, the others linear."""
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]


def _mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """The (t, h, w) split of the rotary frequencies: 64 rotary dims -> [11, 11, 10] as Qwen's."""
    base, extra = divmod(int(head_dim * partial_rotary_factor) // 2, 3)
    return [base + (i < extra) for i in range(3)]


def _qwen35_text(*, tie_word_embeddings: bool, **shapes) -> dict:
    """A ``qwen3_5_text`` config (the text_config of a Hub checkpoint), keys sorted."""
    interval, rotary = 4, 0.25
    config = dict(
        model_type="qwen3_5_text",
        attention_bias=False,
        attention_dropout=0.0,
        attn_output_gate=True,
        full_attention_interval=interval,
        hidden_act="silu",
        initializer_range=0.02,
        layer_types=_layer_types(shapes["num_hidden_layers"], interval),
        linear_conv_kernel_dim=4,
        mamba_ssm_dtype="float32",
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        pad_token_id=None,
        partial_rotary_factor=rotary,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            mrope_interleaved=True,
            mrope_section=_mrope_section(shapes["head_dim"], rotary),
            partial_rotary_factor=rotary,
            rope_theta=10000000,
            rope_type="default",
        ),
        tie_word_embeddings=tie_word_embeddings,
        use_cache=True,
        **_IDS,
        **shapes,
    )
    return dict(sorted(config.items()))


def _qwen35_vision(**shapes) -> dict:
    config = dict(
        model_type="qwen3_5_vision",
        deepstack_visual_indexes=[],
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        initializer_range=0.02,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        **shapes,
    )
    return dict(sorted(config.items()))


def _qwen35_vlm(text: dict, vision: dict) -> dict:
    """A Qwen3_5ForConditionalGeneration config, laid out as the Hub's."""
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        image_token_id=QWEN35_TOKEN_IDS["<|image_pad|>"],
        language_model_only=False,
        text_config=text,
        tie_word_embeddings=text["tie_word_embeddings"],
        torch_dtype="bfloat16",
        video_token_id=QWEN35_TOKEN_IDS["<|video_pad|>"],
        vision_config=vision,
        vision_end_token_id=QWEN35_TOKEN_IDS["<|vision_end|>"],
        vision_start_token_id=QWEN35_TOKEN_IDS["<|vision_start|>"],
    )


_TINY_QWEN35_TEXT = _qwen35_text(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # rotary dim 4 (partial_rotary_factor 0.25): mrope_section [1, 1, 0]
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    vocab_size=_TINY_VOCAB,
    max_position_embeddings=4096,
    tie_word_embeddings=True,  # as Qwen3.5-0.8B
)
# Qwen3.5-0.8B's text_config (Qwen/Qwen3.5-0.8B config.json).
_QWEN35_08B_TEXT = _qwen35_text(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vocab_size=248320,
    max_position_embeddings=262144,
    tie_word_embeddings=True,
)


# ------------------------------------------------------------------------------------- Gemma 3
#
# Gemma 3's text model (Gemma3ForCausalLM, as Gemma 3 1B ships): five sliding-window layers to one
# global, each kind with its own RoPE base; four zero-centred norms per layer plus q/k norms; GeGLU.
# The tokenizer is ours plus Gemma's turn markers (special, ids 4000, 4001; Gemma's own are 105,
# 106), and the chat template writes Gemma 3's turn format (our text: the shipped template is not
# in ../shared/specs; <end_of_turn> ends a turn and is the EOS, the assistant's role is "model").

GEMMA3_TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
GEMMA3_TOKEN_IDS = {**tt.TOKEN_IDS, **{t: tt.VOCAB_SIZE + i for i, t in enumerate(GEMMA3_TURN_TOKENS)}}
GEMMA3_VOCAB_SIZE = tt.VOCAB_SIZE + len(GEMMA3_TURN_TOKENS)  # 4002


def _gemma3_text(**shapes) -> dict:
    """A ``gemma3_text`` config as the Hub writes Gemma 3 1B's (transformers 4 spelling), keys sorted."""
    config = dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        attention_bias=False,
        attention_dropout=0.0,
        attn_logit_softcapping=None,
        bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
        eos_token_id=GEMMA3_TOKEN_IDS["<end_of_turn>"],
        final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=0.02,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        rms_norm_eps=1e-6,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        rope_theta=1000000.0,
        sliding_window_pattern=6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_cache=True,
        **shapes,
    )
    return dict(sorted(config.items()))


PRESETS: dict[str, dict] = {
    # Qwen3 architecture: per-head RMSNorm on q and k, no biases, tied embeddings.
    "tiny": _qwen3(**_TINY_SHAPES),
    # Llama: untied lm_head, no biases.
    "tiny-llama": _llama(rope_theta=500000.0, tie_word_embeddings=False, **_TINY_SHAPES),
    # Qwen2: q/k/v biases (always on in Qwen2, so no attention_bias key), tied embeddings.
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        max_window_layers=_TINY_SHAPES["num_hidden_layers"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **_COMMON,
        **_TINY_SHAPES,
    ),
    # Exactly Qwen3-0.6B's shapes (the tokenizer is ours, so only ids < 4000 are ever produced).
    "qwen3-0.6b": _qwen3(
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
    "smollm2-135m": _llama(
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
    "llama-3.1-8b": _llama(
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
    # Qwen3.5 as the Hub ships it (Qwen3_5ForConditionalGeneration), tiny: 3 DeltaNet layers + 1
    # full attention, a 2-block vision tower, one MTP layer, tied embeddings.
    "tiny-qwen3.5": _qwen35_vlm(
        _TINY_QWEN35_TEXT,
        _qwen35_vision(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            num_position_embeddings=64,  # an 8 x 8 grid of learned positions
            out_hidden_size=_TINY_QWEN35_TEXT["hidden_size"],
        ),
    ),
    # The same text model as a text-only checkpoint (Qwen3_5ForCausalLM: flat config, model.*).
    "tiny-qwen3.5-text": dict(
        architectures=["Qwen3_5ForCausalLM"], torch_dtype="bfloat16", **_TINY_QWEN35_TEXT
    ),
    # Gemma 3, tiny: six layers (five sliding with a 16-token window, one global), so that
    # prompts a few dozen tokens long go past the window; query_pre_attn_scalar is the head dim
    # (as Gemma 3 1B/4B/12B, and as llama.cpp assumes for a GGUF file).
    "tiny-gemma3": _gemma3_text(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        vocab_size=_TINY_VOCAB,
        max_position_embeddings=4096,
    ),
    # Exactly Qwen3.5-0.8B's shapes, vision tower included (tokenizer ours: ids < 4005 only).
    "qwen3.5-0.8b": _qwen35_vlm(
        _QWEN35_08B_TEXT,
        _qwen35_vision(
            depth=12,
            hidden_size=768,
            intermediate_size=3072,
            num_heads=12,
            num_position_embeddings=2304,
            out_hidden_size=_QWEN35_08B_TEXT["hidden_size"],
        ),
    ),
}


# ------------------------------------------------------------------------------------- Qwen3-MoE
#
# Qwen3's attention with a mixture-of-experts MLP in every layer (decoder_sparse_step 1, no
# mlp_only_layers): a router ``mlp.gate`` [E, H] and per-expert SwiGLU weights under the Hub's
# names ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (transformers 5 fuses them on load and writes
# them back so).


def _qwen3_moe(**shapes) -> dict:
    config = _qwen3(**shapes)
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


PRESETS["tiny-qwen3-moe"] = _qwen3_moe(
    **{**_TINY_SHAPES, "num_hidden_layers": 3},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
# Exactly Qwen3-30B-A3B's shapes (48 layers of 128 experts, 8 per token; tokenizer ours). The decode
# benchmark cuts it to a few layers with num_hidden_layers.
PRESETS["qwen3-30b-a3b"] = _qwen3_moe(
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
)


# ------------------------------------------------------------------------------- Qwen3.5-MoE
#
# Qwen3.5's hybrid layers with a mixture of experts as every layer's MLP (no dense MLP, no
# intermediate_size): num_experts routed experts, top num_experts_per_tok renormalised, and a
# shared expert behind a sigmoid gate. Hub layout: Qwen3_5MoeForConditionalGeneration, experts
# fused (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]).


def _qwen35_moe_text(**shapes) -> dict:
    moe = {k: shapes.pop(k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    shared = shapes.pop("shared_expert_intermediate_size")
    config = _qwen35_text(intermediate_size=0, **shapes)
    del config["intermediate_size"]
    config.update(
        model_type="qwen3_5_moe_text",
        shared_expert_intermediate_size=shared,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        **moe,
    )
    return dict(sorted(config.items()))


def _qwen35_moe_vlm(text: dict, vision: dict) -> dict:
    config = _qwen35_vlm(text, dict(vision, model_type="qwen3_5_moe_vision"))
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    return config


_TINY_QWEN35_MOE_TEXT = _qwen35_moe_text(
    hidden_size=64,
    num_hidden_layers=4,  # linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    vocab_size=_TINY_VOCAB,
    max_position_embeddings=4096,
    tie_word_embeddings=False,  # as Qwen3.6-35B-A3B
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
# Tiny, as the Hub ships Qwen3.6-35B-A3B: 3 DeltaNet layers + 1 full attention, 8 experts (top 2)
# and a shared expert in each, a 2-block vision tower, one MTP layer, untied head (as the 35B).
PRESETS["tiny-qwen3.5-moe"] = _qwen35_moe_vlm(
    _TINY_QWEN35_MOE_TEXT,
    _qwen35_vision(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_position_embeddings=64,
        out_hidden_size=_TINY_QWEN35_TEXT["hidden_size"],
    ),
)
# Exactly Qwen3.6-35B-A3B's text shapes (40 layers of 256 experts, 8 per token, plus a shared
# expert; tokenizer ours), text only: the decode benchmark cuts it to a few layers.
PRESETS["qwen3.6-35b-a3b-text"] = dict(
    architectures=["Qwen3_5MoeForCausalLM"],
    torch_dtype="bfloat16",
    **_qwen35_moe_text(
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
)

# Std of the random multiplicative jitter on RMSNorm weights (1 + jitter * N(0, 1)): on for the
# tiny presets so that a wrong norm implementation shows up in tests; plain ones otherwise.
_NORM_JITTER = {
    "tiny": 0.1,
    "tiny-llama": 0.1,
    "tiny-qwen2": 0.1,
    "tiny-qwen3.5": 0.1,
    "tiny-qwen3.5-text": 0.1,
    "tiny-gemma3": 0.1,
    "tiny-qwen3-moe": 0.1,
    "tiny-qwen3.5-moe": 0.1,
}
_STD = 0.02  # linears, embeddings and biases

_DTYPES = {  # accepted spelling -> (config name, safetensors name, bytes per element)
    "bfloat16": ("bfloat16", "BF16", 2),
    "bf16": ("bfloat16", "BF16", 2),
    "float16": ("float16", "F16", 2),
    "fp16": ("float16", "F16", 2),
    "half": ("float16", "F16", 2),
    "float32": ("float32", "F32", 4),
    "fp32": ("float32", "F32", 4),
    "float": ("float32", "F32", 4),
}

GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


# ------------------------------------------------------------------------------------- Gemma 4
#
# Gemma 4's text model (Gemma4ForCausalLM, transformers 5's gemma4_text), tiny: six layers (two
# sliding with a 16-token window, a global, two sliding, a global), and every text feature of the
# family switched on at once, so that each test exercises all of them: global layers with their
# own head dim and KV heads, K as V (attention_k_eq_v), proportional RoPE, per-layer embeddings
# (P = 16), the last two layers sharing the KV of layers 3 and 2 with a double-wide MLP.
# ``tiny-gemma4-moe`` adds the 26B-A4B's routed experts beside each dense MLP. The tokenizer is
# ours plus Gemma 4's turn and channel markers (special, ids 4000-4004), and the chat template
# writes Gemma 4's turn format (our text; ../shared/specs/gemma-4-31B-it.chat_template.jinja is
# the shipped one): <turn|> ends a turn and is the EOS, the assistant's role is "model", a system
# turn first when there is a system message or thinking is on (then it starts with <|think|>),
# and without thinking the generation prompt closes an empty thought channel.

GEMMA4_MARKERS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]
GEMMA4_TOKEN_IDS = {**tt.TOKEN_IDS, **{t: tt.VOCAB_SIZE + i for i, t in enumerate(GEMMA4_MARKERS)}}
GEMMA4_VOCAB_SIZE = tt.VOCAB_SIZE + len(GEMMA4_MARKERS)  # 4005


def _gemma4_text(**shapes) -> dict:
    """A ``gemma4_text`` config in the Hub's spelling (``global_head_dim``,
    ``num_global_key_value_heads``, ``rope_parameters`` by layer kind), keys sorted."""
    config = dict(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
        eos_token_id=GEMMA4_TOKEN_IDS["<turn|>"],
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=0.02,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_bidirectional_attention=None,
        use_cache=True,
        **shapes,
    )
    return dict(sorted(config.items()))


_S, _F = "sliding_attention", "full_attention"
_TINY_GEMMA4 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    layer_types=[_S, _S, _F, _S, _S, _F],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=16,
    hidden_size_per_layer_input=16,  # a multiple of 16: int8 layers keep torch's kernel (workers/quant.py)
    vocab_size_per_layer_input=_TINY_VOCAB,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    enable_moe_block=False,
    num_experts=None,
    top_k_experts=None,
    moe_intermediate_size=None,
    vocab_size=_TINY_VOCAB,
    max_position_embeddings=4096,
)
PRESETS["tiny-gemma4"] = _gemma4_text(**_TINY_GEMMA4)
PRESETS["tiny-gemma4-moe"] = _gemma4_text(
    **{
        **_TINY_GEMMA4,
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    }
)
_NORM_JITTER.update({"tiny-gemma4": 0.1, "tiny-gemma4-moe": 0.1})


def _is_gemma4(config: dict) -> bool:
    return config["model_type"] in ("gemma4", "gemma4_text")


def _gemma4_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Gemma 4's text model (``Gemma4ForCausalLM`` names, transformers 5's stacked experts); every
    norm is plain (``x * w``), and so are ``layer_scalar`` and the router's scales."""
    from pantheon.core.archs.gemma4 import describe

    d = describe(config, {}, "config", "gemma4")
    h, nq, p, n = d.hidden_size, d.num_heads, d.ple_dim, d.num_layers
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (d.vocab_size, h), "embed")
    ]
    if p:
        specs += [
            ("model.embed_tokens_per_layer.weight", (d.ple_vocab, n * p), "embed"),
            ("model.per_layer_model_projection.weight", (n * p, h), "normal"),
            ("model.per_layer_projection_norm.weight", (p,), "norm"),
        ]
    for i, a in enumerate(d.attn):
        pre, hd, kv, inner = f"model.layers.{i}.", a.head_dim, a.kv_heads * a.head_dim, a.intermediate
        layer = [
            ("input_layernorm.weight", (h,), "norm"),
            ("self_attn.q_proj.weight", (nq * hd, h), "normal"),
        ]
        if a.shares is None:
            layer.append(("self_attn.k_proj.weight", (kv, h), "normal"))
            if not a.k_eq_v:
                layer.append(("self_attn.v_proj.weight", (kv, h), "normal"))
        layer += [
            ("self_attn.o_proj.weight", (h, nq * hd), "normal"),
            ("self_attn.q_norm.weight", (hd,), "norm"),
        ]
        if a.shares is None:
            layer.append(("self_attn.k_norm.weight", (hd,), "norm"))
        layer += [
            ("post_attention_layernorm.weight", (h,), "norm"),
            ("pre_feedforward_layernorm.weight", (h,), "norm"),
            ("mlp.gate_proj.weight", (inner, h), "normal"),
            ("mlp.up_proj.weight", (inner, h), "normal"),
            ("mlp.down_proj.weight", (h, inner), "normal"),
            ("post_feedforward_layernorm.weight", (h,), "norm"),
            ("layer_scalar", (1,), "norm"),
        ]
        ex = d.moe_experts
        if ex is not None:
            layer += [
                ("router.proj.weight", (ex.count, h), "normal"),
                ("router.scale", (h,), "norm"),
                ("router.per_expert_scale", (ex.count,), "norm"),
                ("experts.gate_up_proj", (ex.count, 2 * ex.intermediate, h), "normal"),
                ("experts.down_proj", (ex.count, h, ex.intermediate), "normal"),
                ("post_feedforward_layernorm_1.weight", (h,), "norm"),
                ("pre_feedforward_layernorm_2.weight", (h,), "norm"),
                ("post_feedforward_layernorm_2.weight", (h,), "norm"),
            ]
        if p:
            layer += [
                ("per_layer_input_gate.weight", (p, h), "normal"),
                ("per_layer_projection.weight", (h, p), "normal"),
                ("post_per_layer_input_norm.weight", (h,), "norm"),
            ]
        specs += [(pre + name, shape, kind) for name, shape, kind in layer]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not d.tie_word_embeddings:
        specs.append(("lm_head.weight", (d.vocab_size, h), "embed"))
    return specs


# Gemma 4's turn format in our own words (see the block's comment).
GEMMA4_CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content | trim -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if 'text' in part -%}{{- part.text | trim -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{{- bos_token -}}
{%- set msgs = messages -%}
{%- if thinking or (messages and messages[0].role in ['system', 'developer']) -%}
  {{- '<|turn>system\\n' -}}
  {%- if thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}
  {%- if messages and messages[0].role in ['system', 'developer'] -%}
    {{- render(messages[0].content) -}}
    {%- set msgs = messages[1:] -%}
  {%- endif -%}
  {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for m in msgs -%}
  {{- '<|turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' + render(m.content) + '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|turn>model\\n' -}}
  {%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"""


def gemma4_tokenizer_json() -> str:
    """Our trained tokenizer plus Gemma 4's markers (special, ids 4000-4004)."""
    return _tokenizer_with_specials(tuple(GEMMA4_MARKERS))


def gemma4_tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` of the Gemma 4 presets: the markers, <turn|> as EOS, the template."""
    return _tokenizer_config_with_specials(model_max_length, GEMMA4_MARKERS, "<turn|>", GEMMA4_CHAT_TEMPLATE)


# Gemma's own kind of tokenizer, for the Gemma 4 presets written with ``gemma_tokenizer=True``:
# llama.cpp's converter reads a Gemma 4 vocabulary only as one (``gguf.LlamaHfVocab``: a BPE with
# byte fallback and a Sequence decoder) and stores it as its ``gemma4`` tokenizer model, which it
# runs as SentencePiece-style BPE: spaces become U+2581 ("▁"), the text is split only at newline
# runs, merges run over raw UTF-8, and a piece outside the vocabulary falls back to its <0xHH>
# byte tokens. This one is that pipeline trained on our corpus, with the same ids as the default
# one where it matters: ids 0-255 are the byte tokens, the learned pieces run up to
# ``tt.BPE_VOCAB_SIZE``, then ours and Gemma 4's added tokens as in ``gemma4_tokenizer_json``.
GEMMA_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


@functools.lru_cache(maxsize=1)
def gemma4_spm_tokenizer_json() -> str:
    """Gemma-style tokenizer (see above): deterministic, trained in a fraction of a second."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    from pantheon.core.gguf_tokenizer import GEMMA4_SPLIT  # the split llama.cpp's gemma4 tokenizer makes

    def pipeline(tok: Tokenizer) -> Tokenizer:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(GEMMA4_SPLIT), behavior="isolated")
        return tok

    learned = pipeline(Tokenizer(models.BPE(byte_fallback=True)))
    trainer = trainers.BpeTrainer(
        vocab_size=tt.BPE_VOCAB_SIZE - 256, min_frequency=2, show_progress=False, special_tokens=[]
    )
    learned.train_from_iterator(tt.corpus_documents(), trainer)
    model = json.loads(learned.to_str())["model"]
    if len(model["vocab"]) != tt.BPE_VOCAB_SIZE - 256:
        raise RuntimeError(f"BPE learned {len(model['vocab'])} tokens, wanted {tt.BPE_VOCAB_SIZE - 256}")
    vocab = {t: i for i, t in enumerate(GEMMA_BYTE_TOKENS)}
    vocab.update((t, 256 + i) for t, i in model["vocab"].items())
    merges = [tuple(m) for m in model["merges"]]
    tok = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True)))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    for content, special in [*tt.ADDED_TOKENS, *((t, True) for t in GEMMA4_MARKERS)]:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    want = {**tt.TOKEN_IDS, **GEMMA4_TOKEN_IDS}
    if (ids := {t: tok.token_to_id(t) for t in want}) != want:
        raise RuntimeError(f"added token ids {ids} differ from {want}")
    bos = tt.BOS_TOKEN  # prepended, as Gemma's tokenizer (and llama.cpp's gemma4) does
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tt.TOKEN_IDS[bos])]
    )
    return tok.to_str(pretty=True)


def gemma4_spm_tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` for ``gemma4_spm_tokenizer_json``: Gemma's tokenizer class (so
    transformers keeps the file's pipeline), BOS added, no mask token, and the special added
    tokens listed (``extra_special_tokens``: what transformers, and so the converter, counts as
    special; it still marks Gemma 4's channel markers user-defined, as for the real model)."""
    config = gemma4_tokenizer_config(model_max_length)
    special = [t for t, s in tt.ADDED_TOKENS if s] + GEMMA4_MARKERS
    return config | {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": True,
        "mask_token": None,
        "extra_special_tokens": [t for t in special if t not in (tt.BOS_TOKEN, "<turn|>")],
    }


# ------------------------------------------------------------------------------ embedding models
#
# Folders in the sentence-transformers layout (modules.json: the Transformer at the root, a
# Pooling module in 1_Pooling/ and, when it normalises, a Normalize module), loadable as they are
# by sentence-transformers' SentenceTransformer: tiny-qwen3-embedding is a Qwen3 decoder with
# last-token pooling and normalisation, as Qwen3-Embedding (and trained for Matryoshka sizes);
# tiny-bert is BertModel (absolute and token-type embeddings, post-LayerNorm, GELU) with mean
# pooling, as all-MiniLM. Both use the trained byte-level tokenizer.

PRESETS["tiny-qwen3-embedding"] = {**_qwen3(**_TINY_SHAPES), "is_matryoshka": True}
PRESETS["tiny-bert"] = dict(
    architectures=["BertModel"],
    model_type="bert",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=_TINY_VOCAB,
    max_position_embeddings=512,
    type_vocab_size=2,
    hidden_act="gelu",
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    layer_norm_eps=1e-12,
    initializer_range=0.02,
    pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
    torch_dtype="float32",
    **_IDS,
)
_NORM_JITTER.update({"tiny-qwen3-embedding": 0.1, "tiny-bert": 0.1})
# preset -> (sentence-transformers pooling mode, normalised)
SENTENCE_TRANSFORMERS = {
    "tiny-qwen3-embedding": ("pooling_mode_lasttoken", True),
    "tiny-bert": ("pooling_mode_mean_tokens", False),
}


def _bert_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """BertModel's tensors (its own names: ``embeddings.*``, ``encoder.layer.N.*``, ``pooler.*``)."""
    h, inner = config["hidden_size"], config["intermediate_size"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("embeddings.word_embeddings.weight", (config["vocab_size"], h), "embed"),
        ("embeddings.position_embeddings.weight", (config["max_position_embeddings"], h), "normal"),
        ("embeddings.token_type_embeddings.weight", (config["type_vocab_size"], h), "normal"),
        ("embeddings.LayerNorm.weight", (h,), "norm"),
        ("embeddings.LayerNorm.bias", (h,), "norm0"),
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for x in ("query", "key", "value"):
            specs += [(f"{p}attention.self.{x}.weight", (h, h), "normal")]
            specs += [(f"{p}attention.self.{x}.bias", (h,), "normal")]
        specs += [
            (f"{p}attention.output.dense.weight", (h, h), "normal"),
            (f"{p}attention.output.dense.bias", (h,), "normal"),
            (f"{p}attention.output.LayerNorm.weight", (h,), "norm"),
            (f"{p}attention.output.LayerNorm.bias", (h,), "norm0"),
            (f"{p}intermediate.dense.weight", (inner, h), "normal"),
            (f"{p}intermediate.dense.bias", (inner,), "normal"),
            (f"{p}output.dense.weight", (h, inner), "normal"),
            (f"{p}output.dense.bias", (h,), "normal"),
            (f"{p}output.LayerNorm.weight", (h,), "norm"),
            (f"{p}output.LayerNorm.bias", (h,), "norm0"),
        ]
    return specs + [("pooler.dense.weight", (h, h), "normal"), ("pooler.dense.bias", (h,), "normal")]


def write_sentence_transformers(out: Path, preset: str, config: dict) -> None:
    """The sentence-transformers files of an embedding preset (none for other presets)."""
    if preset not in SENTENCE_TRANSFORMERS:
        return
    mode, normalize = SENTENCE_TRANSFORMERS[preset]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
    modes = (
        "cls_token",
        "mean_tokens",
        "max_tokens",
        "mean_sqrt_len_tokens",
        "weightedmean_tokens",
        "lasttoken",
    )
    pooling = {f"pooling_mode_{m}": f"pooling_mode_{m}" == mode for m in modes}
    (out / "1_Pooling").mkdir(exist_ok=True)
    _write_json(
        out / "1_Pooling" / "config.json",
        {"word_embedding_dimension": config["hidden_size"], **pooling, "include_prompt": True},
    )
    _write_json(
        out / "sentence_bert_config.json",
        {"max_seq_length": config["max_position_embeddings"], "do_lower_case": False},
    )


# --------------------------------------------------------------------------------------- tensors


def text_config(config: dict) -> dict:
    """The text model's part of a config: its ``text_config`` if nested (Qwen3.5 VLM), else itself."""
    return config.get("text_config", config)


def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, kind)`` of every tensor a config needs, in file order, HF names.

    ``kind`` is ``"normal"`` (std 0.02: linears, convolutions, biases), ``"embed"`` (std 0.02 for
    the tokenizer's ids, zero rows for the padding ids past it), ``"norm"`` (a norm weight applied
    as ``x * w``: ones), ``"norm0"`` (a zero-centred norm weight, ``x * (1 + w)``, or a LayerNorm
    bias: zeros) or ``"A_log"`` (a DeltaNet's decay: log of uniform(0.01, 16), as transformers').
    """
    if config["model_type"] in QWEN35_TYPES:
        return _qwen35_specs(config)
    if config["model_type"] == "bert":
        return _bert_specs(config)
    if _is_gemma3(config):
        return _gemma3_specs(config)
    if _is_gemma4(config):
        return _gemma4_specs(config)
    if config["model_type"] == "qwen3_moe":
        return _qwen3_moe_specs(config)
    if _is_gpt_oss(config):
        return _gpt_oss_specs(config)
    arch = config["model_type"]
    h, inner = config["hidden_size"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nq
    qkv_bias = arch == "qwen2" or bool(config.get("attention_bias"))
    o_bias = arch != "qwen2" and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))

    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], h), "embed")
    ]
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


def _qwen3_moe_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3-MoE: Qwen3's tensors, with each sparse layer's MLP replaced by the router and the
    experts (per-expert names, as the Hub's checkpoints)."""
    from pantheon.core.archs.qwen3_moe import sparse_layers

    h, n = config["hidden_size"], config["num_hidden_layers"]
    experts, inter = config["num_experts"], config["moe_intermediate_size"]
    sparse = sparse_layers(config, "config", n, experts)
    specs = []
    for name, shape, kind in tensor_specs({**config, "model_type": "qwen3"}):
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


def _qwen35_decoder_layer(t: dict, layer_type: str) -> list[tuple[str, tuple[int, ...], str]]:
    """One Qwen3.5 decoder layer (names relative to the layer)."""
    h, inner = t["hidden_size"], t.get("intermediate_size", 0)
    if layer_type == "linear_attention":  # Gated DeltaNet
        nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv  # q, k, v channels, convolved depthwise
        mixer = [
            ("linear_attn.A_log", (nv,), "A_log"),
            ("linear_attn.conv1d.weight", (conv_dim, 1, t["linear_conv_kernel_dim"]), "normal"),
            ("linear_attn.dt_bias", (nv,), "norm"),  # ones, as transformers initialises it
            ("linear_attn.in_proj_a.weight", (nv, h), "normal"),
            ("linear_attn.in_proj_b.weight", (nv, h), "normal"),
            ("linear_attn.in_proj_qkv.weight", (conv_dim, h), "normal"),
            ("linear_attn.in_proj_z.weight", (nv * dv, h), "normal"),
            ("linear_attn.norm.weight", (dv,), "norm"),  # the gated RMSNorm: plain weight
            ("linear_attn.out_proj.weight", (h, nv * dv), "normal"),
        ]
    elif layer_type == "full_attention":
        nq, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        mixer = [
            ("self_attn.k_norm.weight", (hd,), "norm0"),
            ("self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            ("self_attn.o_proj.weight", (h, nq * hd), "normal"),
            ("self_attn.q_norm.weight", (hd,), "norm0"),
            ("self_attn.q_proj.weight", (nq * hd * 2, h), "normal"),  # per head: query, then gate
            ("self_attn.v_proj.weight", (nkv * hd, h), "normal"),
        ]
        if t.get("attention_bias"):  # biases on all four projections, as transformers builds them
            mixer += [
                ("self_attn.k_proj.bias", (nkv * hd,), "normal"),
                ("self_attn.o_proj.bias", (h,), "normal"),
                ("self_attn.q_proj.bias", (nq * hd * 2,), "normal"),
                ("self_attn.v_proj.bias", (nkv * hd,), "normal"),
            ]
    else:
        raise ValueError(f"unknown Qwen3.5 layer type {layer_type!r}")
    if "num_experts" in t:  # Qwen3.5-MoE: router, fused experts (as the Hub's), shared expert
        e, mi, si = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
        mlp = [
            ("mlp.experts.down_proj", (e, h, mi), "normal"),
            ("mlp.experts.gate_up_proj", (e, 2 * mi, h), "normal"),
            ("mlp.gate.weight", (e, h), "normal"),
            ("mlp.shared_expert.down_proj.weight", (h, si), "normal"),
            ("mlp.shared_expert.gate_proj.weight", (si, h), "normal"),
            ("mlp.shared_expert.up_proj.weight", (si, h), "normal"),
            ("mlp.shared_expert_gate.weight", (1, h), "normal"),
        ]
    else:
        mlp = [
            ("mlp.down_proj.weight", (h, inner), "normal"),
            ("mlp.gate_proj.weight", (inner, h), "normal"),
            ("mlp.up_proj.weight", (inner, h), "normal"),
        ]
    return [
        ("input_layernorm.weight", (h,), "norm0"),
        *mixer,
        *mlp,
        ("post_attention_layernorm.weight", (h,), "norm0"),
    ]


def _qwen35_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3.5 tensors under the Hub's names: text, then vision tower (VLM only), then MTP."""
    t = text_config(config)
    vlm = "text_config" in config
    lm = "model.language_model." if vlm else "model."
    h, vocab = t["hidden_size"], t["vocab_size"]
    if len(t["layer_types"]) != t["num_hidden_layers"]:
        raise ValueError(
            f"layer_types has {len(t['layer_types'])} entries for {t['num_hidden_layers']} layers"
        )

    specs: list[tuple[str, tuple[int, ...], str]] = [(lm + "embed_tokens.weight", (vocab, h), "embed")]
    for i, layer_type in enumerate(t["layer_types"]):
        specs += [(f"{lm}layers.{i}.{n}", s, k) for n, s, k in _qwen35_decoder_layer(t, layer_type)]
    specs.append((lm + "norm.weight", (h,), "norm0"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (vocab, h), "embed"))

    if vlm:
        v = config["vision_config"]
        vh, vi, c = v["hidden_size"], v["intermediate_size"], v["in_channels"]
        merged = vh * v["spatial_merge_size"] ** 2
        p = "model.visual."
        specs += [
            (
                p + "patch_embed.proj.weight",
                (vh, c, v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
                "normal",
            ),
            (p + "patch_embed.proj.bias", (vh,), "normal"),
            (p + "pos_embed.weight", (v["num_position_embeddings"], vh), "normal"),
        ]
        for i in range(v["depth"]):
            specs += [
                (f"{p}blocks.{i}.{n}", s, k)
                for n, s, k in [
                    ("attn.proj.bias", (vh,), "normal"),
                    ("attn.proj.weight", (vh, vh), "normal"),
                    ("attn.qkv.bias", (3 * vh,), "normal"),
                    ("attn.qkv.weight", (3 * vh, vh), "normal"),
                    ("mlp.linear_fc1.bias", (vi,), "normal"),
                    ("mlp.linear_fc1.weight", (vi, vh), "normal"),
                    ("mlp.linear_fc2.bias", (vh,), "normal"),
                    ("mlp.linear_fc2.weight", (vh, vi), "normal"),
                    ("norm1.bias", (vh,), "norm0"),
                    ("norm1.weight", (vh,), "norm"),
                    ("norm2.bias", (vh,), "norm0"),
                    ("norm2.weight", (vh,), "norm"),
                ]
            ]
        specs += [
            (p + "merger.linear_fc1.bias", (merged,), "normal"),
            (p + "merger.linear_fc1.weight", (merged, merged), "normal"),
            (p + "merger.linear_fc2.bias", (v["out_hidden_size"],), "normal"),
            (p + "merger.linear_fc2.weight", (v["out_hidden_size"], merged), "normal"),
            (p + "merger.norm.bias", (vh,), "norm0"),
            (p + "merger.norm.weight", (vh,), "norm"),
        ]

    # Multi-token prediction: norm the next token's embedding and the last hidden state, project
    # their concatenation back to h (fc), run full-attention layers, final norm; shares the
    # embeddings and lm_head with the main model.
    n_mtp = t.get("mtp_num_hidden_layers") or 0
    if n_mtp:
        specs.append(("mtp.fc.weight", (h, 2 * h), "normal"))
        for i in range(n_mtp):
            specs += [(f"mtp.layers.{i}.{n}", s, k) for n, s, k in _qwen35_decoder_layer(t, "full_attention")]
        specs += [
            ("mtp.norm.weight", (h,), "norm0"),
            ("mtp.pre_fc_norm_embedding.weight", (h,), "norm0"),
            ("mtp.pre_fc_norm_hidden.weight", (h,), "norm0"),
        ]
    return specs


def _gemma3_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Gemma 3's text model (``Gemma3ForCausalLM`` names); every norm is zero-centred."""
    h, inner = config["hidden_size"], config["intermediate_size"]
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], h), "embed")
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm0"),
            (p + "self_attn.q_proj.weight", (nq * hd, h), "normal"),
            (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.o_proj.weight", (h, nq * hd), "normal"),
            (p + "self_attn.q_norm.weight", (hd,), "norm0"),
            (p + "self_attn.k_norm.weight", (hd,), "norm0"),
            (p + "post_attention_layernorm.weight", (h,), "norm0"),
            (p + "pre_feedforward_layernorm.weight", (h,), "norm0"),
            (p + "mlp.gate_proj.weight", (inner, h), "normal"),
            (p + "mlp.up_proj.weight", (inner, h), "normal"),
            (p + "mlp.down_proj.weight", (h, inner), "normal"),
            (p + "post_feedforward_layernorm.weight", (h,), "norm0"),
        ]
    specs.append(("model.norm.weight", (h,), "norm0"))
    if not config.get("tie_word_embeddings", True):
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, tensor name): a tensor's values do not depend on file order.

    A VLM's text tensors are seeded under their text-only names (``model.language_model.X`` as
    ``model.X``): tiny-qwen3.5 and tiny-qwen3.5-text hold the same text model.
    """
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@functools.cache
def _fast_pool(torch_dtype, elems: int):
    """``elems`` normal values (times ``_STD``) in ``torch_dtype``, drawn once: the windows of
    ``fast`` weights (``_tensor_chunks``)."""
    import torch

    gen = torch.Generator().manual_seed(0x5EED)
    return torch.randn(elems, generator=gen).mul_(_STD).to(torch_dtype)


def _tensor_chunks(
    name,
    shape,
    kind,
    *,
    seed,
    jitter,
    torch_dtype,
    real_vocab=tt.VOCAB_SIZE,
    chunk_elems=1 << 22,
    fast=False,
):
    """Yield the tensor's bytes (little-endian, row-major) in chunks of whole rows.

    ``fast``: a weight chunk is a window, at a seeded random offset, of one pool of normal values
    drawn once (``_fast_pool``) instead of fresh draws: the same distribution per element, not
    independent across chunks, and written at the disk's speed rather than the generator's (an
    8B-parameter folder in seconds, for timing runs; the reference tests use the default).
    """
    import torch

    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    rows, row = shape[0], _numel(shape[1:])
    step = max(1, chunk_elems // row)
    pool = _fast_pool(torch_dtype, 2 * chunk_elems) if fast else None
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if kind in ("norm", "norm0"):  # centred on 1 (x * w) or on 0 (x * (1 + w), biases)
            x = torch.ones(n * row) if kind == "norm" else torch.zeros(n * row)
            if jitter:
                x.add_(torch.randn(n * row, generator=gen), alpha=jitter)
        elif kind == "A_log":
            x = torch.empty(n * row).uniform_(0.01, 16.0, generator=gen).log_()
        elif pool is not None and n * row <= pool.numel() // 2:
            at = int(torch.randint(0, pool.numel() - n * row + 1, (1,), generator=gen))
            x = pool[at : at + n * row]
            if kind == "embed" and start + n > real_vocab:
                x = x.clone()
                x.view(n, row)[max(0, real_vocab - start) :] = 0
            yield x.view(torch.uint8).numpy()
            continue
        else:
            x = torch.randn(n * row, generator=gen).mul_(_STD)
            if kind == "embed" and start + n > real_vocab:
                # Padding rows past the tokenizer are zero, like untrained rows of a real
                # checkpoint: their logits sit at 0, so greedy decoding picks real tokens.
                x.view(n, row)[max(0, real_vocab - start) :] = 0
        x = x.to(torch_dtype)
        yield x.view(torch.uint8).numpy()  # raw bytes; numpy has no bfloat16


def _write_safetensors(path: Path, specs, st_dtype: str, itemsize: int, chunks_of) -> int:
    """Write one safetensors file tensor by tensor; return its data size in bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        size = _numel(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            for chunk in chunks_of(*spec):
                f.write(chunk)
    return offset


def _shard(specs, itemsize: int, shard_bytes: int | None) -> list[list]:
    """Split specs greedily into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    if not shard_bytes:
        return [specs]
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = _numel(spec[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_weights(
    out: Path,
    config: dict,
    *,
    seed: int,
    jitter: float,
    shard_bytes: int | None = None,
    real_vocab: int = tt.VOCAB_SIZE,
    fast: bool = False,
    mxfp4: bool = False,
) -> list[Path]:
    """Write the random weights for ``config`` into ``out``; return the safetensors paths.
    ``mxfp4``: a gpt-oss folder's experts as MXFP4 blocks and scales (``_write_mxfp4``).

    Embedding (and lm_head) rows from ``real_vocab`` on, the ids the tokenizer never produces, are
    zero. ``fast``: windows of one pool of random values (``_tensor_chunks``), for timing runs.
    """
    import torch

    dtype_name, st_dtype, itemsize = _DTYPES[config["torch_dtype"]]
    torch_dtype = getattr(torch, dtype_name)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    def chunks_of(name, shape, kind):
        return _tensor_chunks(
            name,
            shape,
            kind,
            seed=seed,
            jitter=jitter,
            torch_dtype=torch_dtype,
            real_vocab=real_vocab,
            fast=fast,
        )

    if mxfp4:  # gpt-oss's experts as MXFP4, written expert by expert
        _write_mxfp4(out, config, chunks_of, fast)
        return [out / "model.safetensors"]
    shards = _shard(tensor_specs(config), itemsize, shard_bytes)
    if len(shards) == 1:
        path = out / "model.safetensors"
        _write_safetensors(path, shards[0], st_dtype, itemsize, chunks_of)
        return [path]
    paths, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_safetensors(path, shard, st_dtype, itemsize, chunks_of)
        weight_map.update({name: path.name for name, _, _ in shard})
        paths.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)
    return paths


# --------------------------------------------------------------------------- Qwen3.5 tokenizer

# Qwen3.5's chat format, our own shorter text: ChatML; thinking on unless enable_thinking is false
# (the generation prompt then opens "<think>\n"); reasoning shown for the assistant turns after the
# last user turn, taken from reasoning_content or from a "<think>...</think>" prefix of the
# content; tools listed as JSON in the system turn, calls written as XML
# (<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>, one call per
# tool_call block, non-string values as JSON); tool results as <tool_response> blocks in one user
# turn; image / video parts as vision placeholders. Every tag uses '-' whitespace control, so the
# output does not depend on trim_blocks / lstrip_blocks.
QWEN35_CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif part.type == 'video' or 'video' in part -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
      {%- elif 'text' in part -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set msgs = messages -%}
{%- set system = '' -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = render(messages[0].content) | trim -%}
  {%- set msgs = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n# Tools\\n\\nYou have these functions:\\n\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nTo call functions, end your reply with one block per call, in this format:\\n\\n'
      '<tool_call>\\n<function=FUNCTION_NAME>\\n<parameter=PARAMETER_NAME>\\nvalue\\n</parameter>\\n'
      '</function>\\n</tool_call>\\n\\nGive every required parameter; reason before the calls, never '
      'after them. Without a fitting function, answer normally.' -}}
  {%- if system -%}{{- '\\n\\n' + system -}}{%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
  {{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
  {%- if m.role == 'user' or m.role == 'system' -%}
    {{- '<|im_start|>' + m.role + '\\n' + render(m.content) + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set content = render(m.content) -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if '</think>' in content -%}
      {%- if not reasoning -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}{%- endif -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if loop.index0 > ns.last_user -%}
      {{- '<think>\\n' + (reasoning | trim) + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- content -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {%- if not loop.first -%}{{- '\\n' -}}{%- elif content | trim -%}{{- '\\n\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n<function=' + f.name + '>\\n' -}}
      {%- if f.arguments is mapping -%}
        {%- for name, value in f.arguments.items() -%}
          {{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}
        {%- endfor -%}
      {%- elif f.arguments -%}
        {{- f.arguments + '\\n' -}}
      {%- endif -%}
      {{- '</function>\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or msgs[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + render(m.content) + '\\n</tool_response>' -}}
    {%- if loop.last or msgs[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\\n\\n</think>\\n\\n' -}}
  {%- else -%}
    {{- '<think>\\n' -}}
  {%- endif -%}
{%- endif -%}
"""


QWEN35_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _is_qwen35(config: dict) -> bool:
    return config["model_type"] in QWEN35_TYPES


def qwen35_tokenizer_json() -> str:
    """Our trained tokenizer plus Qwen's vision markers (special, ids 4000..4004)."""
    return _tokenizer_with_specials(tuple(QWEN35_VISION_TOKENS))


def qwen35_tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` of the Qwen3.5 presets: the vision markers, Qwen3.5's template."""
    return _tokenizer_config_with_specials(model_max_length, QWEN35_VISION_TOKENS, None, QWEN35_CHAT_TEMPLATE)


# Gemma 3's turn format, our own text: an optional system message is folded into the first user
# turn, the assistant's role is "model", each turn ends "<end_of_turn>\n"; text parts of list
# contents are joined, image parts become Gemma's image marker (which this tokenizer lacks).
GEMMA3_CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content | trim -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part.type == 'image' or 'image_url' in part -%}{{- '<start_of_image>' -}}
      {%- elif 'text' in part -%}{{- part.text | trim -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set msgs = messages -%}
{%- set prefix = '' -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set prefix = render(messages[0].content) + '\n\n' -%}
  {%- set msgs = messages[1:] -%}
{%- endif -%}
{%- for m in msgs -%}
  {{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' -}}
  {%- if loop.first -%}{{- prefix -}}{%- endif -%}
  {{- render(m.content) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""


def _is_gemma3(config: dict) -> bool:
    return config["model_type"] in ("gemma3", "gemma3_text")


def gemma3_tokenizer_json() -> str:
    """Our trained tokenizer plus Gemma's turn markers (special, ids 4000, 4001)."""
    return _tokenizer_with_specials(tuple(GEMMA3_TURN_TOKENS))


def gemma3_tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` of the Gemma 3 presets: the turn markers, <end_of_turn> as EOS,
    the Gemma 3 turn-format template."""
    return _tokenizer_config_with_specials(
        model_max_length, GEMMA3_TURN_TOKENS, "<end_of_turn>", GEMMA3_CHAT_TEMPLATE
    )


# ------------------------------------------------------------------------------------- gpt-oss
#
# gpt-oss (GptOssForCausalLM): alternating sliding-window (128 tokens; 16 in the tiny preset) and
# full attention layers with q/k/v/o biases and a learned sink per head, YaRN RoPE, and a mixture
# of experts in every layer (router with a bias, top k, experts with biases, clamped SwiGLU). The
# experts stacked as transformers' GptOssExperts holds them: gate_up_proj [E, H, 2I] with gate and
# up columns interleaved, down_proj [E, I, H], and their biases; ``make_model(..., mxfp4=True)``
# stores gate_up_proj and down_proj as the Hub does, MXFP4 blocks and scales (_write_mxfp4).
# The tokenizer is ours plus Harmony's markers (special, ids 4000..4006; the real ones are
# 200002..200012), with a short Harmony chat template of our own; <|return|> and <|call|> end a
# turn (EOS), as in gpt-oss's generation_config.

GPT_OSS_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]
GPT_OSS_TOKEN_IDS = {**tt.TOKEN_IDS, **{t: tt.VOCAB_SIZE + i for i, t in enumerate(GPT_OSS_TOKENS)}}
GPT_OSS_VOCAB_SIZE = tt.VOCAB_SIZE + len(GPT_OSS_TOKENS)  # 4007
GPT_OSS_EOS = [GPT_OSS_TOKEN_IDS["<|return|>"], GPT_OSS_TOKEN_IDS["<|call|>"]]


def _gpt_oss(**shapes) -> dict:
    """A ``gpt_oss`` config as the Hub writes gpt-oss-20b's (without its quantization_config,
    which ``mxfp4=True`` adds), keys sorted."""
    n = shapes["num_hidden_layers"]
    config = dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        attention_bias=True,
        attention_dropout=0.0,
        bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
        eos_token_id=GPT_OSS_TOKEN_IDS["<|return|>"],
        hidden_act="silu",
        initializer_range=0.02,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        output_router_logits=False,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        router_aux_loss_coef=0.9,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        use_cache=True,
        **shapes,
    )
    return dict(sorted(config.items()))


_GPT_OSS_ROPE = dict(
    beta_fast=32.0,
    beta_slow=1.0,
    factor=32.0,
    original_max_position_embeddings=4096,
    rope_type="yarn",
    truncate=False,
)
# Tiny: 2 layers (sliding, full), a 16-token window, 8 experts (top 4) of 64 rows, YaRN over
# 1024 original positions (so that its ramp and attention factor matter at the tiny head dim).
PRESETS["tiny-gpt-oss"] = _gpt_oss(
    hidden_size=64,
    intermediate_size=64,  # a multiple of 32: MXFP4 blocks along the down projection's rows
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=_TINY_VOCAB + 64,  # 4096: room for the Harmony markers
    max_position_embeddings=4096,
    sliding_window=16,
    num_local_experts=8,
    num_experts_per_tok=4,
    rope_scaling={**_GPT_OSS_ROPE, "factor": 4.0, "original_max_position_embeddings": 1024},
)
# Exactly gpt-oss-20b's shapes (24 layers of 32 experts, 4 per token; tokenizer ours): the decode
# benchmark cuts it to a few layers with num_hidden_layers (layer_types follow, see
# _apply_overrides).
PRESETS["gpt-oss-20b"] = _gpt_oss(
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=201088,
    max_position_embeddings=131072,
    sliding_window=128,
    num_local_experts=32,
    num_experts_per_tok=4,
    rope_scaling=dict(_GPT_OSS_ROPE),
)
_NORM_JITTER["tiny-gpt-oss"] = 0.1


def _is_gpt_oss(config: dict) -> bool:
    return config["model_type"] == "gpt_oss"


def _gpt_oss_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss under transformers' names (experts stacked and transposed, biases everywhere)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    e = config["num_local_experts"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], h), "embed")
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (nq * hd, h), "normal"),
            (p + "self_attn.q_proj.bias", (nq * hd,), "normal"),
            (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.k_proj.bias", (nkv * hd,), "normal"),
            (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.v_proj.bias", (nkv * hd,), "normal"),
            (p + "self_attn.o_proj.weight", (h, nq * hd), "normal"),
            (p + "self_attn.o_proj.bias", (h,), "normal"),
            (p + "self_attn.sinks", (nq,), "normal"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.router.weight", (e, h), "normal"),
            (p + "mlp.router.bias", (e,), "normal"),
            (p + "mlp.experts.gate_up_proj", (e, h, 2 * inter), "normal"),
            (p + "mlp.experts.gate_up_proj_bias", (e, 2 * inter), "normal"),
            (p + "mlp.experts.down_proj", (e, inter, h), "normal"),
            (p + "mlp.experts.down_proj_bias", (e, h), "normal"),
        ]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


MXFP4_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
_FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes, codes 0..7 (8..15: negative)


def _mxfp4_quantize(w):
    """``[..., R, C]`` float -> (blocks ``[..., R, C / 32, 16]`` uint8, scales ``[..., R, C / 32]``
    uint8) as transformers' ``integrations/mxfp4.py`` reads them: per 32 values an e8m0 exponent
    (the smallest power of two that brings the block's largest magnitude within 6), each value
    the nearest e2m1 level of its scaled value, two a byte, the even column in the low nibble."""
    import torch

    *lead, r, c = w.shape
    x = w.float().contiguous().reshape(*lead, r, c // 32, 32)
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)
    levels = torch.tensor(_FP4_LEVELS)
    # the nearest magnitude (a tie to the smaller): the midpoints between levels as bucket edges
    code = torch.bucketize(scaled.abs(), (levels[1:] + levels[:-1]) / 2)
    code = code + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def _write_mxfp4(out: Path, config: dict, chunks_of, fast: bool = False) -> None:
    """Write a gpt-oss folder's weights with its experts as MXFP4 (``gate_up_proj`` /
    ``down_proj`` -> ``*_blocks`` and ``*_scales`` of their untransposed ``[E, 2I, H]`` /
    ``[E, H, I]``, as the Hub ships gpt-oss) into one ``model.safetensors``, and add its
    ``quantization_config``. Tensor by tensor and expert by expert (``_mxfp4_tensors``): the
    experts are never whole in bf16 on disk nor in memory, so gpt-oss-20b's full shapes write a
    ~13 GB file holding a few hundred MB. ``chunks_of(name, shape, kind)``: ``write_weights``'
    generator of a tensor's bytes (the experts' values are those the bf16 folder holds); ``fast``:
    the experts' codes random bytes instead (``_fast_mxfp4``: the whole 20b in minutes)."""
    import torch

    dtype_name, st_dtype, itemsize = _DTYPES[config["torch_dtype"]]
    torch_dtype = getattr(torch, dtype_name)
    entries = {}  # name -> (safetensors dtype, shape): the file's tensors
    for name, shape, _ in tensor_specs(config):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = shape  # stored transposed: [E, in, out]
            entries[f"{name}_blocks"] = ("U8", (e, rows, cols // 32, 16))
            entries[f"{name}_scales"] = ("U8", (e, rows, cols // 32))
        else:
            entries[name] = (st_dtype, shape)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(entries):
        dt, shape = entries[name]
        size = _numel(shape) * (itemsize if dt == st_dtype else 1)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    base = 8 + len(raw)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(base + offset)
        for name, data in _mxfp4_tensors(config, chunks_of, torch_dtype, fast):
            at = base + header[name]["data_offsets"][0]
            for pos, chunk in data:
                f.seek(at + pos)
                f.write(chunk)
    config["quantization_config"] = dict(MXFP4_QUANTIZATION)
    _write_json(out / "config.json", dict(sorted(config.items())))


def _mxfp4_tensors(config: dict, chunks_of, torch_dtype, fast: bool = False):
    """``(name, [(byte offset in the tensor, bytes), ...])`` for every tensor of an MXFP4 gpt-oss
    folder, as ``_write_mxfp4`` places them: float tensors as ``chunks_of`` yields them; each
    expert stack quantized an expert at a time (``_mxfp4_quantize`` of the expert's transposed
    matrix, as the bf16 folder's values), its blocks and scales each at the expert's slot; or,
    ``fast``, made directly (``_fast_mxfp4``)."""
    import torch

    for name, shape, kind in tensor_specs(config):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            yield name, _at_offsets(chunks_of(name, shape, kind))
            continue
        num, cols, rows = shape
        per_blocks, per_scales = rows * cols // 2, rows * cols // 32  # one expert's bytes
        if fast:
            for e in range(num):
                blocks, scales = _fast_mxfp4(name, e, per_blocks, per_scales)
                yield f"{name}_blocks", [(e * per_blocks, blocks)]
                yield f"{name}_scales", [(e * per_scales, scales)]
            continue
        e = 0
        for chunk in chunks_of(name, shape, kind):  # whole experts: rows of the stack
            w = torch.from_numpy(chunk).view(torch_dtype).view(-1, cols, rows)
            for i in range(w.shape[0]):
                blocks, scales = _mxfp4_quantize(w[i].transpose(-1, -2))
                yield f"{name}_blocks", [(e * per_blocks, blocks.numpy().tobytes())]
                yield f"{name}_scales", [(e * per_scales, scales.numpy().tobytes())]
                e += 1


# MXFP4 exponent of the fast experts: uniform codes have an RMS of ~2.9 levels, so 2^-7 gives the
# RMS of the other weights (_STD)
_FAST_MXFP4_EXP = 127 - 7


def _fast_mxfp4(name: str, e: int, nblocks: int, nscales: int) -> tuple[bytes, bytes]:
    """One expert's MXFP4 codes as seeded random bytes (every code equally likely) and its
    exponents all ``_FAST_MXFP4_EXP``: weights of the other tensors' spread, for timing runs."""
    import torch

    gen = torch.Generator().manual_seed(_tensor_seed(e, name))
    blocks = torch.randint(0, 256, (nblocks,), dtype=torch.uint8, generator=gen)
    return blocks.numpy().tobytes(), bytes([_FAST_MXFP4_EXP]) * nscales


def _at_offsets(chunks):
    """Consecutive chunks of a tensor's bytes, each with its offset in the tensor."""
    pos = 0
    for chunk in chunks:
        yield pos, chunk
        pos += len(chunk)


# Harmony, gpt-oss's message format, in our own shorter text: every message is
# <|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>. A system message says the reasoning
# effort and the channels; the request's system/developer text and its tools go into a developer
# message (tools as TypeScript-like signatures in the `functions` namespace, parameters as JSON
# schema); an assistant turn after the last user message keeps its reasoning (analysis channel),
# its tool calls go to the commentary channel addressed `to=functions.NAME` and end in <|call|>,
# its answer to the final channel; tool results come from `functions.NAME` to the assistant. The
# generation prompt opens an assistant message.
GPT_OSS_CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}{%- if 'text' in part -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are a large language model.\\nReasoning: '
    + (reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium')
    + '\\n\\n# Valid channels: analysis, commentary, final. Every message names its channel.' -}}
{%- if tools -%}{{- '\\nTool calls go to the commentary channel.' -}}{%- endif -%}
{{- '<|end|>' -}}
{%- set msgs = messages -%}
{%- set instructions = '' -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
  {%- set instructions = render(messages[0].content) -%}
  {%- set msgs = messages[1:] -%}
{%- endif -%}
{%- if instructions or tools -%}
  {{- '<|start|>developer<|message|>' -}}
  {%- if instructions -%}{{- '# Instructions\\n\\n' + instructions -}}{%- endif -%}
  {%- if tools -%}
    {%- if instructions -%}{{- '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' -}}
    {%- for tool in tools -%}
      {%- set f = tool.function if tool.function is defined else tool -%}
      {{- '\\n// ' + (f.description or '') + '\\ntype ' + f.name + ' = (_: '
          + ((f.parameters or {}) | tojson) + ') => any;\\n' -}}
    {%- endfor -%}
    {{- '\\n} // namespace functions' -}}
  {%- endif -%}
  {{- '<|end|>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
  {%- if m.role == 'user' or m.role == 'system' or m.role == 'developer' -%}
    {{- '<|start|>' + m.role + '<|message|>' + render(m.content) + '<|end|>' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if reasoning and loop.index0 > ns.last_user -%}
      {{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' -}}
    {%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>'
          + (f.arguments if f.arguments is string else (f.arguments | tojson)) + '<|call|>' -}}
    {%- endfor -%}
    {%- set content = render(m.content) -%}
    {%- if content or not m.tool_calls -%}
      {{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' -}}
    {%- endif -%}
  {%- elif m.role == 'tool' -%}
    {%- set tool = namespace(name=m.name if m.name is defined and m.name else 'tool') -%}
    {%- for prev in msgs[:loop.index0] -%}
      {%- for call in prev.tool_calls or [] -%}
        {%- if call.id is defined and call.id == m.tool_call_id -%}
          {%- set tool.name = (call.function if call.function is defined else call).name -%}
        {%- endif -%}
      {%- endfor -%}
    {%- endfor -%}
    {{- '<|start|>functions.' + tool.name + ' to=assistant<|channel|>commentary<|message|>'
        + render(m.content) + '<|end|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""


def gpt_oss_tokenizer_json() -> str:
    """Our trained tokenizer plus Harmony's markers (special, ids 4000..4006)."""
    return _tokenizer_with_specials(tuple(GPT_OSS_TOKENS))


def gpt_oss_tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` of the gpt-oss presets: Harmony's markers, <|return|> as EOS,
    the short Harmony template."""
    return _tokenizer_config_with_specials(
        model_max_length, GPT_OSS_TOKENS, "<|return|>", GPT_OSS_CHAT_TEMPLATE
    )


@functools.lru_cache(maxsize=8)
def _tokenizer_with_specials(tokens: tuple[str, ...]) -> str:
    """Our trained tokenizer plus ``tokens`` as special tokens, ids from ``tt.VOCAB_SIZE`` on in
    their order (what each family's ``*_TOKEN_IDS`` table says)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(tt.tokenizer_json())
    for content in tokens:  # one by one: ids in list order
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    want = {t: tt.VOCAB_SIZE + i for i, t in enumerate(tokens)}
    ids = {t: tok.token_to_id(t) for t in tokens}
    if ids != want:
        raise RuntimeError(f"added token ids {ids} differ from {want}")
    return tok.to_str(pretty=True)


def _tokenizer_config_with_specials(
    model_max_length: int, tokens: list[str], eos: str | None, template: str
) -> dict:
    """``tokenizer_config.json`` for ``_tokenizer_with_specials(tokens)``: the tokens as special
    added tokens, ``eos`` as the EOS token (None: ours), the chat template."""
    config = tt.tokenizer_config(model_max_length)
    for i, content in enumerate(tokens):
        config["added_tokens_decoder"][str(tt.VOCAB_SIZE + i)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    if eos is not None:
        config["eos_token"] = eos
    config["chat_template"] = template
    return config


# ------------------------------------------------------------------------------ a real vocabulary


@dataclass(frozen=True)
class RealVocab:
    """A GGUF file's vocabulary for ``make_model(vocab=...)``: its ``tokenizers`` JSON (exact:
    ``pantheon.core.gguf_tokenizer``), size, special tokens and chat template."""

    path: Path
    tokenizer_json: str
    size: int
    specials: dict[str, str]  # bos_token, eos_token, unk_token, pad_token: those the file names
    bos_id: int | None
    eos_ids: list[int]
    template: str | None

    @property
    def overrides(self) -> dict:
        """The config keys that follow the vocabulary."""
        out: dict = {"vocab_size": self.size}
        if self.eos_ids:
            out["eos_token_id"] = self.eos_ids[0]
        if self.bos_id is not None:
            out["bos_token_id"] = self.bos_id
        return out


def _read_vocab(path: Path | str) -> RealVocab:
    from pantheon.core.gguf import chat_template, eos_token_ids, read_gguf, special_tokens, token_id
    from pantheon.core.gguf_tokenizer import tokenizer_json

    g = read_gguf(path)
    return RealVocab(
        path=Path(path),
        tokenizer_json=tokenizer_json(g),
        size=len(g.meta["tokenizer.ggml.tokens"]),
        specials=special_tokens(g),
        bos_id=token_id(g, "bos_token_id"),
        eos_ids=eos_token_ids(g),
        template=chat_template(g),
    )


def _write_vocab(out: Path, real: RealVocab, model_max_length: int) -> int:
    """The folder's tokenizer files replaced by ``real``'s: ``tokenizer.json`` as llama.cpp
    tokenizes it, ``tokenizer_config.json`` with its special tokens and its chat template (else the
    family's, which the preset's config already holds). Returns the vocabulary's size."""
    family = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = json.loads(real.tokenizer_json)["added_tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
            }
            for t in added
        },
        **{k: real.specials.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": real.template or family.get("chat_template"),
    }
    (out / "tokenizer.json").write_text(real.tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", config)
    return real.size


# ------------------------------------------------------------------------------------ the folder


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _apply_overrides(config: dict, overrides: dict) -> None:
    """Apply config overrides in place.

    A flat config takes them as they are. A nested one (Qwen3.5 VLM) sends a key of its
    ``text_config`` there (``tie_word_embeddings`` to both levels), merges a dict given for
    ``text_config`` / ``vision_config`` into that sub-config, and puts anything else at the top.
    For Qwen3.5, what depends on an overridden shape follows it unless given too: ``layer_types``
    (from ``num_hidden_layers`` and ``full_attention_interval``), the rope's ``mrope_section`` (from
    ``head_dim``) and the vision tower's ``out_hidden_size`` (from ``hidden_size``).
    """
    overrides = copy.deepcopy(overrides)
    text = text_config(config)
    nested = text is not config
    given: set[str] = set()
    for key, value in overrides.items():
        if nested and key in ("text_config", "vision_config") and isinstance(value, dict):
            config[key].update(value)
            given |= set(value) if key == "text_config" else {f"vision.{k}" for k in value}
            if key == "text_config" and "tie_word_embeddings" in value:
                config["tie_word_embeddings"] = value["tie_word_embeddings"]
        elif nested and key in text and key != "model_type":
            text[key] = value
            if key in config:
                config[key] = value
            given.add(key)
        else:
            config[key] = value
            given.add(key)
    if _is_gpt_oss(config) and "num_hidden_layers" in given and "layer_types" not in given:
        n = config["num_hidden_layers"]  # gpt-oss alternates, sliding first
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if not _is_qwen35(config):
        return
    shapes = ("num_hidden_layers", "full_attention_interval")
    if given & set(shapes) and "layer_types" not in given:
        text["layer_types"] = _layer_types(text["num_hidden_layers"], text["full_attention_interval"])
    if given & {"head_dim", "partial_rotary_factor"} and "rope_parameters" not in given:
        rope = text["rope_parameters"]
        rope["partial_rotary_factor"] = text["partial_rotary_factor"]
        rope["mrope_section"] = _mrope_section(text["head_dim"], text["partial_rotary_factor"])
    if nested and "hidden_size" in given and "vision.out_hidden_size" not in given:
        config["vision_config"]["out_hidden_size"] = text["hidden_size"]


def build_config(preset: str, *, dtype: str | None = None, **config_overrides) -> dict:
    """The HF ``config.json`` contents ``make_model`` writes for a preset (see there)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    config = copy.deepcopy(PRESETS[preset])
    _apply_overrides(config, config_overrides)
    if dtype is not None:
        config["torch_dtype"] = dtype
    if config["torch_dtype"] not in _DTYPES:
        raise ValueError(f"unsupported dtype {config['torch_dtype']!r}; use bfloat16, float16 or float32")
    config["torch_dtype"] = _DTYPES[config["torch_dtype"]][0]
    config["dtype"] = config["torch_dtype"]  # transformers 5 spelling; 4.x reads torch_dtype
    if "text_config" in config:  # where the Hub's Qwen3.5 configs keep it
        config["text_config"] = dict(sorted({**config["text_config"], "dtype": config["dtype"]}.items()))
    text = text_config(config)
    vocab = QWEN35_VOCAB_SIZE if _is_qwen35(config) else tt.VOCAB_SIZE
    if text["vocab_size"] < vocab:
        raise ValueError(f"vocab_size {text['vocab_size']} < tokenizer size {vocab}")
    return dict(sorted(config.items()))


def make_model(
    preset: str,
    out: Path | str,
    *,
    seed: int = 0,
    dtype: str | None = None,
    shard_bytes: int | None = None,
    mxfp4: bool = False,
    gemma_tokenizer: bool = False,
    fast: bool = False,
    vocab: Path | str | None = None,
    **config_overrides,
) -> Path:
    """Write the preset's folder into `out` (created if missing) and return it (as a Path).

    ``seed`` seeds the weights (same seed, same bytes). ``dtype`` (bfloat16 / float16 / float32)
    replaces the preset's. ``shard_bytes`` splits the weights into ``model-0000i-of-0000n``
    shards of at most that many bytes, with ``model.safetensors.index.json``.
    ``mxfp4``: a gpt-oss folder's experts stored as MXFP4 blocks and scales, as the Hub ships them
    (``_write_mxfp4``). ``config_overrides`` replace (or add) keys of the preset's HF config, e.g.
    ``num_hidden_layers=3``, ``tie_word_embeddings=False``, ``rope_scaling={...}``; for a nested
    (Qwen3.5 VLM) config see ``_apply_overrides``. ``gemma_tokenizer``: a Gemma 4 folder with
    Gemma's kind of tokenizer (``gemma4_spm_tokenizer_json``), which llama.cpp's converter takes.
    ``fast``: the weights are windows of one pool of random values (``_tensor_chunks``), written
    at the disk's speed: for timing runs (an 8B folder in seconds), not for reference tests.
    ``vocab``: a GGUF file (llama.cpp's ``ggml-vocab-*.gguf``, or any model's) whose vocabulary
    replaces the preset's tokenizer (``_write_vocab``): ``vocab_size`` and the BOS/EOS ids follow it.
    """
    real = _read_vocab(vocab) if vocab is not None else None
    if real is not None:
        config_overrides = {**real.overrides, **config_overrides}
    config = build_config(preset, dtype=dtype, **config_overrides)
    text = text_config(config)
    qwen35 = _is_qwen35(config)
    if gemma_tokenizer and not _is_gemma4(config):
        raise ValueError("gemma_tokenizer is for the Gemma 4 presets")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    endoftext = tt.TOKEN_IDS["<|endoftext|>"]
    generation = dict(
        bos_token_id=text["bos_token_id"],
        eos_token_id=[text["eos_token_id"], endoftext],
        pad_token_id=endoftext,
        **GENERATION_DEFAULTS,
    )
    if _is_gpt_oss(config):  # <|return|> and <|call|> end a turn, as gpt-oss's
        generation["eos_token_id"] = [*GPT_OSS_EOS, endoftext]
    _write_json(out / "generation_config.json", generation)
    if qwen35:
        (out / "tokenizer.json").write_text(qwen35_tokenizer_json(), encoding="utf-8")
        _write_json(out / "tokenizer_config.json", qwen35_tokenizer_config(text["max_position_embeddings"]))
    elif _is_gemma3(config):
        (out / "tokenizer.json").write_text(gemma3_tokenizer_json(), encoding="utf-8")
        _write_json(out / "tokenizer_config.json", gemma3_tokenizer_config(text["max_position_embeddings"]))
    elif _is_gemma4(config):
        tok_json, tok_config = (
            (gemma4_spm_tokenizer_json, gemma4_spm_tokenizer_config)
            if gemma_tokenizer
            else (gemma4_tokenizer_json, gemma4_tokenizer_config)
        )
        (out / "tokenizer.json").write_text(tok_json(), encoding="utf-8")
        _write_json(out / "tokenizer_config.json", tok_config(text["max_position_embeddings"]))
    elif _is_gpt_oss(config):
        (out / "tokenizer.json").write_text(gpt_oss_tokenizer_json(), encoding="utf-8")
        _write_json(out / "tokenizer_config.json", gpt_oss_tokenizer_config(text["max_position_embeddings"]))
    else:
        tt.write_tokenizer(out, model_max_length=text["max_position_embeddings"])
    real_vocab = QWEN35_VOCAB_SIZE if qwen35 else tt.VOCAB_SIZE
    if _is_gemma3(config):
        real_vocab = GEMMA3_VOCAB_SIZE
    if _is_gemma4(config):
        real_vocab = GEMMA4_VOCAB_SIZE
    if _is_gpt_oss(config):
        real_vocab = GPT_OSS_VOCAB_SIZE
    if real is not None:
        real_vocab = _write_vocab(out, real, text["max_position_embeddings"])
        generation["eos_token_id"] = real.eos_ids
        _write_json(out / "generation_config.json", generation)
    if mxfp4 and not _is_gpt_oss(config):
        raise ValueError("mxfp4 folders are gpt-oss's only")
    if mxfp4 and shard_bytes:
        raise ValueError("mxfp4 folders are written unsharded")
    write_weights(
        out,
        config,
        seed=seed,
        jitter=_NORM_JITTER.get(preset, 0.0),
        shard_bytes=shard_bytes,
        real_vocab=real_vocab,
        fast=fast,
        mxfp4=mxfp4,
    )
    write_sentence_transformers(out, preset, config)
    return out


# ------------------------------------------------------------------------------------------- CLI


def _describe(name: str, config: dict) -> str:
    params = sum(_numel(shape) for _, shape, _ in tensor_specs(config))
    size = params * _DTYPES[config["torch_dtype"]][2]
    text = text_config(config)
    return (
        f"{name:<17} {config['architectures'][0]:<31} layers={text['num_hidden_layers']:<3} "
        f"hidden={text['hidden_size']:<5} vocab={text['vocab_size']:<7} "
        f"params={params / 1e6:.2f}M  {config['torch_dtype']} ~{size / 2**20:.1f} MiB"
    )


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def cli(argv: list[str]) -> int:
    """``pantheon make-model --preset NAME --out DIR [--seed N] [--dtype D]``; ``--list``."""
    parser = argparse.ArgumentParser(prog="pantheon make-model", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the presets and exit")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="which preset to write")
    parser.add_argument("--out", type=Path, help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="weight dtype")
    parser.add_argument("--shard-bytes", type=int, help="split weights into shards of this size")
    parser.add_argument("--mxfp4", action="store_true", help="gpt-oss: experts as MXFP4 blocks and scales")
    parser.add_argument(
        "--gemma-tokenizer",
        action="store_true",
        help="Gemma 4: Gemma's kind of tokenizer (what llama.cpp's converter takes)",
    )
    parser.add_argument(
        "--vocab",
        type=Path,
        metavar="FILE.gguf",
        help="a GGUF file whose vocabulary replaces the preset's tokenizer (llama.cpp's "
        "models/ggml-vocab-*.gguf, or any model's); vocab_size and the BOS/EOS ids follow it",
    )
    parser.add_argument(
        "--fast-random",
        action="store_true",
        help="weights as windows of one pool of random values: written at the disk's speed "
        "(an 8B folder in seconds), for timing runs only",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        type=_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (JSON value), repeatable",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, config in PRESETS.items():
            print(_describe(name, config))
        return 0
    if not args.preset or not args.out:
        parser.print_usage(sys.stderr)
        print("pantheon make-model: --preset and --out are required (or --list)", file=sys.stderr)
        return 2
    out = make_model(
        args.preset,
        args.out,
        seed=args.seed,
        dtype=args.dtype,
        shard_bytes=args.shard_bytes,
        mxfp4=args.mxfp4,
        gemma_tokenizer=args.gemma_tokenizer,
        fast=args.fast_random,
        vocab=args.vocab,
        **dict(args.overrides),
    )
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {args.preset} to {out} ({size / 2**20:.1f} MiB)")
    return 0
