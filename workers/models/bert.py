"""The BERT family (``BertModel``: all-MiniLM, bge, e5) in plain torch: an encoder that only
embeds, as transformers 5.25's ``models/bert/modeling_bert.py`` computes it for one unpadded
input (token type 0 everywhere, as sentence-transformers encodes a single text).

Embeddings: word + absolute position + token type, then LayerNorm. Every layer: bidirectional
self-attention over the whole input (q/k/v fused, with biases; each query sees every key of its
own input, no KV cache), output dense, residual, LayerNorm; then intermediate dense, GELU,
output dense, residual, LayerNorm (post-norm). No final norm and no head: the last layer's
output is what pooling reads. The engine never splits an input across steps for it
(``Scheduler(whole_prompts=True)``), so each prefill chunk is one whole input starting at
position 0. Description: ``pantheon/core/archs/bert.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.core.archs.bert import BertDescription
from pantheon.core.description import ModelDescription
from workers.cache import LayerCache
from workers.layers.attention import PrefillChunk, StepBatch
from workers.models import Target
from workers.models.base import DecoderLayer, DecoderLM
from workers.models.llama import gguf_name_from


class BertEmbeddings(nn.Embedding):
    """The word embedding table (what the engine reads as ``embed_tokens``), holding the
    position and token-type tables and the embeddings' LayerNorm beside it, so the loader gives
    them storage with it."""

    def __init__(self, desc: BertDescription):
        super().__init__(desc.vocab_size, desc.hidden_size)
        self.position_embeddings = nn.Embedding(desc.max_position_embeddings, desc.hidden_size)
        self.token_type_embeddings = nn.Embedding(desc.type_vocab_size, desc.hidden_size)
        self.LayerNorm = nn.LayerNorm(desc.hidden_size, eps=desc.layer_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.weight) + self.position_embeddings(positions)
        h = h + self.token_type_embeddings.weight[0]  # token type 0: one segment
        return self.LayerNorm(h)


class BertLayer(DecoderLayer):
    def __init__(self, desc: BertDescription):
        super().__init__()
        h = desc.hidden_size
        self.n_heads, self.head_dim = desc.num_heads, desc.head_dim
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=desc.layer_norm_eps)
        self.up = nn.Linear(h, desc.intermediate_size)
        self.down = nn.Linear(desc.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=desc.layer_norm_eps)
        self.approximate = "none" if desc.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:
        return self.encode(x, Padded.of(b.prefills, x.device))

    def encode(self, x: torch.Tensor, pad: Padded) -> torch.Tensor:
        """x: [N, hidden], the step's inputs packed one after another -> the same shape."""
        n, hd, d = x.shape[0], self.n_heads, self.head_dim
        qkv = self.qkv(x).view(n, 3, hd, d)
        if pad.mask is None:  # one input: no padding, no mask
            q, k, v = (qkv[:, i].transpose(0, 1)[None] for i in range(3))  # [1, H, N, D]
            out = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, hd * d)
        else:
            # every input at once, padded to the longest (its keys masked out): one fused
            # kernel call per layer, where a call per input cost more than the attention
            rows = qkv[pad.gather]  # [B, T, 3, H, D]
            q, k, v = (rows[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, T, D]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=pad.mask)  # [B, H, T, D]
            out = a.transpose(1, 2).reshape(-1, hd * d)[pad.rows]  # [N, H * D], packed again
        x = self.attn_norm(x + self.attn_out(out))
        return self.out_norm(x + self.down(F.gelu(self.up(x), approximate=self.approximate)))


class Padded:
    """A step's whole inputs as a padded batch: ``gather`` [B, T] int64 (each input's rows,
    padded with row 0), ``mask`` [B, 1, 1, T] bool (True: a key of the input; None for a
    single input) and ``rows`` [N] int64 (where each packed row lies in the flattened [B * T]
    batch). Built once per step, used by every layer."""

    def __init__(self, gather: torch.Tensor, mask: torch.Tensor | None, rows: torch.Tensor):
        self.gather, self.mask, self.rows = gather, mask, rows

    @staticmethod
    def of(chunks: list[PrefillChunk], device: torch.device) -> Padded:
        lens = [c.end - c.start for c in chunks]
        n = sum(lens)
        if len(chunks) <= 1:
            idx = torch.arange(n, device=device)
            return Padded(idx[None], None, idx)
        t = max(lens)
        pos = torch.arange(t, device=device)
        starts = torch.tensor([c.start for c in chunks], device=device)
        valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]  # [B, T]
        gather = torch.where(valid, starts[:, None] + pos[None, :], 0)
        rows = valid.flatten().nonzero().flatten()  # in input order, then position: packed order
        return Padded(gather, valid[:, None, None, :], rows)


class BertModel(DecoderLM):
    embed_only = True  # the engine never samples from it (workers/engine.py)

    def __init__(self, desc: BertDescription):
        layers: list[nn.Module] = [BertLayer(desc) for _ in range(desc.num_layers)]
        super().__init__(desc.vocab_size, desc.hidden_size, layers, nn.Identity(), tied=True)
        self.embed_tokens = BertEmbeddings(desc)

    def forward(
        self, input_ids: torch.Tensor, batches: dict[torch.device, StepBatch], caches: list[LayerCache]
    ) -> torch.Tensor:
        """input_ids: [N] (whole inputs, each from position 0) -> the last layer's output [N, hidden]."""
        emb = self.embed_tokens
        assert isinstance(emb, BertEmbeddings)
        dev = emb.weight.device
        b = batches[dev]
        positions = torch.zeros(input_ids.shape[0], dtype=torch.long, device=dev)
        for c in b.prefills:
            positions[c.start : c.end] = torch.arange(c.end - c.start, device=dev)
        h = emb.embed(input_ids, positions)
        pads: dict[torch.device, Padded] = {}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, BertLayer)
            ldev = self.layer_devices[i]
            if h.device != ldev:
                h = h.to(ldev)
            if ldev not in pads:
                pads[ldev] = Padded.of(batches[ldev].prefills, ldev)
            h = layer.encode(h, pads[ldev])
        return h.to(dev)


def build(desc: ModelDescription) -> DecoderLM:
    assert isinstance(desc, BertDescription)
    return BertModel(desc)


def targets(model: DecoderLM, desc: ModelDescription) -> dict[str, Target]:
    """Checkpoint tensor name (``BertModel``'s, without a ``bert.`` prefix) -> parameter rows."""
    assert isinstance(desc, BertDescription)
    emb = model.embed_tokens
    assert isinstance(emb, BertEmbeddings)
    h = desc.hidden_size
    t = {
        "embeddings.word_embeddings.weight": Target(emb.weight, 0, desc.vocab_size),
        "embeddings.position_embeddings.weight": Target(
            emb.position_embeddings.weight, 0, desc.max_position_embeddings
        ),
        "embeddings.token_type_embeddings.weight": Target(
            emb.token_type_embeddings.weight, 0, desc.type_vocab_size
        ),
        "embeddings.LayerNorm.weight": Target(emb.LayerNorm.weight, 0, h),
        "embeddings.LayerNorm.bias": Target(emb.LayerNorm.bias, 0, h),
    }
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, BertLayer)
        p = f"encoder.layer.{i}."
        for j, x in enumerate(("query", "key", "value")):
            t[f"{p}attention.self.{x}.weight"] = Target(layer.qkv.weight, j * h, h)
            t[f"{p}attention.self.{x}.bias"] = Target(layer.qkv.bias, j * h, h)
        own = {
            "attention.output.dense": layer.attn_out,
            "attention.output.LayerNorm": layer.attn_norm,
            "intermediate.dense": layer.up,
            "output.dense": layer.down,
            "output.LayerNorm": layer.out_norm,
        }
        for name, m in own.items():
            t[f"{p}{name}.weight"] = Target(m.weight, 0, m.weight.shape[0])
            t[f"{p}{name}.bias"] = Target(m.bias, 0, m.bias.shape[0])
    return t


def checkpoint_name(name: str) -> str | None:
    """``bert.``-prefixed checkpoints (a ``BertFor*`` model's encoder) read as ``BertModel``'s;
    the pooler (not used by pooling) and anything else are skipped."""
    name = name.removeprefix("bert.")
    return name if name.startswith(("embeddings.", "encoder.")) else None


# GGUF tensor names (llama.cpp's ``bert`` architecture, as its converter writes them) -> ours.
GGUF_TOP = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
GGUF_LAYER = {
    f"{gguf}.{kind}": f"{hf}.{kind}"
    for gguf, hf in (
        ("attn_q", "attention.self.query"),
        ("attn_k", "attention.self.key"),
        ("attn_v", "attention.self.value"),
        ("attn_output", "attention.output.dense"),
        ("attn_output_norm", "attention.output.LayerNorm"),
        ("ffn_up", "intermediate.dense"),
        ("ffn_down", "output.dense"),
        ("layer_output_norm", "output.LayerNorm"),
    )
    for kind in ("weight", "bias")
}


def gguf_name(name: str) -> str | None:
    return gguf_name_from(name, GGUF_TOP, GGUF_LAYER, "encoder.layer.")


def from_gguf(name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str) -> torch.Tensor:
    return tensor  # the converter keeps BertModel's layout
