"""gpt-oss in plain torch. Description: ``pantheon/core/archs/gpt_oss.py``.

Every layer: RMSNorm (the product with its weight in fp32, as transformers keeps gpt-oss's norms),
attention (q/k/v fused, with biases; YaRN RoPE with its attention factor in the rotary tables;
GQA; learned sinks, ``workers/layers/sinks.py``: over the paged pool on full layers, over the
step's window view and the layer's ring on sliding ones), o_proj with its bias, residual; then
RMSNorm and the shared mixture-of-experts block (``workers/layers/moe.py``): the router with its
bias, a softmax over the top k logits, the experts with biases and gpt-oss's clamped SwiGLU,
residual.

Checkpoint names (transformers' ``GptOssForCausalLM``): the router ``mlp.router.{weight,bias}``;
the experts stacked, transposed and with gate and up *interleaved* (column ``2i`` is gate row
``i``, ``2i + 1`` up row ``i``): ``mlp.experts.gate_up_proj`` ``[E, H, 2I]``,
``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``;
or, as the Hub ships them, MXFP4 ``mlp.experts.{gate_up,down}_proj_{blocks,scales}`` holding
the untransposed ``[E, 2I, H]`` / ``[E, H, I]`` (``workers/mxfp4.py``), joined one expert at a
time at load and held as they are (``joined`` / ``join``, ``MoE(mxfp4=True)``); or llama.cpp's
``gpt-oss`` GGUF names (``gguf_name``), whose MXFP4 expert stacks are read as their blocks too
(``gguf_blocks``). Every expert tensor is split into the stacked layout's per-expert rows (gate
rows, then up rows: ``stacked`` / ``unstack``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from pantheon.core.archs.gpt_oss import SLIDING, GptOssDescription
from pantheon.core.description import ModelDescription
from workers.cache import LayerCache
from workers.errors import LoadError
from workers.layers.attention import StepBatch
from workers.layers.moe import ClampedSwiGLU, MoE
from workers.layers.norms import RMSNorm
from workers.layers.rotary import rotate
from workers.models import Target
from workers.models.base import DecoderLayer, DecoderLM
from workers.models.llama import GGUF_LAYER as GGUF_LLAMA_LAYER
from workers.models.llama import GGUF_TOP, attention_targets, gguf_name_from, top_targets
from workers.mxfp4 import BLOCK, MxExperts, from_hub


class Fp32WeightRMSNorm(RMSNorm):
    """``(w * x̂).to(dtype)`` with the product in fp32 (transformers' ``GptOssRMSNorm``, whose
    weight stays fp32); equal to ``RMSNorm`` in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        r = torch.addcmul(r.new_full((), self.eps), r, r, value=1.0 / x.shape[-1]).rsqrt_()
        return ((x * r) * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GptOssDescription, window: int | None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.window = window  # a sliding layer's: it reads the step's view of it (b.windows)
        bias = cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))  # one logit per head, no value

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        b = cache.view(b)  # a sliding layer's: its window's (workers/layers/sliding.py)
        # the fused output as heads, split once (as the Llama family's attention: fewer ops)
        qk, v = self.qkv_proj(x).view(n, h + 2 * kvh, d).tensor_split((h + kvh,), dim=1)
        q, k = rotate(qk, b.rot_cos, b.rot_sin).tensor_split((h,), dim=1)  # q pre-scaled
        out = cache.attend(q, k, v, b, self.sinks)  # the paged pool or the ring, with sinks
        return self.o_proj(out.reshape(n, self.q_size))


class GptOssLayer(DecoderLayer):
    def __init__(self, cfg: GptOssDescription, kind: str):
        super().__init__()
        self.input_layernorm = Fp32WeightRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.sliding_window if kind == SLIDING else None)
        self.post_attention_layernorm = Fp32WeightRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            routing="topk_softmax",
            router_bias=True,
            expert_bias=True,
            glu=ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit),
            mxfp4=cfg.mxfp4,
        )

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), b, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, GptOssDescription)
    layers: list[nn.Module] = [GptOssLayer(desc, t) for t in desc.layer_types]
    norm = Fp32WeightRMSNorm(desc.hidden_size, desc.rms_norm_eps)
    return DecoderLM(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)


# ---------------------------------------------------------------- checkpoint names


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name -> the parameter rows it fills; the experts under per-expert names
    (``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}``) that ``unstack`` / ``join`` give."""
    assert isinstance(desc, GptOssDescription)
    t = top_targets(model, desc)
    hidden = desc.hidden_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, GptOssLayer)
        p = f"model.layers.{i}."
        a = layer.self_attn
        attention_targets(t, p, a, desc, qkv_bias=desc.attention_bias, o_bias=desc.attention_bias)
        t[f"{p}self_attn.sinks"] = Target(a.sinks, 0, desc.num_heads)
        moe = layer.mlp
        assert moe.gate.bias is not None and moe.gate_up_bias is not None and moe.down_bias is not None
        t[f"{p}mlp.router.weight"] = Target(moe.gate.weight, 0, moe.num_experts)
        t[f"{p}mlp.router.bias"] = Target(moe.gate.bias, 0, moe.num_experts)
        inter = moe.inter
        held = _held(moe)
        for e in range(moe.num_experts):
            x = f"{p}mlp.experts.{e}."
            if held is None:
                t[f"{x}gate_proj.weight"] = Target(moe.gate_up[e], 0, inter)
                t[f"{x}up_proj.weight"] = Target(moe.gate_up[e], inter, inter)
                t[f"{x}down_proj.weight"] = Target(moe.down[e], 0, hidden)
            else:  # MXFP4 as it ships: each expert's codes and exponents (``join``, ``unstack``)
                gu, dn = held
                for part, mat in (("blocks", "qs"), ("scales", "e")):
                    t[f"{x}gate_proj.{part}"] = Target(getattr(gu, mat)[e], 0, inter)
                    t[f"{x}up_proj.{part}"] = Target(getattr(gu, mat)[e], inter, inter)
                    t[f"{x}down_proj.{part}"] = Target(getattr(dn, mat)[e], 0, hidden)
            t[f"{x}gate_proj.bias"] = Target(moe.gate_up_bias[e], 0, inter)
            t[f"{x}up_proj.bias"] = Target(moe.gate_up_bias[e], inter, inter)
            t[f"{x}down_proj.bias"] = Target(moe.down_bias[e], 0, hidden)
        t[f"{p}input_layernorm.weight"] = Target(layer.input_layernorm.weight, 0, hidden)
        t[f"{p}post_attention_layernorm.weight"] = Target(layer.post_attention_layernorm.weight, 0, hidden)
    return t


def _held(moe: MoE) -> tuple[MxExperts, MxExperts] | None:
    """The layer's experts as MXFP4 holds them, or None (stacked weights)."""
    if not moe.mxfp4:
        return None
    return cast(MxExperts, moe.gate_up_laid_out), cast(MxExperts, moe.down_laid_out)


def checkpoint_name(name: str) -> str | None:
    return name


_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?")
_GGUF_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate|up|down)_exps\.(weight|bias)")
_JOINED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)")


def stacked(name: str) -> bool:
    return _STACKED.fullmatch(name) is not None or _GGUF_STACKED.fullmatch(name) is not None


def _gate_up(prefix: str, e: int, w: torch.Tensor, suffix: str) -> list[tuple[str, torch.Tensor]]:
    """One expert's interleaved gate/up rows ``[2I, ...]`` as its gate rows and its up rows."""
    return [(f"{prefix}{e}.gate_proj.{suffix}", w[0::2]), (f"{prefix}{e}.up_proj.{suffix}", w[1::2])]


def unstack(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers' stacked experts -> each expert's gate / up / down weight and bias (views):
    ``gate_up_proj`` ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` transposed back to rows."""
    g = _GGUF_STACKED.fullmatch(name)
    if g is not None:  # llama.cpp's: already rows, one stack per projection
        prefix, x, w = g.groups()
        if tensor.dtype == torch.uint8:  # MXFP4 blocks as the file has them (``gguf_blocks``)
            return [
                piece
                for e in range(tensor.shape[0])
                for piece in (
                    (f"{prefix}{e}.{x}_proj.blocks", tensor[e, :, :, 1:].flatten(-2)),
                    (f"{prefix}{e}.{x}_proj.scales", tensor[e, :, :, 0]),
                )
            ]
        return [(f"{prefix}{e}.{x}_proj.{w}", tensor[e]) for e in range(tensor.shape[0])]
    m = _STACKED.fullmatch(name)
    assert m is not None  # the loader asks only for stacked() names
    prefix, kind, bias = m.groups()
    out: list[tuple[str, torch.Tensor]] = []
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            out += _gate_up(prefix, e, tensor[e] if bias else tensor[e].t(), "bias" if bias else "weight")
        else:
            out.append(
                (
                    f"{prefix}{e}.down_proj.{'bias' if bias else 'weight'}",
                    tensor[e] if bias else tensor[e].t(),
                )
            )
    return out


def joined(name: str) -> tuple[str, str] | None:
    """MXFP4 experts: ``..._blocks`` and ``..._scales`` are the two parts of one weight."""
    m = _JOINED.fullmatch(name)
    return None if m is None else (m.group(1), m.group(2))


def join(key: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Once both parts are there: each expert's MXFP4 codes (reordered into the kernel's nibble
    order, ``workers.mxfp4.from_hub``: the same codes) and exponents, one expert at a time, the
    checkpoint's ``[E, 2I, H]`` / ``[E, H, I]`` rows split as ``unstack`` does (whole rows: the
    blocks run along each row)."""
    if "blocks" not in parts or "scales" not in parts:
        return None
    blocks, scales = parts["blocks"], parts["scales"]
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise LoadError(
            "invalid", f"{key}: MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
        )
    prefix, kind = key.rsplit(".", 1)
    prefix += "."

    def pieces() -> Iterator[tuple[str, torch.Tensor]]:
        for e in range(blocks.shape[0]):
            qs = from_hub(blocks[e])  # [rows, cols / 2]
            if kind == "gate_up_proj":
                yield from _gate_up(prefix, e, qs, "blocks")
                yield from _gate_up(prefix, e, scales[e], "scales")
            else:
                yield f"{prefix}{e}.down_proj.blocks", qs
                yield f"{prefix}{e}.down_proj.scales", scales[e]

    return pieces()


# llama.cpp's ``gpt-oss`` names. Its converter splits the interleaved gate/up into separate
# ``ffn_gate_exps`` / ``ffn_up_exps`` stacks and stores every expert stack in row layout
# (``[E, I, H]``, ``[E, H, I]``); those get names of their own here (``*_exps``), split per expert
# by ``unstack`` as they are.
GGUF_LAYER = {k: v for k, v in GGUF_LLAMA_LAYER.items() if not k.startswith("ffn_")} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{
        f"ffn_{x}_exps.{w}": f"mlp.experts.{x}_exps.{w}"
        for x in ("gate", "up", "down")
        for w in ("weight", "bias")
    },
}


def gguf_name(name: str) -> str | None:
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER)


def gguf_blocks(type_name: str) -> bool:
    """A GGUF tensor type kept as its blocks (``[..., rows, blocks, bytes]`` uint8, not
    dequantized): MXFP4, the experts' (ggml's block: the exponent byte, then the codes in the
    kernel's nibble order), which ``unstack`` splits into each expert's codes and exponents."""
    return type_name == "MXFP4"


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """``gpt-oss`` files keep the Hugging Face row order (no q/k permutation); the experts'
    layout is undone by ``unstack``."""
    return tensor
