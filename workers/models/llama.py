"""The Llama family (Llama, Qwen2, Qwen3, SmolLM, Mistral with its window) in plain torch.

Every layer: RMSNorm, attention over the paged KV cache (q/k/v fused into one matrix, Qwen2's
biases, Qwen3's per-head q/k RMSNorm), RMSNorm, SwiGLU MLP (gate/up fused): fewer, larger matrix
products per layer. Description: ``pantheon/core/archs/llama.py``.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
from torch import nn

from pantheon.core.archs.llama import LlamaDescription
from pantheon.core.description import ModelDescription
from workers.cache import LayerCache
from workers.layers import decode_layer
from workers.layers.attention import StepBatch
from workers.layers.mlp import GatedMLP
from workers.layers.norms import RMSNorm, rms_norm
from workers.layers.rotary import rotate
from workers.models import Target
from workers.models.base import DecoderLayer, DecoderLM


class Attention(nn.Module):
    def __init__(self, cfg: LlamaDescription, window: int | None = None):
        super().__init__()
        self.window = window  # Mistral's sliding window: the step's view of it (b.windows)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        # x: [N, hidden]. Few ops: each costs microseconds of dispatch at decode (issue 28 §2), so
        # heads are views of the fused output, split once, and q and k are normed and rotated
        # together. tensor_split: one op of ~1.5 us where split_with_sizes takes ~3 us and two
        # slices ~2.4 us (CPU time, 1 thread, SmolLM2's shapes at batch 1).
        n, h, kvh, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        heads = self.qkv_proj(x).view(n, h + 2 * kvh, d)  # [N, H + 2 KV, D]
        qk, v = heads.tensor_split((h + kvh,), dim=1)  # [N, H + KV, D], [N, KV, D]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither
            qk = rms_norm(qk, self.qk_norm_weight(), self.q_norm.eps)
        b = cache.view(b)  # a sliding layer's: its window's (workers/layers/sliding.py)
        q, k = rotate(qk, b.rot_cos, b.rot_sin).tensor_split((h,), dim=1)  # q pre-scaled
        out = cache.attend(q, k, v, b)  # [N, H, D]: the paged pool, or a sliding layer's ring
        return self.o_proj(out.reshape(n, self.q_size))

    def qk_norm_weight(self) -> torch.Tensor:
        """Qwen3's per-head norm weights for q and k heads together: [H + KV, D], q_norm's on
        the q heads, k_norm's on the k heads (both norms have one eps), so one norm covers both.
        Built per call (3 ops) rather than kept: the parameters are filled after construction,
        and a cached copy would be a second truth under ``torch.compile``."""
        assert self.q_norm is not None and self.k_norm is not None
        d = self.head_dim
        return torch.cat(
            (self.q_norm.weight.expand(self.n_heads, d), self.k_norm.weight.expand(self.n_kv, d))
        )


class LlamaLayer(DecoderLayer):
    def __init__(self, cfg: LlamaDescription, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        # the whole layer in one native call at decode (workers/layers/decode_layer.py): planned
        # at the first step, once the CPU path has laid the linears out
        self.native: decode_layer.Native | None = None

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            if self.native is None and decode_layer.available():
                self.native = decode_layer.Native(self.parts())
            out = None if self.native is None else self.native(x, b, cache)  # None: not this step
            if out is not None:
                return out
        x = x + self.self_attn(self.input_layernorm(x), b, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def parts(self) -> decode_layer.LayerParts | str:
        """The layer as the fused call reads it, or why it cannot run fused."""
        a = self.self_attn
        if a.window is not None:
            return "a sliding window"
        qk = None if a.q_norm is None else a.qk_norm_weight()
        return decode_layer.LayerParts(
            norm_in=self.input_layernorm.weight,
            eps_in=self.input_layernorm.eps,
            qkv=a.qkv_proj,
            o=a.o_proj,
            norm_post=self.post_attention_layernorm.weight,
            eps_post=self.post_attention_layernorm.eps,
            gate_up=self.mlp.gate_up_proj,
            down=self.mlp.down_proj,
            heads=a.n_heads,
            kv_heads=a.n_kv,
            head_dim=a.head_dim,
            qk_norm=qk,
            eps_qk=a.q_norm.eps if a.q_norm is not None else 0.0,
        )


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, LlamaDescription)
    layers: list[nn.Module] = [LlamaLayer(desc, s.cache.sliding_window) for s in desc.layers]
    norm = RMSNorm(desc.hidden_size, desc.rms_norm_eps)
    return DecoderLM(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)


# ---------------------------------------------------------------- checkpoint names


def mlp_targets(t: dict[str, Target], p: str, mlp: GatedMLP, hidden: int) -> None:
    """gate_proj and up_proj fill the fused gate_up matrix; down_proj its own."""
    t[f"{p}mlp.gate_proj.weight"] = Target(mlp.gate_up_proj.weight, 0, mlp.inter)
    t[f"{p}mlp.up_proj.weight"] = Target(mlp.gate_up_proj.weight, mlp.inter, mlp.inter)
    t[f"{p}mlp.down_proj.weight"] = Target(mlp.down_proj.weight, 0, hidden)


class FusedAttention(Protocol):
    """An attention whose q, k and v projections are one matrix (as this engine lays them out)."""

    qkv_proj: nn.Linear
    o_proj: nn.Linear


def attention_targets(
    t: dict[str, Target], p: str, a: FusedAttention, desc: ModelDescription, *, qkv_bias: bool, o_bias: bool
) -> None:
    """q_proj, k_proj and v_proj (and their biases) fill the fused qkv matrix in that order;
    o_proj its own. ``a``: a layer's attention with ``qkv_proj`` and ``o_proj`` linears."""
    q, kv = desc.q_size, desc.kv_size
    for kind, (off, rows) in {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}.items():
        t[f"{p}self_attn.{kind}_proj.weight"] = Target(a.qkv_proj.weight, off, rows)
        if qkv_bias:
            t[f"{p}self_attn.{kind}_proj.bias"] = Target(a.qkv_proj.bias, off, rows)
    t[f"{p}self_attn.o_proj.weight"] = Target(a.o_proj.weight, 0, desc.hidden_size)
    if o_bias:
        t[f"{p}self_attn.o_proj.bias"] = Target(a.o_proj.bias, 0, desc.hidden_size)


def top_targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """The embedding table, the final norm and an untied LM head."""
    norm = model.norm.weight
    assert isinstance(norm, torch.Tensor)  # every family's final norm has a weight
    emb = model.embed_tokens
    assert isinstance(emb, nn.Embedding)  # as built (the loader may then hold it as blocks)
    t = {
        "model.embed_tokens.weight": Target(emb.weight, 0, desc.vocab_size),
        "model.norm.weight": Target(norm, 0, desc.hidden_size),
    }
    if model.lm_head is not None:
        t["lm_head.weight"] = Target(model.head_weight(), 0, desc.vocab_size)
    return t


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name -> the parameter rows it fills."""
    assert isinstance(desc, LlamaDescription)
    t = top_targets(model, desc)
    hidden = desc.hidden_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaLayer)
        p = f"model.layers.{i}."
        a = layer.self_attn
        attention_targets(t, p, a, desc, qkv_bias=desc.attention_bias, o_bias=desc.o_bias)
        if a.q_norm is not None and a.k_norm is not None:
            t[f"{p}self_attn.q_norm.weight"] = Target(a.q_norm.weight, 0, desc.head_dim)
            t[f"{p}self_attn.k_norm.weight"] = Target(a.k_norm.weight, 0, desc.head_dim)
        mlp_targets(t, p, layer.mlp, hidden)
        t[f"{p}input_layernorm.weight"] = Target(layer.input_layernorm.weight, 0, hidden)
        t[f"{p}post_attention_layernorm.weight"] = Target(layer.post_attention_layernorm.weight, 0, hidden)
    return t


def checkpoint_name(name: str) -> str | None:
    """A base model's checkpoint (Qwen3-Embedding is saved from ``Qwen3Model``: no ``model.``
    prefix, no head) reads as the causal LM's."""
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        return "model." + name
    return name


# GGUF tensor names (llama.cpp's, as its converter writes them) -> Hugging Face names.
GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_name_from(
    name: str, top: dict[str, str], layer: dict[str, str], layers: str = "model.layers."
) -> str | None:
    """A GGUF tensor's Hugging Face name through a family's tables (None: not in them); layer
    ``i``'s names are under ``{layers}{i}.``."""
    if name in top:
        return top[name]
    m = _BLK.fullmatch(name)
    if m and m.group(2) in layer:
        return f"{layers}{int(m.group(1))}.{layer[m.group(2)]}"
    return None


def gguf_name(name: str) -> str | None:
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER)


def unpermute(w, n_head: int):
    """Inverse of convert_hf_to_gguf's ``LlamaModel.permute`` on the rows of q or k (or a bias):
    per head, rows [pairs of (2i, 2i+1)] back to [first halves, second halves]. ``w`` is a torch
    tensor or a numpy array."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        return w  # a wrong shape: the loader's shape check reports it
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """For the ``llama`` architecture llama.cpp's converter reorders the rows of q and k (and their
    biases) per head from the rotate-half layout to interleaved pairs; undo it. Qwen2 and Qwen3
    files keep the Hugging Face order."""
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        return unpermute(tensor, desc.num_heads if ".q_proj." in name else desc.num_kv_heads)
    return tensor
