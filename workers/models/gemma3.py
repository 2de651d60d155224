"""Gemma 3, the text model, in plain torch. Description: ``pantheon/core/archs/gemma3.py``.

Every layer: zero-centred RMSNorm, attention (q/k/v fused, per-head q/k zero-centred RMSNorm,
RoPE, GQA over the paged KV cache: the sliding layers through the step's window view, which
carries their own RoPE tables), zero-centred RMSNorm of the attention's output, residual; then
RMSNorm, GeGLU MLP (gate/up fused, tanh GELU), RMSNorm of its output, residual. The embedding is
multiplied by sqrt(hidden) rounded to the embedding's dtype (as transformers'
``Gemma3TextScaledWordEmbedding``); the scores' scale, ``query_pre_attn_scalar ** -0.5``, is in
the rotary tables (``ModelDescription.attention_scale``); the final logits are soft-capped,
``cap * tanh(logits / cap)``, when the config sets a cap.
"""

from __future__ import annotations

import torch
from torch import nn

from pantheon.core.archs.gemma3 import SLIDING, Gemma3Description
from pantheon.core.description import ModelDescription
from workers.cache import LayerCache
from workers.layers.attention import StepBatch
from workers.layers.mlp import GELU_TANH, GatedMLP
from workers.layers.norms import ZeroCenteredRMSNorm
from workers.layers.rotary import rotate
from workers.models import Target
from workers.models.base import DecoderLayer, DecoderLM, rounded
from workers.models.llama import GGUF_LAYER as LLAMA_GGUF_LAYER
from workers.models.llama import GGUF_TOP, attention_targets, gguf_name_from, mlp_targets, top_targets


class Attention(nn.Module):
    def __init__(self, cfg: Gemma3Description, window: int | None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.window = window  # a sliding layer's: it reads the step's view of it (b.windows)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        # x: [N, hidden]
        n, h, kvh, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        b = cache.view(b)  # a sliding layer's: its window's (workers/layers/sliding.py)
        qkv = self.qkv_proj(x)  # [N, Q + 2 KV]
        q = self.q_norm(qkv[:, : self.q_size].view(n, h, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(n, kvh, d))
        qk = rotate(torch.cat((q, k), dim=1), b.rot_cos, b.rot_sin)  # [N, H + KV, D], q pre-scaled
        v = qkv[:, self.q_size + self.kv_size :].view(n, kvh, d)
        out = cache.attend(qk[:, :h], qk[:, h:], v, b)  # [N, H, D]: the paged pool or the ring
        return self.o_proj(out.reshape(n, self.q_size))


class Gemma3Layer(DecoderLayer):
    def __init__(self, cfg: Gemma3Description, kind: str):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.self_attn = Attention(cfg, cfg.sliding_window if kind == SLIDING else None)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, GELU_TANH)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), b, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3LM(DecoderLM):
    """``DecoderLM`` with the embedding scaled by sqrt(hidden) and the logits soft-capped."""

    def __init__(self, desc: Gemma3Description):
        layers: list[nn.Module] = [Gemma3Layer(desc, t) for t in desc.layer_types]
        norm = ZeroCenteredRMSNorm(desc.hidden_size, desc.rms_norm_eps)
        super().__init__(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)
        self.embed_scale = desc.hidden_size**0.5
        self.softcap = desc.final_logit_softcapping

    def forward(
        self,
        input_ids: torch.Tensor,
        batches: dict[torch.device, StepBatch],
        caches: list[LayerCache],
    ) -> torch.Tensor:
        """input_ids: [N] -> hidden states after the final norm: [N, hidden]."""
        # sqrt(hidden) as a tensor in the embedding's dtype, as transformers rounds it
        h = self.embed_tokens(input_ids) * rounded(self.embed_scale, self.embed_dtype)
        for i, layer in enumerate(self.layers):
            dev = self.layer_devices[i]
            if h.device != dev:
                h = h.to(dev)
            h = layer(h, batches[dev], caches[i])
        return self.norm(h.to(self.embed_device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().logits(hidden)  # fp32
        if self.softcap is None:
            return out
        return torch.tanh(out / self.softcap) * self.softcap


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, Gemma3Description)
    return Gemma3LM(desc)


# ---------------------------------------------------------------- checkpoint names


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name (``Gemma3ForCausalLM`` layout) -> the parameter rows it fills."""
    assert isinstance(desc, Gemma3Description)
    t = top_targets(model, desc)
    hidden = desc.hidden_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, Gemma3Layer)
        p = f"model.layers.{i}."
        a = layer.self_attn
        attention_targets(t, p, a, desc, qkv_bias=desc.attention_bias, o_bias=desc.attention_bias)
        t[f"{p}self_attn.q_norm.weight"] = Target(a.q_norm.weight, 0, desc.head_dim)
        t[f"{p}self_attn.k_norm.weight"] = Target(a.k_norm.weight, 0, desc.head_dim)
        mlp_targets(t, p, layer.mlp, hidden)
        for norm in _LAYER_NORMS:
            t[f"{p}{norm}.weight"] = Target(getattr(layer, norm).weight, 0, hidden)
    return t


_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# Where Gemma3ForConditionalGeneration checkpoints keep the text model: transformers 5 writes
# model.language_model.*, the Hub's original files language_model.model.* (and its lm_head).
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_SKIPPED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def checkpoint_name(name: str) -> str | None:
    """A multimodal checkpoint's text tensors under the text model's names; its vision tower and
    projector left out (None)."""
    for prefix, to in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return to + name[len(prefix) :]
    if name.startswith(_SKIPPED):
        return None
    return name


# llama.cpp's gemma3 names: the Llama family's attention and MLP, and Gemma's four layer norms
GGUF_LAYER = {k: v for k, v in LLAMA_GGUF_LAYER.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def gguf_name(name: str) -> str | None:
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER)


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """Undo llama.cpp's ``gemma3`` conversion: it stores every norm weight as 1 + w (its RMSNorm
    is the plain one); q and k keep the Hugging Face row order."""
    if name.endswith("norm.weight"):
        return tensor - 1
    return tensor
