"""A request's prompt logprobs (``Submit.prompt_logprobs``), gathered during its own prefill.

The runner keeps the logits of the rows of a chunk whose positions predict a prompt token
(``ModelRunner.run``'s ``prompt_rows``: the chunk's rows up to the one before the prompt's last
position, which is the sampled row); ``PromptLogprobsAcc.add`` turns them into each position's
logprob, rank and top K on the logits' device (fp32 log-softmax, as transformers' and the
sampler's), and only those numbers come back to the host. Chunked prefill adds chunk by chunk; a
preempted sequence's prefill starts again from 0 and overwrites what it had.

A prefix-cache hit would skip the positions it covers, so a request that asks for prompt
logprobs neither reuses nor publishes cached blocks (the engine submits it with
``use_cache=False``): every prompt position is computed in its prefill.
"""

from __future__ import annotations

import torch

from pantheon.core.protocol import PromptLogprobs

ROWS = 64  # rows log-softmaxed at once


class PromptLogprobsAcc:
    """The prompt logprobs of one request so far; entry ``i`` is prompt position ``i + 1``."""

    def __init__(self, prompt: list[int], k: int):
        self.prompt, self.k = prompt, k
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top: list[list[tuple[int, float]]] = []

    def rows_wanted(self, p0: int, n: int) -> int:
        """Rows of a chunk of ``n`` positions from ``p0`` that predict a prompt token: those
        before the prompt's last position (whose row predicts the first output token)."""
        return max(0, min(p0 + n, len(self.prompt) - 1) - p0)

    @torch.inference_mode()
    def add(self, p0: int, logits: torch.Tensor) -> None:
        """``logits``: [n, V] of positions ``p0 .. p0 + n - 1`` (predicting ``p0 + 1 ..``)."""
        del self.logprobs[p0:], self.ranks[p0:], self.top[p0:]  # a recompute after preemption
        # ROWS at a time: the log-softmax's copy stays ROWS x V, whatever the chunk
        for a in range(0, logits.shape[0], ROWS):
            self._add(p0 + a, logits[a : a + ROWS])

    def _add(self, p0: int, logits: torch.Tensor) -> None:
        n = logits.shape[0]
        lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
        targets = torch.tensor(self.prompt[p0 + 1 : p0 + 1 + n], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, targets[:, None])  # [n, 1]
        ranks = (lp > chosen).sum(dim=-1) + 1
        self.logprobs += chosen[:, 0].tolist()
        self.ranks += ranks.tolist()
        if self.k:
            top_v, top_i = torch.topk(lp, self.k, dim=-1)
            self.top += [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            self.top += [[] for _ in range(n)]

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(self.logprobs, self.ranks, self.top)
