"""Gemma 3, the text model: attention layers, five sliding-window ("local") to one full ("global")
by default (``layer_types``, else ``sliding_window_pattern``), each with its own RoPE: the local
layers' base ``rope_local_base_freq`` (10,000), the global ones' ``rope_theta`` (1,000,000) with
its scaling. Embeddings times sqrt(hidden); four zero-centred RMSNorms per layer (before and after
attention, before and after the MLP) and per-head q/k norms; scores scaled by
``query_pre_attn_scalar ** -0.5``; a GeGLU MLP (tanh-approximated GELU); the final logits
soft-capped when ``final_logit_softcapping`` is set. Both checkpoint layouts: ``Gemma3ForCausalLM``
(a text config, as Gemma 3 1B) and ``Gemma3ForConditionalGeneration`` (the text config nested under
``text_config``; the vision tower and its projector are skipped). Torch side:
``workers/models/gemma3.py``; reference: transformers' ``models/gemma3/modeling_gemma3.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.archs.llama import attention_head_shape
from pantheon.core.archs.qwen3_5 import text_config
from pantheon.core.description import (
    AttentionCache,
    LayerSpec,
    ModelDescription,
    ModelError,
    RopeConfig,
    decoder_fields,
    pos_int,
    rope_from,
)
from pantheon.core.gguf import GGUFFile, _field

SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig.default_theta
# transformers' Gemma3TextConfig defaults (Gemma 3 2B's shapes): the Hub's multimodal configs
# write only what differs from them in their text_config (gemma-3-4b-it's has no head counts).
DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)


@dataclass(frozen=True, kw_only=True)
class Gemma3Description(ModelDescription):
    layer_types: tuple[str, ...]  # sliding_attention | full_attention, per layer
    sliding_window: int
    local_rope: RopeConfig  # the sliding layers' (``rope`` is the full layers')
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attention_bias: bool

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def sliding_rope(self) -> RopeConfig | None:
        return self.local_rope


def _ropes(raw: dict, where: str, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE in either spelling: the Hub's ``rope_theta`` + ``rope_scaling`` +
    ``rope_local_base_freq``, or transformers 5's ``rope_parameters`` keyed by layer type."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
        full.setdefault("rope_theta", GLOBAL_THETA)
        local.setdefault("rope_theta", LOCAL_THETA)
        glob = rope_from({"rope_parameters": full}, where, head_dim)
        loc = rope_from({"rope_parameters": local}, where, head_dim)
    else:
        glob = rope_from({**raw, "rope_theta": raw.get("rope_theta", GLOBAL_THETA)}, where, head_dim)
        loc = RopeConfig(theta=float(raw.get("rope_local_base_freq") or LOCAL_THETA))
    if loc.type not in ("default", "linear"):
        # the runner's sliding-layer tables are per position, not per sequence (dynamic NTK)
        raise ModelError("unsupported", f"{where}: sliding layers' rope type {loc.type!r} is not supported")
    return glob, loc


def layer_windows(raw: dict, n: int, where: str, every: int) -> tuple[list[str], int]:
    """Each of the ``n`` layers' kind (``layer_types``, else every ``every``-th layer full, the
    rest sliding) and the sliding window (Gemma 3's and Gemma 4's configs alike)."""
    types = raw.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelError(
            "invalid", f"{where}: layer_types must list {n} of {SLIDING!r} / {FULL!r}, got {types!r}"
        )
    return types, pos_int(raw, "sliding_window", where)


def describe(raw: dict, gen: dict, where: str, arch: str) -> Gemma3Description:
    multimodal = isinstance(raw.get("text_config"), dict)
    raw = {**DEFAULTS, **{k: v for k, v in text_config(raw).items() if v is not None}}
    hidden, heads, kv_heads, head_dim = attention_head_shape(raw, where)
    inter = pos_int(raw, "intermediate_size", where)
    n = pos_int(raw, "num_hidden_layers", where)
    types, window = layer_windows(raw, n, where, pos_int(raw, "sliding_window_pattern", where, default=6))
    for key in ("attn_logit_softcapping",):
        if raw.get(key) is not None:
            raise ModelError("unsupported", f"{where}: {key} {raw[key]!r} is not supported (Gemma 2's)")
    if raw.get("use_bidirectional_attention"):
        raise ModelError("unsupported", f"{where}: use_bidirectional_attention (an embedding model)")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(
            "unsupported", f"{where}: hidden_activation {act!r} (Gemma 3's is gelu_pytorch_tanh)"
        )
    cap = raw.get("final_logit_softcapping")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
        raise ModelError("invalid", f"{where}: final_logit_softcapping must be positive, got {cap!r}")
    scalar = raw["query_pre_attn_scalar"]
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise ModelError("invalid", f"{where}: query_pre_attn_scalar must be positive, got {scalar!r}")
    glob, loc = _ropes(raw, where, head_dim)
    bias = bool(raw.get("attention_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter))
    small = 4 * hidden + 2 * head_dim + ((q + 2 * kv + hidden) if bias else 0)

    def spec(t: str) -> LayerSpec:
        return LayerSpec(
            kind="attention",
            linears=linears,
            small=small,
            cache=AttentionCache(kv_heads, head_dim, window if t == SLIDING else None),
        )

    fields = decoder_fields(
        {**raw, "rope_theta": glob.theta},  # checked again by _ropes; decoder_fields wants a flat one
        gen,
        where,
        head_shape=(hidden, heads, kv_heads, head_dim),
        default_context=131072,
    )
    fields["rope"] = glob
    skipped = ("the vision tower and its projector",) if multimodal else ()
    return Gemma3Description(
        family="gemma3",
        arch=arch,
        **fields,
        layers=tuple(spec(t) for t in types),
        skipped=skipped,
        layer_types=tuple(types),
        sliding_window=window,
        local_rope=loc,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=None if cap is None else float(cap),
        attention_bias=bias,
    )


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``gemma3`` GGUF file's own fields, as llama.cpp reads them (``src/models/gemma3.cpp``):
    ``attention.sliding_window`` (absent or 0: no sliding layers), the pattern from
    ``attention.sliding_window_pattern`` (an array of booleans per layer, or a period; default 6,
    which the converter does not write), the local base ``rope.freq_base_swa`` (default 10,000),
    ``final_logit_softcapping``; ``query_pre_attn_scalar`` is not stored: llama.cpp takes the head
    dim, or hidden / heads for the 62-layer 27B, and so does this."""
    a = g.arch
    n = raw["num_hidden_layers"]
    window = g.meta.get(f"{a}.attention.sliding_window", 0)
    pattern = g.meta.get(f"{a}.attention.sliding_window_pattern", 6)
    if not window:
        types = [FULL] * n
    elif isinstance(pattern, list):
        types = [SLIDING if p else FULL for p in pattern[:n]]
    else:
        types = [SLIDING if pattern == 0 or i % pattern < pattern - 1 else FULL for i in range(n)]
    raw.update(
        layer_types=types,
        sliding_window=window or None,
        rope_local_base_freq=float(_field(g, f"{a}.rope.freq_base_swa", float, LOCAL_THETA)),
        query_pre_attn_scalar=raw["hidden_size"] // raw["num_attention_heads"]
        if n == 62
        else raw["head_dim"],
        final_logit_softcapping=g.meta.get(f"{a}.final_logit_softcapping") or None,
        hidden_activation="gelu_pytorch_tanh",
    )


FAMILY = Family(
    name="gemma3",
    hf_architectures={
        "Gemma3ForCausalLM": "gemma3",
        "Gemma3ForConditionalGeneration": "gemma3",
    },
    model_types={"gemma3": "gemma3", "gemma3_text": "gemma3"},
    gguf_architectures={"gemma3": ("Gemma3ForCausalLM", "gemma3_text")},
    describe=describe,
    gguf_config=gguf_config,
)
