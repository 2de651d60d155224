"""Token sampling inside the engine, one row of logits per sequence.

Penalties and masks are applied row by row with each request's own parameters; greedy rows
take the argmax. A sampled row draws from its own ``torch.Generator`` (seeded from the
request's ``seed`` when given), so a seeded request gets the same tokens whatever else is
in the batch. Logprobs are those of the model's raw distribution (log-softmax of the logits
before penalties and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pantheon.protocol import SamplingParams


@dataclass
class SamplerState:
    """Per-request sampling state that outlives one step."""

    params: SamplingParams
    stop_ids: list[int]  # masked while fewer than min_tokens came out
    generator: torch.Generator
    output_counts: dict[int, int] = field(default_factory=dict)  # for presence/frequency penalties

    @classmethod
    def create(cls, params: SamplingParams, stop_ids: list[int], device: torch.device) -> SamplerState:
        # Generators live on the CPU: the draw is made there (one tiny copy per sampled row),
        # which keeps seeded streams identical across CPU and CUDA dies.
        g = torch.Generator(device="cpu")
        g.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        return cls(params=params, stop_ids=stop_ids, generator=g)


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def _penalize(row: torch.Tensor, st: SamplerState, recent: list[int], n_output: int) -> torch.Tensor:
    p = st.params
    if p.repetition_penalty != 1.0 and recent:
        ids = torch.tensor(sorted(set(recent)), device=row.device)
        vals = row[ids]
        row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and st.output_counts:
        ids = torch.tensor(list(st.output_counts), device=row.device)
        counts = torch.tensor(list(st.output_counts.values()), device=row.device, dtype=row.dtype)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty
    if n_output < p.min_tokens and st.stop_ids:
        row[torch.tensor(st.stop_ids, device=row.device)] = float("-inf")
    return row


def _filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row: [V] logits already divided by the temperature -> probabilities [V]."""
    if p.top_k and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sp.cumsum(0) - sp) >= p.top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sp)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(
    logits: torch.Tensor, states: list[SamplerState], recents: list[list[int]], n_outputs: list[int]
) -> list[Sampled]:
    """logits: [B, V] fp32, one row per sequence -> one token per row."""
    want_lp = any(s.params.logprobs for s in states)
    logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None  # [B, V]
    out: list[Sampled] = []
    for i, st in enumerate(states):
        p = st.params
        row = _penalize(logits[i].clone(), st, recents[i], n_outputs[i])
        if p.temperature == 0.0 or p.top_k == 1:
            token = int(torch.argmax(row))
        else:
            probs = _filter(row / p.temperature, p)
            # Exponential race (Gumbel-max in disguise): argmax(probs / E), E ~ Exp(1), drawn from
            # the request's own generator on the CPU, so the draw is independent of the batch.
            e = torch.empty(probs.shape[0], dtype=torch.float32).exponential_(generator=st.generator)
            token = int(torch.argmax(probs.cpu() / e))
        s = Sampled(token)
        if p.logprobs and logprobs is not None:
            lp = logprobs[i]
            s.logprob = float(lp[token])
            if p.top_logprobs:
                v, ix = torch.topk(lp, p.top_logprobs)
                s.top = [(int(a), float(b)) for a, b in zip(ix.tolist(), v.tolist())]
        st.output_counts[token] = st.output_counts.get(token, 0) + 1
        out.append(s)
    return out
