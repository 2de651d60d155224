"""Gemma 4, the text model (``Gemma4ForCausalLM``, and the language model of
``Gemma4ForConditionalGeneration``: the text config nested under ``text_config``; the vision and
audio towers are skipped). Torch side: ``workers/models/gemma4.py``; reference: transformers'
``models/gemma4/modeling_gemma4.py`` (5.25).

What a text forward pass needs beyond Gemma 3 (``gemma3.py``):

- per-layer attention shapes: the full ("global") layers have their own head dim
  (``global_head_dim``, 512 by default) and, with ``attention_k_eq_v``, their own KV head count
  (``num_global_key_value_heads``) and no V projection: V is the K projection's output (before
  the k norm and RoPE). transformers 5.25 writes these as ``per_layer_config`` overrides by layer
  index; the Hub's configs as the two keys;
- RoPE per layer kind from ``rope_parameters``: the sliding layers' plain RoPE (base 10,000),
  the full layers' "proportional" RoPE: ``partial_rotary_factor`` of the frequencies of a
  full-head-dim RoPE, the rest zero (those dimensions pass through), over base 1,000,000;
- plain RMSNorms (``w * x``, weights around 1, not Gemma 3's ``1 + w``), a scale-less RMSNorm on
  V, no score scaling (q is normed: ``scaling = 1``);
- ``layer_scalar``: each layer's output is multiplied by a stored scalar;
- KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V; each reads that of the
  last earlier layer of its kind (the cache spec ``SharedKV``: no cache of its own), and with
  ``use_double_wide_mlp`` their MLP is twice as wide;
- per-layer embeddings (``hidden_size_per_layer_input`` P > 0, the E-series): a second table
  ``[vocab_per_layer, L * P]`` scaled by sqrt(P), plus a projection of the scaled embedding
  ``[L * P, hidden]`` times hidden^-0.5, RMS-normed per layer, the two summed times 2^-0.5; each
  layer then adds ``norm(proj(gelu(gate(h)) * ple_i))`` to its output;
- ``enable_moe_block`` (26B-A4B): beside the dense MLP, a routed mixture of GeGLU experts on the
  layer's input (its own router: a scale-less norm, a learned scale times hidden^-0.5, softmax,
  top k renormalised, times a per-expert scale), each branch normed, summed, normed again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.archs.gemma3 import FULL, SLIDING, layer_windows
from pantheon.core.archs.qwen3_5 import text_config
from pantheon.core.description import (
    AttentionCache,
    ExpertSpec,
    LayerSpec,
    ModelDescription,
    ModelError,
    RopeConfig,
    SharedKV,
    decoder_fields,
    pos_int,
    rope_from,
)
from pantheon.core.gguf import GGUFError, GGUFFile, _field, read_f32

# transformers' Gemma4TextConfig defaults: a Hub config writes only what differs from them
DEFAULTS: dict[str, object] = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=True,
    sliding_window=512,
    vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256,
    global_head_dim=512,
)
# keys whose null means "off", not "the default"
_NULLABLE = ("hidden_size_per_layer_input", "final_logit_softcapping", "num_global_key_value_heads")
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class Gemma4Attention:
    """One layer's attention and MLP shape."""

    kind: str  # sliding_attention | full_attention
    head_dim: int
    kv_heads: int
    k_eq_v: bool  # no V projection: V is K's projection
    shares: int | None  # the layer whose K/V it reads (KV sharing), None: its own
    intermediate: int  # its dense MLP's (twice the config's in a double-wide KV-shared layer)


@dataclass(frozen=True, kw_only=True)
class Gemma4Description(ModelDescription):
    # ``head_dim``, ``num_kv_heads`` and ``rope`` are the sliding layers' (the runner's step
    # tables); the full layers' come from ``attn`` and ``global_rope``.
    attn: tuple[Gemma4Attention, ...]
    sliding_window: int
    global_rope: RopeConfig  # type "proportional": ``scaling`` holds partial_rotary_factor, factor
    final_logit_softcapping: float | None
    attention_bias: bool
    ple_dim: int  # hidden_size_per_layer_input; 0: no per-layer embeddings
    ple_vocab: int
    moe_experts: ExpertSpec | None  # the 26B-A4B's routed experts (every layer), None: dense

    @property
    def attention_scale(self) -> float:
        return 1.0  # q is RMS-normed; transformers' Gemma4TextAttention.scaling

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(a.kind for a in self.attn)


def _flag(raw: dict, key: str, where: str) -> bool:
    v = raw.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ModelError("invalid", f"{where}: {key} must be true or false, got {v!r}")
    return v


def _ropes(raw: dict, where: str, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(sliding, full) RoPE from ``rope_parameters`` keyed by layer kind (Gemma 4 has no older
    spelling), each missing kind or key from transformers' defaults."""
    params = raw.get("rope_parameters")
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict) or not (SLIDING in params or FULL in params):
        raise ModelError("invalid", f"{where}: rope_parameters must be keyed by {SLIDING!r} / {FULL!r}")
    local = {**DEFAULT_ROPE[SLIDING], **(params.get(SLIDING) or {})}
    full = {**DEFAULT_ROPE[FULL], **(params.get(FULL) or {})}
    loc = rope_from({"rope_parameters": local}, where, head_dim)
    if loc.type not in ("default", "linear") or loc.rotary_dim:
        raise ModelError("unsupported", f"{where}: sliding layers' rope {local!r} is not supported")
    kind = full.get("rope_type") or full.get("type") or "default"
    if kind not in ("default", "proportional"):
        raise ModelError("unsupported", f"{where}: full layers' rope type {kind!r} is not supported")
    partial = full.get("partial_rotary_factor", 1.0) if kind == "proportional" else 1.0
    factor = full.get("factor", 1.0) if kind == "proportional" else 1.0
    for name, v in (("partial_rotary_factor", partial), ("factor", factor)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0 or (name[0] == "p" and v > 1):
            raise ModelError("invalid", f"{where}: full layers' rope {name} {v!r}")
    theta = full.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelError("invalid", f"{where}: full layers' rope_theta {theta!r}")
    glob = RopeConfig(
        theta=float(theta),
        type="proportional",
        scaling={"partial_rotary_factor": float(partial), "factor": float(factor)},
    )
    return loc, glob


def sharing_sources(types: list[str], shared: int, where: str) -> list[int | None]:
    """For each layer, the layer whose K/V it reads: the last ``shared`` layers read the last
    earlier non-shared layer of their kind (transformers' ``kv_sharing_modes``), the rest their own."""
    n = len(types)
    if not 0 <= shared < n:
        raise ModelError("invalid", f"{where}: num_kv_shared_layers {shared} must be in [0, {n})")
    first = n - shared
    last: dict[str, int] = {}
    for i in range(first):
        last[types[i]] = i
    out: list[int | None] = [None] * n
    for i in range(first, n):
        if types[i] not in last:
            raise ModelError(
                "invalid", f"{where}: KV-shared layer {i} ({types[i]}) has no earlier layer of its kind"
            )
        out[i] = last[types[i]]
    return out


def _layer_overrides(raw: dict, i: int) -> dict:
    per = raw.get("per_layer_config")
    if not isinstance(per, dict):
        return {}
    got = per.get(str(i), per.get(i))  # JSON keys are strings; a dict built in Python may use ints
    return got if isinstance(got, dict) else {}


def describe(raw: dict, gen: dict, where: str, arch: str) -> Gemma4Description:
    multimodal = isinstance(raw.get("text_config"), dict)
    text = text_config(raw)
    raw = {**DEFAULTS, **{k: v for k, v in text.items() if v is not None or k in _NULLABLE}}
    hidden = pos_int(raw, "hidden_size", where)
    heads = pos_int(raw, "num_attention_heads", where)
    kv_heads = pos_int(raw, "num_key_value_heads", where)
    head_dim = pos_int(raw, "head_dim", where)
    inter = pos_int(raw, "intermediate_size", where)
    n = pos_int(raw, "num_hidden_layers", where)
    types, window = layer_windows(raw, n, where, every=6)
    types = [*types[:-1], FULL]  # transformers forces the last layer to full attention
    if raw.get("use_bidirectional_attention"):
        raise ModelError("unsupported", f"{where}: use_bidirectional_attention (an embedding model)")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(
            "unsupported", f"{where}: hidden_activation {act!r} (Gemma 4's is gelu_pytorch_tanh)"
        )
    cap = raw.get("final_logit_softcapping")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
        raise ModelError("invalid", f"{where}: final_logit_softcapping must be positive, got {cap!r}")
    k_eq_v = _flag(raw, "attention_k_eq_v", where)
    double = _flag(raw, "use_double_wide_mlp", where)
    bias = _flag(raw, "attention_bias", where)
    shared = raw.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or isinstance(shared, bool):
        raise ModelError("invalid", f"{where}: num_kv_shared_layers must be a count, got {shared!r}")
    sources = sharing_sources(types, shared, where)
    global_hd = pos_int(raw, "global_head_dim", where)
    global_kv = raw.get("num_global_key_value_heads")
    ple = raw.get("hidden_size_per_layer_input") or 0
    if not isinstance(ple, int) or isinstance(ple, bool) or ple < 0:
        raise ModelError("invalid", f"{where}: hidden_size_per_layer_input must be a count, got {ple!r}")
    ple_vocab = pos_int(raw, "vocab_size_per_layer_input", where) if ple else 0
    experts = None
    if _flag(raw, "enable_moe_block", where):
        experts = ExpertSpec(
            count=pos_int(raw, "num_experts", where),
            top_k=pos_int(raw, "top_k_experts", where),
            intermediate=pos_int(raw, "moe_intermediate_size", where),
            hidden=hidden,
        )
        if experts.top_k > experts.count:
            raise ModelError(
                "invalid", f"{where}: top_k_experts {experts.top_k} > num_experts {experts.count}"
            )

    attn: list[Gemma4Attention] = []
    for i, t in enumerate(types):
        hd, kvh = head_dim, kv_heads
        if t == FULL:
            hd = global_hd
            if k_eq_v and global_kv is not None:
                kvh = pos_int(raw, "num_global_key_value_heads", where)
        over = _layer_overrides(raw, i)
        if over:  # transformers 5.25's spelling of the same
            hd = pos_int(over, "head_dim", f"{where}: per_layer_config[{i}]", default=hd)
            kvh = pos_int(over, "num_key_value_heads", f"{where}: per_layer_config[{i}]", default=kvh)
        if heads % kvh:
            raise ModelError(
                "invalid", f"{where}: layer {i}: {heads} heads are not a multiple of {kvh} KV heads"
            )
        shares = sources[i]
        attn.append(
            Gemma4Attention(
                kind=t,
                head_dim=hd,
                kv_heads=kvh,
                k_eq_v=k_eq_v and t == FULL,
                shares=shares,
                intermediate=inter * (2 if double and shares is not None else 1),
            )
        )
    for i, a in enumerate(attn):
        if a.shares is not None:
            src = attn[a.shares]
            if (src.head_dim, src.kv_heads) != (a.head_dim, a.kv_heads):
                raise ModelError(
                    "invalid", f"{where}: layer {i} shares layer {a.shares}'s KV of another shape"
                )
    loc, glob = _ropes(raw, where, head_dim)

    def spec(i: int, a: Gemma4Attention) -> LayerSpec:
        q, kv = heads * a.head_dim, a.kv_heads * a.head_dim
        own_kv = 0 if a.shares is not None else (kv if a.k_eq_v else 2 * kv)
        linears = [(q + own_kv, hidden), (hidden, q), (2 * a.intermediate, hidden), (hidden, a.intermediate)]
        small = 4 * hidden + a.head_dim + 1  # layer norms, q norm, layer_scalar
        if a.shares is None:
            small += a.head_dim  # k norm (the v norm has no weight)
        if bias:
            small += q + own_kv + hidden
        if ple:
            linears += [(ple, hidden), (hidden, ple)]
            small += hidden
        if experts is not None:
            # the router (dense on every path), its scale, per-expert scale, three norms
            small += experts.count * hidden + hidden + experts.count + 3 * hidden
        cache = (
            SharedKV(a.shares)
            if a.shares is not None
            else AttentionCache(a.kv_heads, a.head_dim, window if a.kind == SLIDING else None)
        )
        return LayerSpec(kind="attention", linears=tuple(linears), small=small, cache=cache, experts=experts)

    fields = decoder_fields(
        {**raw, "rope_parameters": None, "rope_theta": loc.theta},
        gen,
        where,
        head_shape=(hidden, heads, kv_heads, head_dim),
        default_context=131072,
    )
    fields["rope"] = loc
    skipped = ("the vision and audio towers and their embedders",) if multimodal else ()
    return Gemma4Description(
        family="gemma4",
        arch=arch,
        **fields,
        layers=tuple(spec(i, a) for i, a in enumerate(attn)),
        skipped=skipped,
        extra_params=(ple_vocab * n * ple + n * ple * hidden + ple) if ple else 0,
        attn=tuple(attn),
        sliding_window=window,
        global_rope=glob,
        final_logit_softcapping=None if cap is None else float(cap),
        attention_bias=bias,
        ple_dim=ple,
        ple_vocab=ple_vocab,
        moe_experts=experts,
    )


_UNROTATED = 1e29  # a rope_freqs factor this large (the converter's 1e30) stops the rotation


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``gemma4`` GGUF file's own fields, as llama.cpp's converter writes them (its
    ``Gemma4Model``) and ``src/models/gemma4*.cpp`` reads them:

    - per-layer arrays: ``attention.head_count_kv`` (the full layers' KV heads) and
      ``feed_forward_length`` (twice as wide in the KV-shared layers with ``use_double_wide_mlp``),
      both written as ``per_layer_config`` overrides / the flag here;
    - ``attention.key_length`` is the full layers' head dim, ``key_length_swa`` the sliding ones';
    - the layer kinds from ``attention.sliding_window_pattern`` (booleans);
    - the full layers' proportional RoPE as the tensor ``rope_freqs.weight``: a factor per
      frequency, 1 for the rotated ones and 1e30 for the rest (frequency ~0: they pass through),
      so ``partial_rotary_factor`` is the count of ones over head_dim / 2; its base
      ``rope.freq_base``, the sliding layers' ``rope.freq_base_swa``;
    - ``attention_k_eq_v``: no ``attn_v`` tensor in a full layer that owns its KV;
    - ``attention.shared_kv_layers``, ``embedding_length_per_layer_input`` (0: none; the table's
      rows are ``vocab_size_per_layer_input``), the experts (``expert_count``,
      ``expert_used_count``, ``expert_feed_forward_length``: the 26B-A4B's MoE block)."""
    a = g.arch
    n = raw["num_hidden_layers"]
    where = f"{g.path}: metadata field"

    def per_layer(key: str) -> list[int]:
        v = g.meta.get(f"{a}.{key}")
        if isinstance(v, list):
            if len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
                raise GGUFError("invalid", f"{where} '{a}.{key}' must list {n} positive counts, got {v!r}")
            return v
        return [_field(g, f"{a}.{key}")] * n

    pattern = g.meta.get(f"{a}.attention.sliding_window_pattern")
    if not (isinstance(pattern, list) and len(pattern) == n and all(isinstance(p, bool) for p in pattern)):
        raise GGUFError(
            "invalid",
            f"{where} '{a}.attention.sliding_window_pattern' must list {n} booleans, got {pattern!r}",
        )
    types = [SLIDING if p else FULL for p in pattern]
    head_full = _field(g, f"{a}.attention.key_length")
    head_swa = _field(g, f"{a}.attention.key_length_swa", default=head_full)
    for key, want in (("value_length", head_full), ("value_length_swa", head_swa)):
        if _field(g, f"{a}.attention.{key}", default=want) != want:
            raise GGUFError("unsupported", f"{where} '{a}.attention.{key}' differs from the key length")
    if _field(g, f"{a}.rope.dimension_count_swa", default=head_swa) != head_swa:
        raise GGUFError(
            "unsupported", f"{where} '{a}.rope.dimension_count_swa': partial RoPE on sliding layers"
        )
    kv = per_layer("attention.head_count_kv")
    ffn = per_layer("feed_forward_length")
    shared = g.meta.get(f"{a}.attention.shared_kv_layers", 0)
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < n:
        raise GGUFError(
            "invalid", f"{where} '{a}.attention.shared_kv_layers' must be in [0, {n}), got {shared!r}"
        )
    first_shared = n - shared
    double = any(ffn[i] != ffn[0] for i in range(first_shared, n))
    want_ffn = [ffn[0] * (2 if double and i >= first_shared else 1) for i in range(n)]
    if ffn != want_ffn:
        raise GGUFError(
            "unsupported",
            f"{where} '{a}.feed_forward_length' {ffn} (only the KV-shared layers may differ, twice as wide)",
        )
    owners = [i for i in range(first_shared) if types[i] == FULL]
    k_eq_v = bool(owners) and all(f"blk.{i}.attn_v.weight" not in g.tensors for i in owners)
    partial = 1.0
    if "rope_freqs.weight" in g.tensors:
        freqs = read_f32(g, "rope_freqs.weight")
        rotated = sum(1 for f in freqs if f == 1.0)
        if len(freqs) != head_full // 2 or any(f < _UNROTATED for f in freqs[rotated:]):
            raise GGUFError(
                "unsupported",
                f"{g.path}: tensor 'rope_freqs.weight' is not proportional RoPE's "
                f"(ones, then 1e30 over the rest of {head_full // 2} frequencies)",
            )
        partial = rotated / len(freqs)
    ple = g.meta.get(f"{a}.embedding_length_per_layer_input", 0)
    if not isinstance(ple, int) or isinstance(ple, bool) or ple < 0:
        raise GGUFError(
            "invalid", f"{where} '{a}.embedding_length_per_layer_input' must be a count, got {ple!r}"
        )
    ple_table = g.tensors.get("per_layer_token_embd.weight")
    experts = g.meta.get(f"{a}.expert_count", 0)
    raw.update(
        layer_types=types,
        sliding_window=_field(g, f"{a}.attention.sliding_window"),
        head_dim=head_swa,
        global_head_dim=head_full,
        num_key_value_heads=kv[types.index(SLIDING)] if SLIDING in types else kv[0],
        num_global_key_value_heads=None,
        per_layer_config={
            str(i): {"head_dim": head_full if t == FULL else head_swa, "num_key_value_heads": kv[i]}
            for i, t in enumerate(types)
        },
        intermediate_size=ffn[0],
        use_double_wide_mlp=double,
        num_kv_shared_layers=shared,
        attention_k_eq_v=k_eq_v,
        rope_parameters={
            SLIDING: {
                "rope_type": "default",
                "rope_theta": float(_field(g, f"{a}.rope.freq_base_swa", float, 10_000.0)),
            },
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": partial,
                "rope_theta": raw["rope_theta"],
            },
        },
        final_logit_softcapping=g.meta.get(f"{a}.final_logit_softcapping") or None,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size_per_layer_input=ple or None,
        vocab_size_per_layer_input=ple_table.shape[0] if ple and ple_table is not None else raw["vocab_size"],
        enable_moe_block=bool(experts),
    )
    if experts:
        raw.update(
            num_experts=_field(g, f"{a}.expert_count"),
            top_k_experts=_field(g, f"{a}.expert_used_count"),
            moe_intermediate_size=_field(g, f"{a}.expert_feed_forward_length"),
        )
    raw.pop("rope_scaling", None)
    raw.pop("partial_rotary_factor", None)


FAMILY = Family(
    name="gemma4",
    hf_architectures={
        "Gemma4ForCausalLM": "gemma4",
        "Gemma4ForConditionalGeneration": "gemma4",
    },
    model_types={"gemma4": "gemma4", "gemma4_text": "gemma4"},
    gguf_architectures={"gemma4": ("Gemma4ForCausalLM", "gemma4_text")},
    describe=describe,
    gguf_config=gguf_config,
    gguf_own=frozenset({"rope_freqs.weight", "attention.head_count_kv", "feed_forward_length"}),
)
