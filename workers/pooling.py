"""An embedding's pooling, fed chunk by chunk: the engine prefills an embedding like any prompt
(a long one over several steps), and each step hands this the chunk's final hidden states
(after the model's final norm). Kept in fp32 whatever the model's dtype.

- ``last``: the prompt's last row (decoder embedding models: Qwen3-Embedding);
- ``mean``: the mean of every row, as sentence-transformers' ``pooling_mode_mean_tokens``;
- ``cls``: the first row (BERT's [CLS] token).

A chunk that starts at position 0 starts over: a preempted sequence is recomputed from its first
token, and what it pooled before must not count twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pantheon.core.protocol import Pooling


class Pooled:
    def __init__(self, pooling: Pooling, normalize: bool):
        self.pooling, self.normalize = pooling, normalize
        self.total: torch.Tensor | None = None
        self.rows = 0

    def add(self, hidden: torch.Tensor, first: int, last: bool) -> None:
        """``hidden``: [n, H], the chunk's rows at positions ``first``..; ``last``: the chunk
        ends the prompt."""
        if first == 0:
            self.total, self.rows = None, 0
        if self.pooling == "mean":
            part = hidden.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.rows += hidden.shape[0]
        elif self.pooling == "cls":
            if first == 0:
                self.total, self.rows = hidden[0].float(), 1
        elif last:
            self.total, self.rows = hidden[-1].float(), 1

    def vector(self) -> bytes:
        """The pooled (and normalised, when asked) vector as float32 little-endian bytes."""
        assert self.total is not None and self.rows, "pooled before any row"
        v = self.total / self.rows
        if self.normalize:
            v = F.normalize(v, dim=0)
        return v.to(device="cpu", dtype=torch.float32).numpy().astype("<f4").tobytes()
