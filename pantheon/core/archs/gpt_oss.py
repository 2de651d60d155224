"""gpt-oss (``GptOssForCausalLM``, ``model_type: gpt_oss``: gpt-oss-20b and -120b). Every layer:
RMSNorm, attention with q/k/v/o biases and a learned sink per head (one more logit in each
head's softmax, no value), RMSNorm, a mixture of experts: ``num_local_experts`` experts with
biases, the top ``num_experts_per_tok`` of a router with a bias, weighted by a softmax over those
k logits, each a clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``) of gate and up columns that the
checkpoint interleaves. Layers alternate between a ``sliding_window`` (128) band and full
attention (``layer_types``, sliding first by default); RoPE is YaRN (factor 32 over 4096
positions, base 150,000) on every layer. The experts of the Hub's checkpoints are MXFP4
(``quantization_config.quant_method: mxfp4``: ``*_blocks`` / ``*_scales``), dequantized at load.
Torch side: ``workers/models/gpt_oss.py``; reference: transformers' ``models/gpt_oss``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.archs.llama import attention_head_shape
from pantheon.core.description import (
    AttentionCache,
    ExpertSpec,
    LayerSpec,
    ModelDescription,
    ModelError,
    decoder_fields,
    pos_int,
)
from pantheon.core.gguf import GGUFFile, _field

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 150_000.0  # transformers' GptOssConfig.default_theta
# transformers' GptOssConfig default when a config has no rope_parameters / rope_scaling
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass(frozen=True, kw_only=True)
class GptOssDescription(ModelDescription):
    layer_types: tuple[str, ...]  # sliding_attention | full_attention, per layer
    sliding_window: int | None
    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float
    attention_bias: bool
    mxfp4: bool  # the experts are stored as MXFP4 blocks and scales (dequantized at load)


def _number(raw: dict, key: str, where: str, default: float) -> float:
    v = raw.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ModelError("invalid", f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _mxfp4(raw: dict, where: str) -> bool:
    q = raw.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "mxfp4":
        raise ModelError(
            "unsupported", f"{where}: quantization_config quant_method {method!r} is not supported (mxfp4 is)"
        )
    return True


def describe(raw: dict, gen: dict, where: str, arch: str) -> GptOssDescription:
    hidden, heads, kv_heads, head_dim = attention_head_shape(raw, where)
    n = pos_int(raw, "num_hidden_layers", where)
    inter = pos_int(raw, "intermediate_size", where)
    experts = pos_int(raw, "num_local_experts", where, default=raw.get("num_experts") or 128)
    top_k = pos_int(raw, "num_experts_per_tok", where, default=4)
    if top_k > experts:
        raise ModelError(
            "invalid", f"{where}: num_experts_per_tok {top_k} exceeds num_local_experts {experts}"
        )
    # absent: transformers' 128; null: no window
    window = (
        None
        if "sliding_window" in raw and raw["sliding_window"] is None
        else pos_int(raw, "sliding_window", where, default=128)
    )
    types = raw.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelError(
            "invalid", f"{where}: layer_types must list {n} of {SLIDING!r} / {FULL!r}, got {types!r}"
        )
    if window is None:  # as transformers: no window, every layer sees the whole context
        types = [FULL] * n
    bias = bool(raw.get("attention_bias", True))
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = ((q + 2 * kv, hidden), (hidden, q))  # q/k/v, o
    # two norms, the sinks, the router (dense on every path) and its bias, the attention's biases
    small = 2 * hidden + heads + experts * (hidden + 1) + ((q + 2 * kv + hidden) if bias else 0)
    mxfp4 = _mxfp4(raw, where) or bool(raw.get("experts_mxfp4"))  # a folder's or a GGUF's
    spec = ExpertSpec(count=experts, top_k=top_k, intermediate=inter, hidden=hidden, bias=True, mxfp4=mxfp4)

    def layer(t: str) -> LayerSpec:
        return LayerSpec(
            kind="attention",
            linears=linears,
            small=small,
            cache=AttentionCache(kv_heads, head_dim, window if t == SLIDING else None),
            experts=spec,
        )

    given = raw.get("rope_parameters") or raw.get("rope_scaling")
    flat = dict(raw)
    if not isinstance(given, dict):
        flat["rope_scaling"] = dict(DEFAULT_ROPE)
    if raw.get("rope_theta") is None and not (isinstance(given, dict) and "rope_theta" in given):
        flat["rope_theta"] = DEFAULT_THETA
    fields = decoder_fields(
        flat, gen, where, head_shape=(hidden, heads, kv_heads, head_dim), default_context=131072
    )
    return GptOssDescription(
        family="gpt_oss",
        arch=arch,
        **fields,
        layers=tuple(layer(t) for t in types),
        layer_types=tuple(types),
        sliding_window=window,
        num_experts=experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=_number(raw, "swiglu_alpha", where, 1.702),
        swiglu_limit=_number(raw, "swiglu_limit", where, 7.0),
        attention_bias=bias,
        mxfp4=mxfp4,
    )


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``gpt-oss`` GGUF file's own fields, as llama.cpp reads them (``src/models/openai-moe-iswa``):
    the experts (``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``), the
    window (``attention.sliding_window``) on every other layer from the first (its SWA pattern 2),
    the SwiGLU's alpha and limit as its constants (1.702, 7.0: not stored). The YaRN fields are
    read with every family's (``rope.scaling.*``); the converter drops ``truncate``, false in every
    gpt-oss config, so it is set back."""
    a = g.arch
    n = raw["num_hidden_layers"]
    window = g.meta.get(f"{a}.attention.sliding_window") or None
    raw.update(
        num_local_experts=_field(g, f"{a}.expert_count"),
        num_experts_per_tok=_field(g, f"{a}.expert_used_count"),
        intermediate_size=_field(g, f"{a}.expert_feed_forward_length"),
        sliding_window=window,
        layer_types=[SLIDING if i % 2 == 0 else FULL for i in range(n)],
        attention_bias=True,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        # ours: llama.cpp's converter keeps the Hub's MXFP4 experts so (ExpertSpec.mxfp4)
        experts_mxfp4=getattr(g.tensors.get("blk.0.ffn_down_exps.weight"), "type_name", "") == "MXFP4",
    )
    if isinstance(raw.get("rope_scaling"), dict) and raw["rope_scaling"].get("rope_type") == "yarn":
        raw["rope_scaling"]["truncate"] = False


FAMILY = Family(
    name="gpt_oss",
    hf_architectures={"GptOssForCausalLM": "gpt_oss"},
    model_types={"gpt_oss": "gpt_oss"},
    gguf_architectures={"gpt-oss": ("GptOssForCausalLM", "gpt_oss")},
    describe=describe,
    gguf_config=gguf_config,
)
