"""What every decoder-only language model here shares: token embedding, decoder layers (on one
or several devices), final norm and LM head. Families supply the layers and the norm."""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.cache import LayerCache
from workers.layers import decode_layer
from workers.layers.attention import StepBatch
from workers.layers.block_embedding import BlockEmbedding


@functools.cache
def rounded(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to ``dtype``, as a Python float: a multiply by it is the multiply by a 0-dim
    tensor of that dtype (the scale a checkpoint's reference rounds first, Gemma's embedding
    scales), without the host-to-device copy such a tensor costs each step, which a CUDA
    graph's capture refuses."""
    return torch.tensor(x, dtype=torch.float64).to(dtype).item()


class DecoderLayer(nn.Module):
    """A layer's interface: ``forward(x [N, hidden], batch, cache) -> [N, hidden]``."""

    def forward(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class DecoderLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head. Layers may live on several devices."""

    def __init__(
        self, vocab_size: int, hidden_size: int, layers: list[nn.Module], norm: nn.Module, tied: bool
    ):
        super().__init__()
        # (a CPU path's loader may hold a GGUF's table as its blocks: BlockEmbedding)
        self.embed_tokens: nn.Embedding | BlockEmbedding = nn.Embedding(vocab_size, hidden_size)
        # an nn.ModuleList (registered as submodules), typed as what it holds
        self.layers = cast("list[DecoderLayer]", nn.ModuleList(layers))
        self.norm = norm
        # None: tied to the embedding table; a CPU path may set it to a laid-out copy
        # (workers/cpu_paths.py), so any module mapping [M, hidden] -> [M, vocab].
        self.lm_head: nn.Module | None = None if tied else nn.Linear(hidden_size, vocab_size, bias=False)
        # Filled by the loader: the device of each layer (layers split across dies).
        self.layer_devices: list[torch.device] = []
        # Set by the runner when every layer runs its decode steps fused, on one CPU: all the
        # layers in one native call (workers/layers/decode_layer.py ``Layers``)
        self.fused_layers: decode_layer.Layers | None = None

    def head_weight(self) -> torch.Tensor:
        """The LM head's dense weight [vocab, hidden]: its own, or the token table it is tied to
        (unpacked whole when the table is held as blocks: a transient copy)."""
        head = self.lm_head
        if head is None:
            return self.embed_table()
        # (an untied head the loader holds as blocks until the CPU path lays it out)
        return head.table() if isinstance(head, BlockEmbedding) else cast(torch.Tensor, head.weight)

    def embed_table(self) -> torch.Tensor:
        """The token table, dense [vocab, hidden] (unpacked whole when it is held as blocks: a
        transient copy)."""
        emb = self.embed_tokens
        return emb.weight if isinstance(emb, nn.Embedding) else emb.table()

    @property
    def embed_device(self) -> torch.device:
        """The token table's die: where a step's hidden states start and end."""
        emb = self.embed_tokens
        return emb.weight.device if isinstance(emb, nn.Embedding) else emb.device

    @property
    def embed_dtype(self) -> torch.dtype:
        """The dtype the token table's rows come out in (the model's)."""
        emb = self.embed_tokens
        return emb.weight.dtype if isinstance(emb, nn.Embedding) else emb.dtype

    def embed_bytes(self) -> int:
        """The bytes the token table holds."""
        emb = self.embed_tokens
        t = emb.weight if isinstance(emb, nn.Embedding) else emb.blocks
        return t.numel() * t.element_size()

    def forward(
        self,
        input_ids: torch.Tensor,
        batches: dict[torch.device, StepBatch],
        caches: list[LayerCache],
    ) -> torch.Tensor:
        """input_ids: [N] -> hidden states after the final norm: [N, hidden]."""
        h = self.embed_tokens(input_ids)
        if self.fused_layers is not None and not torch.compiler.is_compiling():
            # set only for layers on one device (the runner's check): that device's batch
            out = self.fused_layers(h, batches[self.layer_devices[0]], caches)  # None: not this step
            if out is not None:
                return self.norm(out)
        for i, layer in enumerate(self.layers):
            dev = self.layer_devices[i]
            if h.device != dev:
                h = h.to(dev)
            h = layer(h, batches[dev], caches[i])
        home = self.embed_device
        return self.norm(h if h.device == home else h.to(home))  # (a same-device .to is an op too)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [M, hidden] -> logits [M, vocab] in fp32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.head_weight()).float()
