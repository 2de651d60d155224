"""The Llama family (Llama, Qwen2, Qwen3) in plain torch, reading and writing a paged KV cache.

One forward call takes a flat batch of N tokens: first one token for each decoding sequence,
then the tokens of the prefill chunks. Linear layers see all N rows at once (the weights are
read once per step, which is what decode speed on a CPU is bound by); attention runs once for
the decode rows together and once per prefill chunk. The runner builds the ``AttnBatch``.
q/k/v and gate/up are fused into one matrix each: fewer, larger matrix products per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.model_config import ModelConfig


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flat batch."""

    start: int  # first row of the chunk in the flat batch
    end: int  # one past its last row
    gather: torch.Tensor  # [T] int64: cache rows of positions 0..T-1 of this sequence
    mask: torch.Tensor | None  # [1, 1, C, T] bool (True = attend), None when plain causal


@dataclass
class AttnBatch:
    """Where each token's K/V goes and what each query attends to, on one device.

    The rotary tables cover q and k heads together (``[N, H + KV, D]``) and already hold the
    softmax scale on the q heads, so each layer rotates q and k in one pass and never scales
    its scores. ``rot_sin`` is signed for the swapped-halves form (see ``rotate``).
    """

    rot_cos: torch.Tensor  # [N, H + KV, D]
    rot_sin: torch.Tensor  # [N, H + KV, D]: -sin on the first half of D, +sin on the second
    slot_mapping: torch.Tensor  # [N] int64: cache row that receives each token's K/V
    n_decode: int  # rows [0, n_decode) are one decode token per sequence
    decode_gather: torch.Tensor | None  # [B, T] int64 cache rows (padding points at row 0)
    decode_bias: torch.Tensor | None  # [B, 1, 1, T] fp32, -inf on padding; None when no row pads
    prefills: list[PrefillChunk]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half form HF checkpoints expect, in three ops.

    x: [N, H, D]. rotate_half(x) * sin == swap_halves(x) * sin_signed, and swapping the two
    halves of D is a flip of a [.., 2, D/2] view.
    """
    n, h, d = x.shape
    swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)
    return torch.addcmul(x * cos, swapped, sin_signed)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 and cast back before the weight, as transformers does it, in six ops: the
        # norm is one fused fp32 reduction (mean of squares = norm^2 / dim), the rsqrt of
        # eps + norm^2 / dim is an addcmul on [N, 1], and x * r promotes x to fp32 itself.
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        r = torch.addcmul(r.new_full((), self.eps), r, r, value=1.0 / x.shape[-1]).rsqrt_()
        return self.weight * (x * r).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, b: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor):
        # x: [N, hidden]; k_cache, v_cache: [rows, KV, D]
        n, h, kvh, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)  # [N, Q + 2 KV]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither
            q = self.q_norm(qkv[:, : self.q_size].view(n, h, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(n, kvh, d))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(n, h + kvh, d)
        qk = rotate(qk, b.rot_cos, b.rot_sin)  # [N, H + KV, D], q pre-scaled
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, self.q_size + self.kv_size :].view(n, kvh, d)
        k_cache.index_copy_(0, b.slot_mapping, k)
        v_cache.index_copy_(0, b.slot_mapping, v)

        if not b.prefills:  # the pure decode step: no copy into a shared output
            out = self._decode_attention(q, b, k_cache, v_cache)
        else:
            out = torch.empty_like(q)  # [N, H, D]
            if b.n_decode:
                out[: b.n_decode] = self._decode_attention(q[: b.n_decode], b, k_cache, v_cache)
            for c in b.prefills:
                kk = k_cache[c.gather].transpose(0, 1).unsqueeze(0)  # [1, KV, T, D]
                vv = v_cache[c.gather].transpose(0, 1).unsqueeze(0)
                qp = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, C, D]
                o = F.scaled_dot_product_attention(
                    qp, kk, vv, attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=True, scale=1.0
                )
                out[c.start : c.end] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(n, self.q_size))

    def _decode_attention(self, q: torch.Tensor, b: AttnBatch, k_cache, v_cache) -> torch.Tensor:
        """One (pre-scaled) query per sequence against its cached keys. q: [B, H, D] -> [B, H, D].

        Plain matmuls rather than SDPA: with one query row the fused CPU kernel's setup costs
        more than the arithmetic. Grouped heads share their K/V without copying them.
        """
        bsz, g = q.shape[0], self.n_heads // self.n_kv
        k = k_cache[b.decode_gather].transpose(1, 2)  # [B, KV, T, D]
        v = v_cache[b.decode_gather].transpose(1, 2)
        qg = q.reshape(bsz, self.n_kv, g, self.head_dim)  # [B, KV, G, D]
        scores = torch.matmul(qg, k.transpose(2, 3))  # [B, KV, G, T]
        if b.decode_bias is not None:
            scores = scores + b.decode_bias  # fp32 from here; bias: [B, 1, 1, T]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).view(bsz, self.n_heads, self.head_dim)  # [B, KV, G, D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)  # [N, 2I]
        return self.down_proj(F.silu(gu[:, : self.inter]) * gu[:, self.inter :])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, b: AttnBatch, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), b, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head. Layers may live on several devices."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # an nn.ModuleList (registered as submodules), typed as what it holds
        self.layers = cast(
            "list[DecoderLayer]", nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # None: tied to the embedding table; a CPU path may swap in its own linear layout
        self.lm_head: nn.Module | None
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Filled by the loader: the device of each layer (layers split across dies).
        self.layer_devices: list[torch.device] = []
        # lm_head is None while the head is the embedding table itself; a CPU path may set it to
        # a laid-out copy (workers/cpu_paths.py), so any module mapping [M, hidden] -> [M, vocab].

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else cast(torch.Tensor, self.lm_head.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        batches: dict[torch.device, AttnBatch],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids: [N] -> hidden states after the final norm: [N, hidden]."""
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            dev = self.layer_devices[i]
            if h.device != dev:
                h = h.to(dev)
            h = layer(h, batches[dev], *kv[i])
        return self.norm(h.to(self.embed_tokens.weight.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [M, hidden] -> logits [M, vocab] in fp32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()
