"""The Llama family's description: Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm),
SmolLM and Mistral (Llama's layout, with its ``sliding_window`` on every layer when set; Qwen2 and
Qwen3 with ``use_sliding_window`` slide from ``max_window_layers`` on). Every layer is attention with a paged KV cache and a SwiGLU
MLP; q/k/v and gate/up are fused (``workers/models/llama.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.description import (
    AttentionCache,
    LayerSpec,
    ModelDescription,
    ModelError,
    decoder_fields,
    pos_int,
)


@dataclass(frozen=True, kw_only=True)
class LlamaDescription(ModelDescription):
    attention_bias: bool  # q/k/v biases (Qwen2 always, Llama/Qwen3 when attention_bias is set)
    o_bias: bool  # o_proj bias: Llama/Qwen3 with attention_bias; never in Qwen2
    qk_norm: bool  # Qwen3's per-head RMSNorm on q and k


def attention_head_shape(raw: dict, where: str) -> tuple[int, int, int, int]:
    """(hidden, heads, kv heads, head dim) of a config's attention layers, checked."""
    hidden = pos_int(raw, "hidden_size", where)
    heads = pos_int(raw, "num_attention_heads", where)
    kv_heads = pos_int(raw, "num_key_value_heads", where, default=heads)
    head_dim = pos_int(raw, "head_dim", where, default=hidden // heads)
    if heads % kv_heads:
        raise ModelError(
            "invalid",
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
        )
    return hidden, heads, kv_heads, head_dim


def describe(raw: dict, gen: dict, where: str, arch: str) -> LlamaDescription:
    window = raw.get("sliding_window")
    if (
        window is not None
        and raw.get("use_sliding_window", True)
        and window < int(raw.get("max_position_embeddings") or 4096)
    ):
        window = pos_int(raw, "sliding_window", where)
    else:
        window = None
    hidden, heads, kv_heads, head_dim = attention_head_shape(raw, where)
    inter = pos_int(raw, "intermediate_size", where)
    layers = pos_int(raw, "num_hidden_layers", where)
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = arch == "qwen2" or bool(raw.get("attention_bias", False))
    o_bias = arch != "qwen2" and bool(raw.get("attention_bias", False))
    qk_norm = arch == "qwen3"
    small = (
        2 * hidden
        + (q + 2 * kv if bias else 0)
        + (hidden if o_bias else 0)
        + (2 * head_dim if qk_norm else 0)
    )
    slides = _sliding_layers(raw, where, arch, layers, window)

    def spec(i: int) -> LayerSpec:
        return LayerSpec(
            kind="attention",
            linears=((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)),
            small=small,
            cache=AttentionCache(kv_heads, head_dim, window if slides[i] else None),
        )

    return LlamaDescription(
        family="llama",
        arch=arch,
        **decoder_fields(
            raw, gen, where, head_shape=(hidden, heads, kv_heads, head_dim), default_context=4096
        ),
        layers=tuple(spec(i) for i in range(layers)),
        attention_bias=bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
    )


def _sliding_layers(raw: dict, where: str, arch: str, n: int, window: int | None) -> list[bool]:
    """Which layers read only the window: every one for Mistral; for Qwen2 / Qwen3 with
    ``use_sliding_window``, ``layer_types`` if given, else layers from ``max_window_layers`` on
    (as transformers' configs build them)."""
    if window is None:
        return [False] * n
    if arch == "llama":
        return [True] * n
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ModelError("invalid", f"{where}: max_window_layers must be an integer >= 0, got {first!r}")
        return [i >= first for i in range(n)]
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in ("sliding_attention", "full_attention") for t in types)
    ):
        raise ModelError(
            "invalid", f"{where}: layer_types must list {n} of 'sliding_attention' / 'full_attention'"
        )
    return [t == "sliding_attention" for t in types]


FAMILY = Family(
    name="llama",
    hf_architectures={
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        # the base models, as sentence-transformers saves an embedding model (Qwen3-Embedding)
        "LlamaModel": "llama",
        "MistralModel": "llama",
        "Qwen2Model": "qwen2",
        "Qwen3Model": "qwen3",
    },
    base_architectures=frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"}),
    model_types={"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},
    gguf_architectures={
        "llama": ("LlamaForCausalLM", "llama"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"),
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    },
    describe=describe,
)
