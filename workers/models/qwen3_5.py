"""Qwen3.5 / Qwen3.6 (dense), the text model, in plain torch: Gated DeltaNet layers (linear
attention with a recurrent state per slot) and gated full-attention layers over the paged KV
cache, each followed by a SwiGLU MLP; zero-centred RMSNorms (``x̂ * (1 + w)``) throughout.
Description: ``pantheon/core/archs/qwen3_5.py``; the DeltaNet math: ``workers/layers/gated_delta.py``.

Linear-attention layer, per token: ``in_proj`` (q, k, v, the output gate z, b and a fused into
one matrix) -> depthwise causal conv1d over q/k/v (its last K-1 inputs are the conv state) with
SiLU -> L2-normed q/k, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (fp32) -> the
gated delta rule (chunked for prefill chunks, continuing from the slot's state; one batched
recurrent update for all decode rows) -> RMSNorm gated by silu(z) -> ``out_proj``. On the CPU
everything between the two linears is one native call (``gdn_step.decode``), a prefill chunk's
rows taken as decode steps one after another: a prompt's states are its decode's to the bit.

Full-attention layer: ``q_proj`` carries an output gate (per head: D query rows, then D gate
rows), per-head q/k RMSNorm, partial RoPE (the first ``rotary_dim`` dimensions), GQA over the
paged cache, ``out * sigmoid(gate)``, ``o_proj``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.core.archs.qwen3_5 import FULL, Qwen35Description
from pantheon.core.description import ModelDescription
from workers.cache import KVCache, LayerCache, StateCache
from workers.kernels import fla_gdn, gdn_step
from workers.layers.attention import StepBatch, paged_attention
from workers.layers.gated_delta import (
    causal_conv1d_prefill,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    gated_delta_step_slots,
    gated_rms_norm,
    recurrent_gated_delta_step,
)
from workers.layers.mlp import GatedMLP
from workers.layers.norms import ZeroCenteredRMSNorm
from workers.layers.rotary import rotate
from workers.models import Target
from workers.models.base import DecoderLayer, DecoderLM
from workers.models.llama import GGUF_LAYER as LLAMA_GGUF_LAYER
from workers.models.llama import GGUF_TOP, gguf_name_from, mlp_targets, top_targets


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen35Description):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size, self.rotary_dim = cfg.q_size, cfg.kv_size, cfg.rotary_dim
        # rows: [q0 gate0 q1 gate1 ...] (2 Q, as q_proj has them), then k (KV), then v (KV)
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, b: StepBatch, cache: KVCache) -> torch.Tensor:
        # x: [N, hidden]
        n, h, kvh, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)  # [N, 2Q + 2KV]
        qg = qkv[:, : 2 * self.q_size].view(n, h, 2 * d)
        gate = qg[..., d:].reshape(n, self.q_size)  # [N, Q]
        q = self.q_norm(qg[..., :d])  # [N, H, D]
        k = self.k_norm(qkv[:, 2 * self.q_size : 2 * self.q_size + self.kv_size].view(n, kvh, d))
        qk = rotate(torch.cat((q, k), dim=1), b.rot_cos, b.rot_sin, self.rotary_dim)  # q pre-scaled
        v = qkv[:, 2 * self.q_size + self.kv_size :].view(n, kvh, d)
        out = paged_attention(qk[:, :h], qk[:, h:], v, b, cache.k, cache.v)  # [N, H, D]
        return self.o_proj(out.reshape(n, self.q_size) * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen35Description):
        super().__init__()
        gdn_step.available()  # the kernel's build settled now, eagerly: traces read it as a constant
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_dim
        self.eps = cfg.rms_norm_eps
        # rows: q, k, v (the conv's channels), z (the output gate), b (beta), a (the decay's input)
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, cfg.conv_kernel)
        )  # as checkpoints hold it
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.norm_weight = nn.Parameter(torch.empty(self.dv))
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _split(self, qkv: torch.Tensor):
        """[M, C] conv output -> q, k: [M, Hk, Dk], v: [M, Hv, Dv]."""
        m = qkv.shape[0]
        q = qkv[:, : self.key_dim].view(m, self.hk, self.dk)
        k = qkv[:, self.key_dim : 2 * self.key_dim].view(m, self.hk, self.dk)
        v = qkv[:, 2 * self.key_dim :].view(m, self.hv, self.dv)
        return q, k, v

    def _verify(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        b: StepBatch,
        cache: StateCache,
        core: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The verify rows (``b.verify``), every sequence's row i in one batched step, with the
        same functions as plain decode rows (so a verify row's output is a plain decode row's):
        fills their ``core`` rows and returns the state after each row: conv [n, G, C, K-1],
        ssm [n, G, Hv, Dk, Dv] fp32 (n: the longest run's rows, G: the runs), run ``j``'s in
        column ``cache.verified_cols[j]``. The runs go longest first, so the ones still running
        at row i are the first columns: the states are sliced and stored whole, never scattered.
        The slots' states are read, never written."""
        conv_pool, ssm_pool = cache.tensors["conv"], cache.tensors["ssm"]
        w = self.conv_weight.squeeze(1)  # [C, K]
        runs = b.verify
        order = sorted(range(len(runs)), key=lambda j: -runs[j].n)  # column q holds run order[q]
        n_max = runs[order[0]].n
        dev = mixed.device
        slots = torch.tensor([runs[j].slot for j in order], dtype=torch.long, device=dev)
        conv, ssm = conv_pool[slots], ssm_pool[slots]  # [G, ...] copies: the rows' running states
        conv_rows = conv_pool.new_empty(n_max, len(runs), *conv_pool.shape[1:])  # [n, G, C, K-1]
        ssm_rows = ssm_pool.new_empty(n_max, len(runs), *ssm_pool.shape[1:])  # [n, G, Hv, Dk, Dv]
        for i in range(n_max):
            m = sum(1 for j in order if runs[j].n > i)  # the first m columns have a row i
            rows = torch.tensor([runs[j].start + i for j in order[:m]], dtype=torch.long, device=dev)
            out, conv_m = causal_conv1d_step(mixed[rows], w, conv[:m])
            q, k, v = self._split(out)
            o, ssm_m = recurrent_gated_delta_step(
                q, k, v, g[rows], beta[rows], ssm[:m].contiguous(), inplace=True
            )
            core[rows] = o
            conv_rows[i, :m] = conv_m
            ssm_rows[i, :m] = ssm_m
            conv, ssm = conv_m, ssm_m
        cache.verified_cols = [order.index(j) for j in range(len(runs))]
        return {"conv": conv_rows, "ssm": ssm_rows}

    def forward(self, x: torch.Tensor, b: StepBatch, cache: StateCache) -> torch.Tensor:
        # x: [N, hidden]; cache.tensors: conv [S, C, K-1], ssm [S, Hv, Dk, Dv] fp32
        n, c = x.shape[0], self.conv_dim
        proj = self.in_proj(x)  # [N, C + Vd + 2 Hv]
        conv_pool, ssm_pool = cache.tensors["conv"], cache.tensors["ssm"]
        if not b.verify and gdn_step.decode_fits(proj, conv_pool, ssm_pool, self.dk, self.dv):
            # on the CPU: the whole layer between its linears in one call, every row (a prefill
            # chunk's too) as a decode step, so a prompt's states and outputs are its
            # token-by-token decode's to the bit, however it is chunked or batched (and a short
            # chunk costs its rows' arithmetic, not the chunked rule's ~40 ops and passes over
            # the state: 8 prompts of 9 tokens through Qwen3.5-0.8B's 18 DeltaNet layers took
            # ~150 ms in those)
            nd = b.n_plain
            slots = b.decode_slots[:nd] if nd and b.decode_slots is not None else None
            runs = None
            if b.prefills:
                chunk_slots = torch.tensor([ch.slot for ch in b.prefills], dtype=torch.int64)
                slots = chunk_slots if slots is None else torch.cat([slots.to(torch.int64), chunk_slots])
                runs = [(i, 1, False) for i in range(nd)]
                runs += [(ch.start, ch.end - ch.start, ch.fresh) for ch in b.prefills]
            assert (
                slots is not None and nd + sum(ch.end - ch.start for ch in b.prefills) == n
            )  # every row in a run
            normed = gdn_step.decode(
                proj,
                self.conv_weight.squeeze(1),
                conv_pool,
                self.A_log,
                self.dt_bias,
                self.norm_weight,
                ssm_pool,
                slots,
                (self.hk, self.hv, self.dk, self.dv),
                self.eps,
                runs,
            )  # [N, Vd]
            return self.out_proj(normed)
        mixed = proj[:, :c]
        z = proj[:, c : c + self.value_dim].reshape(n, self.hv, self.dv)
        beta = torch.sigmoid(proj[:, c + self.value_dim : c + self.value_dim + self.hv].float())  # [N, Hv]
        a = proj[:, c + self.value_dim + self.hv :].float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())  # [N, Hv] fp32
        w = self.conv_weight.squeeze(1)  # [C, K]
        core = torch.empty(n, self.hv, self.dv, dtype=x.dtype, device=x.device)  # [N, Hv, Dv]
        nd = b.n_plain
        fla = fla_gdn.available(x)  # CUDA with flash-linear-attention: its kernels
        if nd:
            # every decode row at once: the slots' states in one step, updated in place when the
            # slots are one run (the common case: a view, no gather or scatter), else gathered
            # and scattered back
            assert b.decode_slots is not None  # set whenever there are decode rows
            slots, run = b.decode_slots[:nd], b.decode_slot_run
            out, conv_new = causal_conv1d_step(mixed[:nd], w, conv_pool[slots])
            conv_pool.index_copy_(0, slots, conv_new)
            q, k, v = self._split(out)
            if fla:  # FLA's fused step (workers/kernels/fla_gdn.py): new states, written back
                at = slots if run is None else slice(run, run + nd)
                o, ssm_new = fla_gdn.step(q, k, v, g[:nd], beta[:nd], ssm_pool[at])
                ssm_pool[at] = ssm_new
            else:  # in place in the pool (one run of slots: a slice)
                at = slots if run is None else slice(run, run + nd)
                o = gated_delta_step_slots(q, k, v, g[:nd], beta[:nd], ssm_pool, at)
            core[:nd] = o
        # the verify rows: each sequence's rows in turn from its slot's state, every row's
        # state kept aside (the slot's own is replaced once the engine knows what was accepted)
        cache.verified = self._verify(mixed, g, beta, b, cache, core) if b.verify else {}
        for ch in b.prefills:
            s, e = ch.start, ch.end
            conv0 = torch.zeros_like(conv_pool[ch.slot]) if ch.fresh else conv_pool[ch.slot]
            ssm0 = torch.zeros_like(ssm_pool[ch.slot]) if ch.fresh else ssm_pool[ch.slot]
            out, conv_new = causal_conv1d_prefill(mixed[s:e], w, conv0)
            conv_pool[ch.slot] = conv_new
            q, k, v = self._split(out)
            o, ssm_new = (fla_gdn.chunk if fla else chunk_gated_delta_rule)(q, k, v, g[s:e], beta[s:e], ssm0)
            ssm_pool[ch.slot] = ssm_new
            core[s:e] = o
        normed = gated_rms_norm(core, z, self.norm_weight, self.eps)  # [N, Hv, Dv]
        return self.out_proj(normed.reshape(n, self.value_dim))


class Qwen35Layer(DecoderLayer):
    def __init__(self, cfg: Qwen35Description, kind: str, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: GatedAttention | GatedDeltaNet = (
            GatedAttention(cfg) if kind == FULL else GatedDeltaNet(cfg)
        )
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # a dense SwiGLU, or the caller's (Qwen3.5-MoE's mixture of experts)
        self.mlp: nn.Module = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), b, cache)  # pyright: ignore[reportArgumentType]  # the cache kind follows the layer kind (workers/cache.make_caches)
        return x + self.mlp(self.post_attention_layernorm(x))


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, Qwen35Description)
    layers: list[nn.Module] = [Qwen35Layer(desc, t) for t in desc.layer_types]
    norm = ZeroCenteredRMSNorm(desc.hidden_size, desc.rms_norm_eps)
    return DecoderLM(desc.vocab_size, desc.hidden_size, layers, norm, desc.tie_word_embeddings)


# ---------------------------------------------------------------- checkpoint names


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name (the text model's, ``Qwen3_5ForCausalLM`` layout) -> the rows it fills."""
    assert isinstance(desc, Qwen35Description)
    t = top_targets(model, desc)
    hidden, q, kv = desc.hidden_size, desc.q_size, desc.kv_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, Qwen35Layer)
        p = f"model.layers.{i}."
        m = layer.mixer
        if isinstance(m, GatedAttention):
            a = f"{p}self_attn."
            for kind, (off, rows) in {"q": (0, 2 * q), "k": (2 * q, kv), "v": (2 * q + kv, kv)}.items():
                t[f"{a}{kind}_proj.weight"] = Target(m.qkv_proj.weight, off, rows)
                if desc.attention_bias:
                    t[f"{a}{kind}_proj.bias"] = Target(m.qkv_proj.bias, off, rows)
            t[f"{a}o_proj.weight"] = Target(m.o_proj.weight, 0, hidden)
            if desc.attention_bias:
                t[f"{a}o_proj.bias"] = Target(m.o_proj.bias, 0, hidden)
            t[f"{a}q_norm.weight"] = Target(m.q_norm.weight, 0, desc.head_dim)
            t[f"{a}k_norm.weight"] = Target(m.k_norm.weight, 0, desc.head_dim)
        else:
            a = f"{p}linear_attn."
            c, vd, hv = m.conv_dim, m.value_dim, m.hv
            t[f"{a}in_proj_qkv.weight"] = Target(m.in_proj.weight, 0, c)
            t[f"{a}in_proj_z.weight"] = Target(m.in_proj.weight, c, vd)
            t[f"{a}in_proj_b.weight"] = Target(m.in_proj.weight, c + vd, hv)
            t[f"{a}in_proj_a.weight"] = Target(m.in_proj.weight, c + vd + hv, hv)
            t[f"{a}conv1d.weight"] = Target(m.conv_weight, 0, c)
            t[f"{a}A_log"] = Target(m.A_log, 0, hv)
            t[f"{a}dt_bias"] = Target(m.dt_bias, 0, hv)
            t[f"{a}norm.weight"] = Target(m.norm_weight, 0, m.dv)
            t[f"{a}out_proj.weight"] = Target(m.out_proj.weight, 0, hidden)
        if isinstance(layer.mlp, GatedMLP):  # else the caller's (workers/models/qwen3_5_moe.py)
            mlp_targets(t, p, layer.mlp, hidden)
        t[f"{p}input_layernorm.weight"] = Target(layer.input_layernorm.weight, 0, hidden)
        t[f"{p}post_attention_layernorm.weight"] = Target(layer.post_attention_layernorm.weight, 0, hidden)
    return t


def checkpoint_name(name: str) -> str | None:
    """The Hub's ``Qwen3_5ForConditionalGeneration`` keeps the text model under
    ``model.language_model.``; its vision tower (``model.visual.``) and multi-token-prediction
    head (``mtp.``) are left out."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith(("model.visual.", "mtp.")):
        return None
    return name


# llama.cpp's qwen35 names: the Llama family's, but the second norm is post_attention_norm, plus
# the linear-attention layer's own tensors
GGUF_LAYER = {k: v for k, v in LLAMA_GGUF_LAYER.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_NEXTN = re.compile(r"blk\.\d+\.nextn\..+")


def gguf_name(name: str) -> str | None:
    if _NEXTN.fullmatch(name):
        return "mtp." + name  # the multi-token-prediction head's own tensors: read by workers/mtp.py only
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER)  # its decoder layer is past num_layers: not wanted


# Norms llama.cpp's converter stores as 1 + w (it runs them as plain RMSNorms); the gated norm
# inside the linear-attention layer is stored as it is.
_PLUS_ONE = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def _untile(t: torch.Tensor, nk: int, nv: int, dim: int = 0) -> torch.Tensor:
    """Undo the converter's value-head order along ``dim``: it tiles value heads by key head
    (``[v0: k0 k1][v1: k0 k1]``) where checkpoints group them (``[k0: v0 v1][k1: v0 v1]``);
    a head spans ``t.shape[dim] // nv`` rows."""
    if nk == nv:
        return t
    g = t.shape[dim] // nv
    moved = t.movedim(dim, 0)
    # file row (j, i, r) holds checkpoint row (i, j, r): key head i, value head j of its group
    back = moved.reshape(nv // nk, nk, g, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
    return back.movedim(0, dim).contiguous()


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    """Undo llama.cpp's ``qwen35`` conversion: norms back from 1 + w, the value heads of the
    linear-attention tensors back to the checkpoint's order, A_log from -exp(A_log), the conv1d
    weight back to [C, 1, K]."""
    assert isinstance(desc, Qwen35Description)
    nk, nv = desc.linear_num_key_heads, desc.linear_num_value_heads
    if name == "model.norm.weight" or name.endswith(_PLUS_ONE) or name.startswith("mtp.pre_fc_norm_"):
        return tensor - 1  # (the last: the multi-token-prediction head's input norms, workers/mtp.py)
    if ".linear_attn." not in name:
        return tensor
    kd2 = 2 * desc.linear_key_dim
    if name.endswith("in_proj_qkv.weight"):
        return torch.cat((tensor[:kd2], _untile(tensor[kd2:], nk, nv)))
    if name.endswith("conv1d.weight"):
        return torch.cat((tensor[:kd2], _untile(tensor[kd2:], nk, nv))).unsqueeze(1)
    if name.endswith("out_proj.weight"):
        return _untile(tensor, nk, nv, dim=1)
    if name.endswith("A_log"):
        return torch.log(-_untile(tensor, nk, nv))
    if name.endswith(("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "dt_bias")):
        return _untile(tensor, nk, nv)
    return tensor  # the gated norm
