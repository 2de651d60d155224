"""Gemma 4, the text model, in plain torch. Description (and the list of what differs from
Gemma 3): ``pantheon/core/archs/gemma4.py``.

Every layer: RMSNorm, attention, RMSNorm of its output, residual; RMSNorm, GeGLU MLP (beside it,
in the 26B-A4B, a routed mixture of GeGLU experts on the layer's input: ``workers/layers/moe.py``'s
experts with Gemma 4's router), RMSNorm, residual; with per-layer embeddings, a gated projection
of the layer's slice of them added; the whole times the layer's ``layer_scalar``.

Attention: q, k (and v unless K doubles as V) fused in one matrix; per-head RMSNorm on q and k,
a weightless one on V; RoPE; GQA over the layer's cache, scores unscaled. The sliding layers
rotate with the step's tables (the runner's, built from the description's sliding-layer shapes
and RoPE) and read their window's view of the step; the full layers have their own head dim and
KV heads, so the model builds their tables once a step from ``StepBatch.positions``
(proportional RoPE: a full-head-dim RoPE whose tail frequencies are zero).

KV sharing: a layer that owns a cache and has readers keeps its step's (rotated) K and V for
them; a KV-shared layer computes only q and attends to those over the owner's cache (the
``SharedCache`` the runner gives it: the owner's tensors). A sliding owner's ring gets its prefill
chunks' K/V only after the step's last layer, as a chunk's write may overwrite ring rows of
history that a later reader's queries still need (``ring_attention(write_prefills=False)``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.core.archs.gemma4 import SLIDING, Gemma4Description
from pantheon.core.description import ModelDescription
from workers.cache import LayerCache
from workers.layers.attention import StepBatch
from workers.layers.mlp import GELU_TANH, GatedMLP
from workers.layers.moe import MoE, experts_forward, route
from workers.layers.norms import RMSNorm
from workers.layers.rotary import qk_tables, rotate
from workers.models import Target
from workers.models.base import DecoderLM, rounded
from workers.models.llama import GGUF_LAYER as LLAMA_GGUF_LAYER
from workers.models.llama import GGUF_TOP as LLAMA_GGUF_TOP
from workers.models.llama import gguf_name_from, mlp_targets, top_targets


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32 (x's dtype promoted), as transformers' Gemma4RMSNorm computes it."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    r = torch.addcmul(r.new_full((), eps), r, r, value=1.0 / x.shape[-1]).rsqrt_()
    return x * r


class Norm(RMSNorm):
    """``x̂ * w`` with the product in fp32 before the cast (transformers' Gemma4RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms(x, self.eps) * self.weight.float()).to(x.dtype)


def _gelu_glu(gu: torch.Tensor) -> torch.Tensor:
    """Gemma 4's experts: GeGLU, ``gelu_tanh(gate) * up``. gu: [M, 2I] -> [M, I]."""
    inter = gu.shape[-1] // 2
    return _gelu(gu[:, :inter]) * gu[:, inter:]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass
class _Step:
    """One forward pass's shared state: the owners' K/V for their readers, rings to fill last,
    and the full layers' rotary tables by (device, head dim, KV heads)."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor, StepBatch]] = field(default_factory=dict)
    deferred: list[tuple[torch.Tensor, torch.Tensor, StepBatch, LayerCache]] = field(default_factory=list)
    tables: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )


class Attention(nn.Module):
    def __init__(self, desc: Gemma4Description, index: int, read: bool):
        super().__init__()
        a = desc.attn[index]
        self.index, self.shares, self.k_eq_v, self.read = index, a.shares, a.k_eq_v, read
        self.n_heads, self.n_kv, self.head_dim = desc.num_heads, a.kv_heads, a.head_dim
        self.q_size, self.kv_size = desc.num_heads * a.head_dim, a.kv_heads * a.head_dim
        self.window = desc.sliding_window if a.kind == SLIDING else None
        self.eps = desc.rms_norm_eps
        own = 0 if a.shares is not None else (self.kv_size if a.k_eq_v else 2 * self.kv_size)
        bias = desc.attention_bias
        self.qkv_proj = nn.Linear(desc.hidden_size, self.q_size + own, bias=bias)
        self.o_proj = nn.Linear(self.q_size, desc.hidden_size, bias=bias)
        self.q_norm = Norm(a.head_dim, self.eps)
        self.k_norm = Norm(a.head_dim, self.eps) if a.shares is None else None

    def forward(
        self,
        x: torch.Tensor,
        b: StepBatch,
        cache: LayerCache,
        rot: tuple[torch.Tensor, torch.Tensor],
        step: _Step,
    ) -> torch.Tensor:
        # x: [N, hidden]; rot: this layer kind's tables [N, H + KV, D]
        n, h, kvh, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        b = cache.view(b)  # a sliding layer's: its window's (a shared one: its owner's)
        cos, sin = rot
        qkv = self.qkv_proj(x)  # [N, Q (+ KV (+ KV))]
        q = self.q_norm(qkv[:, : self.q_size].view(n, h, d))
        if self.shares is not None:  # the owner's K/V, over the owner's cache (on its device)
            q = rotate(q, cos[:, :h], sin[:, :h])
            k, v, b = step.kv[self.shares]
            q = q.to(k.device)
        else:
            k_raw = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, kvh, d)
            v_raw = k_raw if self.k_eq_v else qkv[:, self.q_size + self.kv_size :].view(n, kvh, d)
            assert self.k_norm is not None
            qk = rotate(torch.cat((q, self.k_norm(k_raw)), dim=1), cos, sin)  # [N, H + KV, D]
            q, k = qk[:, :h], qk[:, h:]
            v = _rms(v_raw, self.eps).to(v_raw.dtype)
            if self.read:
                step.kv[self.index] = (k, v, b)
        # A ring read by later layers of the step gets its prefill chunks' K/V after the last
        # of them (a chunk's write may overwrite history their queries still read): ``deferred``
        out = cache.attend(q, k, v, b, write_prefills=not (self.read or self.shares is not None))
        if self.read:
            step.deferred.append((k, v, b, cache))
        return self.o_proj(out.reshape(n, self.q_size).to(x.device))


class SparseBlock(nn.Module):
    """The 26B-A4B's routed experts beside the dense MLP: Gemma 4's router (a weightless norm, a
    learned scale times hidden^-0.5, softmax, top k renormalised, times a per-expert scale) over
    ``workers/layers/moe.py``'s stacked experts (its ``gate`` is the router's projection), GeGLU."""

    def __init__(self, desc: Gemma4Description):
        super().__init__()
        ex = desc.moe_experts
        assert ex is not None
        hidden, eps = desc.hidden_size, desc.rms_norm_eps
        self.eps, self.root = eps, hidden**-0.5
        self.moe = MoE(hidden, ex.intermediate, ex.count, ex.top_k)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(ex.count))
        self.pre_feedforward_layernorm_2 = Norm(hidden, eps)
        self.post_feedforward_layernorm_2 = Norm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the layer's input to its MLPs (the residual stream) -> the experts' output, normed."""
        m = self.moe
        routed = _rms(x, self.eps).to(x.dtype) * self.scale * self.root
        weights, ids = route(m.gate(routed), m.top_k, "softmax", True)
        weights = weights * self.per_expert_scale[ids]
        y = experts_forward(
            self.pre_feedforward_layernorm_2(x),
            weights,
            ids,
            m.gate_up,
            m.down,
            stats=m.stats,
            laid_out=m.laid_out,
            glu=_gelu_glu,
        )
        return self.post_feedforward_layernorm_2(y)


class Gemma4Layer(nn.Module):
    def __init__(self, desc: Gemma4Description, index: int, read: bool):
        super().__init__()
        hidden, eps = desc.hidden_size, desc.rms_norm_eps
        self.input_layernorm = Norm(hidden, eps)
        self.self_attn = Attention(desc, index, read)
        self.post_attention_layernorm = Norm(hidden, eps)
        self.pre_feedforward_layernorm = Norm(hidden, eps)
        self.mlp = GatedMLP(hidden, desc.attn[index].intermediate, GELU_TANH)
        self.post_feedforward_layernorm = Norm(hidden, eps)
        self.sparse = SparseBlock(desc) if desc.moe_experts is not None else None
        self.post_feedforward_layernorm_1 = Norm(hidden, eps) if self.sparse is not None else None
        self.layer_scalar = nn.Parameter(torch.ones(1))
        p = desc.ple_dim
        self.per_layer_input_gate = nn.Linear(hidden, p, bias=False) if p else None
        self.per_layer_projection = nn.Linear(p, hidden, bias=False) if p else None
        self.post_per_layer_input_norm = Norm(hidden, eps) if p else None

    def forward(
        self,
        x: torch.Tensor,
        b: StepBatch,
        cache: LayerCache,
        rot: tuple[torch.Tensor, torch.Tensor],
        step: _Step,
        ple: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), b, cache, rot, step))
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if self.sparse is not None and self.post_feedforward_layernorm_1 is not None:
            y = self.post_feedforward_layernorm_1(y) + self.sparse(x)
        x = x + self.post_feedforward_layernorm(y)
        if ple is not None:
            assert self.per_layer_input_gate is not None and self.per_layer_projection is not None
            assert self.post_per_layer_input_norm is not None
            g = _gelu(self.per_layer_input_gate(x)) * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4LM(DecoderLM):
    """``DecoderLM`` with the embedding scaled by sqrt(hidden), per-layer embeddings when the
    model has them, the full layers' rotary tables, KV sharing, and the logits soft-capped."""

    def __init__(self, desc: Gemma4Description):
        read = {a.shares for a in desc.attn if a.shares is not None}
        layers: list[nn.Module] = [Gemma4Layer(desc, i, i in read) for i in range(desc.num_layers)]
        norm = Norm(desc.hidden_size, desc.rms_norm_eps)
        super().__init__(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)
        self.desc = desc
        self.embed_scale = desc.hidden_size**0.5
        self.softcap = desc.final_logit_softcapping
        p, n = desc.ple_dim, desc.num_layers
        if p:
            self.embed_tokens_per_layer = nn.Embedding(desc.ple_vocab, n * p)
            self.per_layer_model_projection = nn.Linear(desc.hidden_size, n * p, bias=False)
            self.per_layer_projection_norm = Norm(p, desc.rms_norm_eps)
        self._inv_freq: dict[tuple[torch.device, int], torch.Tensor] = {}

    def _per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[N] ids and their scaled embeddings [N, hidden] -> each layer's input [N, L, P]."""
        d = self.desc
        w = self.embed_tokens_per_layer.weight
        tok = self.embed_tokens_per_layer(input_ids) * rounded(d.ple_dim**0.5, w.dtype)
        proj = self.per_layer_model_projection(h) * d.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(-1, d.num_layers, d.ple_dim))
        return (proj + tok.view(-1, d.num_layers, d.ple_dim)) * 2.0**-0.5

    def _full_tables(
        self, b: StepBatch, head_dim: int, kv_heads: int, dtype: torch.dtype, step: _Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The full layers' rotary tables for this step (transformers' proportional RoPE: the
        first ``partial * D / 2`` frequencies of a D-dim RoPE, the rest 0)."""
        pos = b.positions
        assert pos is not None, "the runner gives each step its positions"
        key = (pos.device, head_dim, kv_heads)
        if key not in step.tables:
            inv = self._inv_freq.get((pos.device, head_dim))
            if inv is None:
                s = self.desc.global_rope.scaling
                angles = int(s["partial_rotary_factor"] * head_dim // 2)
                ar = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float32) / head_dim
                inv = torch.cat((1.0 / self.desc.global_rope.theta**ar, torch.zeros(head_dim // 2 - angles)))
                inv = (inv / s["factor"]).to(pos.device)
                self._inv_freq[(pos.device, head_dim)] = inv
            freqs = pos.to(torch.float32)[:, None] * inv[None, :]  # [N, D/2]
            step.tables[key] = qk_tables(
                freqs.cos(), freqs.sin(), self.desc.num_heads, kv_heads, dtype, head_dim, 1.0
            )
        return step.tables[key]

    def forward(
        self,
        input_ids: torch.Tensor,
        batches: dict[torch.device, StepBatch],
        caches: list[LayerCache],
    ) -> torch.Tensor:
        """input_ids: [N] -> hidden states after the final norm: [N, hidden]."""
        # sqrt(hidden) as a tensor in the embedding's dtype, as transformers rounds it
        h = self.embed_tokens(input_ids) * rounded(self.embed_scale, self.embed_dtype)
        ple = self._per_layer_inputs(input_ids, h) if self.desc.ple_dim else None
        step = _Step()
        for i, a in enumerate(self.desc.attn):
            layer = cast(Gemma4Layer, self.layers[i])
            dev = self.layer_devices[i]
            if h.device != dev:
                h = h.to(dev)
            b = batches[dev]
            if a.kind == SLIDING:
                view = b.windows[self.desc.sliding_window]
                rot = (view.rot_cos, view.rot_sin)
            else:
                rot = self._full_tables(b, a.head_dim, a.kv_heads, h.dtype, step)
            h = layer(h, b, caches[i], rot, step, None if ple is None else ple[:, i].to(dev))
        for k, v, view, owner in step.deferred:  # the owners' rings, now that every reader has read
            owner.write_prefills(k, v, view)
        return self.norm(h.to(self.embed_device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().logits(hidden)  # fp32
        if self.softcap is None:
            return out
        return torch.tanh(out / self.softcap) * self.softcap


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, Gemma4Description)
    return Gemma4LM(desc)


# ---------------------------------------------------------------- checkpoint names

_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name (``Gemma4ForCausalLM`` layout) -> the parameter rows it fills."""
    assert isinstance(desc, Gemma4Description) and isinstance(model, Gemma4LM)
    t = top_targets(model, desc)
    hidden = desc.hidden_size
    if desc.ple_dim:
        lp = desc.num_layers * desc.ple_dim
        t["model.embed_tokens_per_layer.weight"] = Target(
            model.embed_tokens_per_layer.weight, 0, desc.ple_vocab
        )
        t["model.per_layer_model_projection.weight"] = Target(model.per_layer_model_projection.weight, 0, lp)
        t["model.per_layer_projection_norm.weight"] = Target(
            model.per_layer_projection_norm.weight, 0, desc.ple_dim
        )
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, Gemma4Layer)
        p = f"model.layers.{i}."
        a = layer.self_attn
        q, kv = a.q_size, a.kv_size
        rows = {"q": (0, q)}
        if a.shares is None:
            rows["k"] = (q, kv)
            if not a.k_eq_v:
                rows["v"] = (q + kv, kv)
        for kind, (off, n) in rows.items():
            t[f"{p}self_attn.{kind}_proj.weight"] = Target(a.qkv_proj.weight, off, n)
            if desc.attention_bias:
                t[f"{p}self_attn.{kind}_proj.bias"] = Target(cast(torch.Tensor, a.qkv_proj.bias), off, n)
        t[f"{p}self_attn.o_proj.weight"] = Target(a.o_proj.weight, 0, hidden)
        if desc.attention_bias:
            t[f"{p}self_attn.o_proj.bias"] = Target(cast(torch.Tensor, a.o_proj.bias), 0, hidden)
        t[f"{p}self_attn.q_norm.weight"] = Target(a.q_norm.weight, 0, a.head_dim)
        if a.k_norm is not None:
            t[f"{p}self_attn.k_norm.weight"] = Target(a.k_norm.weight, 0, a.head_dim)
        mlp_targets(t, p, layer.mlp, hidden)
        for norm in _LAYER_NORMS:
            t[f"{p}{norm}.weight"] = Target(getattr(layer, norm).weight, 0, hidden)
        t[f"{p}layer_scalar"] = Target(layer.layer_scalar, 0, 1)
        if layer.per_layer_input_gate is not None:
            assert layer.per_layer_projection is not None and layer.post_per_layer_input_norm is not None
            t[f"{p}per_layer_input_gate.weight"] = Target(layer.per_layer_input_gate.weight, 0, desc.ple_dim)
            t[f"{p}per_layer_projection.weight"] = Target(layer.per_layer_projection.weight, 0, hidden)
            t[f"{p}post_per_layer_input_norm.weight"] = Target(
                layer.post_per_layer_input_norm.weight, 0, hidden
            )
        s = layer.sparse
        if s is not None and layer.post_feedforward_layernorm_1 is not None:
            e = s.moe.num_experts
            t[f"{p}router.proj.weight"] = Target(s.moe.gate.weight, 0, e)
            t[f"{p}router.scale"] = Target(s.scale, 0, hidden)
            t[f"{p}router.per_expert_scale"] = Target(s.per_expert_scale, 0, e)
            t[f"{p}experts.gate_up_proj"] = Target(s.moe.gate_up, 0, e)
            t[f"{p}experts.down_proj"] = Target(s.moe.down, 0, e)
            t[f"{p}post_feedforward_layernorm_1.weight"] = Target(
                layer.post_feedforward_layernorm_1.weight, 0, hidden
            )
            for norm in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
                t[f"{p}{norm}.weight"] = Target(getattr(s, norm).weight, 0, hidden)
    return t


# Where Gemma4ForConditionalGeneration checkpoints keep the text model (transformers 5's layout);
# its vision and audio towers and their embedders are never targets, so they are skipped.
_TEXT_PREFIX = "model.language_model."


def checkpoint_name(name: str) -> str | None:
    """A multimodal checkpoint's text tensors under the text model's names."""
    if name.startswith(_TEXT_PREFIX):
        return "model." + name[len(_TEXT_PREFIX) :]
    if name.startswith(
        ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
    ):
        return None
    return name


# llama.cpp's gemma4 names (its converter's Gemma4Model over the tensor map of gguf-py).
# ``rope_freqs.weight`` is read by the description (``pantheon.core.archs.gemma4.gguf_config``);
# it is named here so the loader knows it, and no parameter wants it.
GGUF_TOP = {
    **LLAMA_GGUF_TOP,
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
GGUF_LAYER = {k: v for k, v in LLAMA_GGUF_LAYER.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",  # [E, 2I, hidden]: gate rows, then up
    "ffn_gate_exps.weight": "experts.gate_proj",  # or the two halves ([E, I, hidden]): ``join``
    "ffn_up_exps.weight": "experts.up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}


def gguf_name(name: str) -> str | None:
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER)


_HALVES = re.compile(r"(model\.layers\.\d+\.experts\.)(gate|up)_proj")


def joined(name: str) -> tuple[str, str] | None:
    """A ``gemma4`` file's experts may hold gate and up as two stacks (``ffn_gate_exps``,
    ``ffn_up_exps``, which llama.cpp reads when there is no ``ffn_gate_up_exps``): the two parts
    of the checkpoint's ``experts.gate_up_proj``."""
    m = _HALVES.fullmatch(name)
    return None if m is None else (m.group(1) + "gate_up_proj", m.group(2))


def join(key: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Once both halves are there: ``[E, I, H]`` gate and up stacked as ``[E, 2I, H]``."""
    if "gate" not in parts or "up" not in parts:
        return None
    return iter([(key, torch.cat((parts["gate"], parts["up"]), dim=1))])


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """llama.cpp's ``gemma4`` conversion keeps every tensor as the checkpoint has it: its norms
    are plain (no 1 + w, unlike Gemma 3), q and k keep their row order, the experts stay stacked."""
    return tensor
