"""Qwen3.5 and Qwen3.6 (dense), the text model: a hybrid of Gated DeltaNet layers (linear
attention with a recurrent state per sequence) and gated full-attention layers, 3 to 1 by default
(``layer_types``). Both checkpoint layouts: ``Qwen3_5ForCausalLM`` (a text-only config) and
``Qwen3_5ForConditionalGeneration`` (the Hub's, the text config nested under ``text_config``; its
vision tower and multi-token-prediction head are skipped). Torch side: ``workers/models/qwen3_5.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.archs.llama import attention_head_shape
from pantheon.core.description import (
    AttentionCache,
    LayerSpec,
    ModelDescription,
    ModelError,
    RecurrentState,
    StateTensor,
    decoder_fields,
    pos_int,
)
from pantheon.core.gguf import GGUFError, GGUFFile, _field

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class Qwen35Description(ModelDescription):
    layer_types: tuple[str, ...]  # linear_attention | full_attention, per layer
    attention_bias: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    mtp_layers: int = 0  # the checkpoint's multi-token-prediction layers (mtp.*), a draft's source

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v of the linear-attention layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim


def text_config(raw: dict) -> dict:
    """The text model's settings: a ForConditionalGeneration config nests them under
    ``text_config``; the top level may still hold the dtype, EOS ids and embedding tying."""
    inner = raw.get("text_config")
    if not isinstance(inner, dict):
        return raw
    out = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    out.update(inner)
    return out


def describe(raw: dict, gen: dict, where: str, arch: str) -> Qwen35Description:
    multimodal = isinstance(raw.get("text_config"), dict)
    raw = text_config(raw)
    hidden, heads, kv_heads, head_dim = attention_head_shape(raw, where)
    inter = pos_int(raw, "intermediate_size", where)
    n = pos_int(raw, "num_hidden_layers", where)
    types = raw.get("layer_types")
    if types is None:
        every = pos_int(raw, "full_attention_interval", where, default=4)
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        raise ModelError(
            "invalid", f"{where}: layer_types must list {n} of {LINEAR!r} / {FULL!r}, got {types!r}"
        )
    hk = pos_int(raw, "linear_num_key_heads", where, default=16)
    hv = pos_int(raw, "linear_num_value_heads", where, default=32)
    dk = pos_int(raw, "linear_key_head_dim", where, default=128)
    dv = pos_int(raw, "linear_value_head_dim", where, default=128)
    kernel = pos_int(raw, "linear_conv_kernel_dim", where, default=4)
    if hv % hk:
        raise ModelError(
            "invalid", f"{where}: linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}"
        )
    if kernel < 2:
        raise ModelError("invalid", f"{where}: linear_conv_kernel_dim must be at least 2, got {kernel}")
    bias = bool(raw.get("attention_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    mlp = ((2 * inter, hidden), (hidden, inter))
    full = LayerSpec(
        kind="attention",
        # q_proj carries the output gate: 2 * q rows (per head: q then gate), then k and v
        linears=((2 * q + 2 * kv, hidden), (hidden, q), *mlp),
        small=2 * hidden + 2 * head_dim + ((2 * q + 2 * kv + hidden) if bias else 0),
        cache=AttentionCache(kv_heads, head_dim),
    )
    conv_dim = 2 * hk * dk + hv * dv
    linear = LayerSpec(
        kind="linear_attention",
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a fused: one matrix read per step
        linears=((conv_dim + hv * dv + 2 * hv, hidden), (hidden, hv * dv), *mlp),
        small=2 * hidden + conv_dim * kernel + 2 * hv + dv,  # norms, conv, A_log + dt_bias, gated norm
        cache=RecurrentState(
            (
                StateTensor("conv", (conv_dim, kernel - 1), "model"),
                StateTensor("ssm", (hv, dk, dv), "float32"),
            )
        ),
    )
    skipped = ("the vision tower (model.visual.*)",) if multimodal else ()
    return Qwen35Description(
        family="qwen3_5",
        arch=arch,
        **decoder_fields(
            raw, gen, where, head_shape=(hidden, heads, kv_heads, head_dim), default_context=32768
        ),
        layers=tuple(full if t == FULL else linear for t in types),
        skipped=skipped
        + (
            ("the multi-token-prediction head (mtp.*), unless the load's draft is 'mtp'",)
            if raw.get("mtp_num_hidden_layers")
            else ()
        ),
        layer_types=tuple(types),
        attention_bias=bias,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        conv_kernel=kernel,
        mtp_layers=int(raw.get("mtp_num_hidden_layers") or 0),
    )


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``qwen35`` GGUF file's own fields, added to the ``config.json`` dict that
    ``pantheon.core.gguf.hf_config`` builds (``partial_rotary_factor`` it sets from
    ``rope.dimension_count``). llama.cpp's converter counts the multi-token-prediction blocks in
    ``block_count`` (``nextn_predict_layers`` of them, last; absent with ``--no-mtp``) and lists
    them in ``attention.recurrent_layers`` (as full attention); both are dropped here. Without
    ``recurrent_layers`` the schedule is every ``full_attention_interval``-th layer (default 4), as
    llama.cpp reads it. The linear-attention shapes are the ``ssm.*`` keys: ``conv_kernel``,
    ``state_size`` (key head dim), ``group_count`` (key heads), ``time_step_rank`` (value heads),
    ``inner_size`` (value heads * value head dim)."""
    a = g.arch
    blocks = _field(g, f"{a}.block_count")
    nextn = g.meta.get(f"{a}.nextn_predict_layers", 0)
    if not isinstance(nextn, int) or isinstance(nextn, bool) or not 0 <= nextn < blocks:
        raise GGUFError(
            "invalid",
            f"{g.path}: metadata field '{a}.nextn_predict_layers' must be an integer from 0 to "
            f"{blocks - 1} ('{a}.block_count' - 1), got {nextn!r}",
        )
    n = blocks - nextn
    key = f"{a}.attention.recurrent_layers"
    recurrent = g.meta.get(key)
    if recurrent is None:
        every = _field(g, f"{a}.full_attention_interval", default=4)
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    elif (
        not isinstance(recurrent, list)
        or len(recurrent) not in (n, blocks)
        or not all(isinstance(r, bool) for r in recurrent)
    ):
        raise GGUFError(
            "invalid",
            f"{g.path}: metadata field {key!r} must list {blocks} booleans ('{a}.block_count'), "
            f"got {recurrent!r}",
        )
    elif any(recurrent[n:]):
        raise GGUFError(
            "invalid",
            f"{g.path}: metadata field {key!r} marks a multi-token-prediction block (past the first {n}) "
            "recurrent",
        )
    else:
        types = [LINEAR if r else FULL for r in recurrent[:n]]
    hv = _field(g, f"{a}.ssm.time_step_rank")
    inner = _field(g, f"{a}.ssm.inner_size")
    if inner % hv:
        raise GGUFError(
            "invalid",
            f"{g.path}: metadata field '{a}.ssm.inner_size' ({inner}) is not a multiple of "
            f"'{a}.ssm.time_step_rank' ({hv}, the linear-attention value heads)",
        )
    # The base looks for blk.0.attn_q.bias, but block 0 is a linear-attention layer here.
    full = [i for i, t in enumerate(types) if t == FULL]
    raw.update(
        attention_bias=bool(full) and f"blk.{full[0]}.attn_q.bias" in g.tensors,
        num_hidden_layers=n,
        layer_types=types,
        linear_conv_kernel_dim=_field(g, f"{a}.ssm.conv_kernel"),
        linear_key_head_dim=_field(g, f"{a}.ssm.state_size"),
        linear_num_key_heads=_field(g, f"{a}.ssm.group_count"),
        linear_num_value_heads=hv,
        linear_value_head_dim=inner // hv,
        mtp_num_hidden_layers=nextn,  # kept in the file, not loaded: the description says so
    )


FAMILY = Family(
    name="qwen3_5",
    hf_architectures={
        "Qwen3_5ForCausalLM": "qwen3_5",
        "Qwen3_5ForConditionalGeneration": "qwen3_5",
    },
    model_types={"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"},
    gguf_architectures={"qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text")},
    describe=describe,
    gguf_config=gguf_config,
)
