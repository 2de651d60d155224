"""Token sampling inside the engine, one row of logits per sequence.

Penalties and masks are applied row by row with each request's own parameters; greedy rows
take the argmax. A sampled row draws from its own ``torch.Generator``, which lives on the
logits' device (seeded from the request's ``seed`` when given), so a seeded request gets the
same tokens whatever else is in the batch. Everything stays on the device until the end of the
step, when one copy brings back the ``B`` token ids and one more the logprobs that were asked
for: no ``[V]`` row ever crosses to the host (at a 150k vocabulary that is 600 KB per slot per
step, and a sync point for every row).

A seeded stream is reproducible on one kind of device: CPU and CUDA generators draw different
numbers from the same seed.

``verify`` checks a speculative draft (``workers/speculation.py``) against the target's rows:
argmax agreement when greedy, rejection sampling that keeps the distribution exact otherwise.

Logprobs are those of the model's raw distribution (log-softmax of the logits before penalties
and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pantheon.core.protocol import SamplingParams


@dataclass
class SamplerState:
    """Per-request sampling state that outlives one step."""

    params: SamplingParams
    stop_ids: list[int]  # masked while fewer than min_tokens came out
    generator: torch.Generator  # on the device the request's logits are on
    output_counts: dict[int, int] = field(default_factory=dict)  # for presence/frequency penalties

    @classmethod
    def create(cls, params: SamplingParams, stop_ids: list[int], device: torch.device) -> SamplerState:
        g = torch.Generator(device=device)
        g.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        return cls(params=params, stop_ids=stop_ids, generator=g)


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def _penalize(row: torch.Tensor, st: SamplerState, recent: list[int], n_output: int) -> torch.Tensor:
    p = st.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype)
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


def _greedy(p: SamplingParams) -> bool:
    """The row's token is the argmax of its (penalized) logits: no draw."""
    return p.temperature == 0.0 or p.top_k == 1


def _plain_greedy(st: SamplerState, recent: list[int], n_output: int) -> bool:
    """Whether a row's token is the argmax of its raw logits: greedy, and none of ``_penalize``'s
    conditions holds (so the row needs neither a copy nor a pass of its own)."""
    p = st.params
    return (
        _greedy(p)
        and not p.logit_bias
        and (p.repetition_penalty == 1.0 or not recent)
        and not ((p.presence_penalty or p.frequency_penalty) and st.output_counts)
        and not (n_output < p.min_tokens and st.stop_ids)
    )


def _pick(row: torch.Tensor, st: SamplerState) -> torch.Tensor:
    """row: [V] penalized logits -> the chosen token id, a 0-dim tensor on the row's device."""
    p = st.params
    if _greedy(p):
        return torch.argmax(row)
    probs = _filter(row / p.temperature, p)
    # Exponential race (Gumbel-max in disguise): argmax(probs / E), E ~ Exp(1), drawn from the
    # request's own generator, so the draw is independent of the batch.
    e = torch.empty_like(probs).exponential_(generator=st.generator)
    return torch.argmax(probs / e)


def sample(
    logits: torch.Tensor, states: list[SamplerState], recents: list[list[int]], n_outputs: list[int]
) -> list[Sampled]:
    """logits: [B, V] fp32, one row per sequence -> one token per row."""
    plain = [_plain_greedy(st, recents[i], n_outputs[i]) for i, st in enumerate(states)]
    if all(plain):
        # every row a plain argmax: one op for the batch (the first maximum, as per row)
        picks = torch.argmax(logits, dim=-1)  # [B] token ids, on the device
    else:
        picks = torch.stack(
            [
                torch.argmax(logits[i])
                if plain[i]
                else _pick(_penalize(logits[i].clone(), st, recents[i], n_outputs[i]), st)
                for i, st in enumerate(states)
            ]
        )  # [B] token ids, on the device
    out = [Sampled(t) for t in picks.tolist()]  # the one copy of the tokens
    asked = [i for i, st in enumerate(states) if st.params.logprobs]
    if asked:
        # logprobs of the raw distribution, for the rows that asked, gathered on the device
        rows = torch.tensor(asked, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, rows), dim=-1)  # [A, V]
        chosen = lp.gather(1, picks.index_select(0, rows)[:, None])[:, 0].tolist()
        k = max(states[i].params.top_logprobs for i in asked)
        top_v, top_i = torch.topk(lp, k) if k else (None, None)  # [A, k]
        tv = top_v.tolist() if top_v is not None else None
        ti = top_i.tolist() if top_i is not None else None
        for j, i in enumerate(asked):
            out[i].logprob = chosen[j]
            n = states[i].params.top_logprobs
            if n and tv is not None and ti is not None:
                out[i].top = list(zip(ti[j][:n], tv[j][:n]))
    for s, st in zip(out, states):
        st.output_counts[s.token] = st.output_counts.get(s.token, 0) + 1
    return out


def verify(logits: torch.Tensor, draft: list[int], st: SamplerState, n_output: int) -> list[int]:
    """Check a speculative draft: ``logits`` [k + 1, V] fp32 are the target's rows for the
    pending token and the ``k`` drafted ones. Returns the tokens to emit: the longest accepted
    prefix of ``draft`` plus one token of the target's own (1 .. k + 1 tokens).

    Greedy: a draft token is accepted while it is the argmax, so the output is token for token
    the one without speculation. Sampled: rejection sampling for a deterministic draft (its
    proposal q is one-hot on ``x``): accept ``x`` with probability p(x) (min(1, p/q)); on a
    rejection draw from p with ``x`` removed and renormalised (norm(max(0, p - q))), which keeps
    the output distribution exactly p. All draws come from the request's own generator, so a
    seeded request repeats itself with speculation on. Only logit_bias and the min_tokens mask
    are applied here (row i has ``n_output + i`` outputs before it): a request with penalties,
    logprobs or a grammar is never drafted for (``workers/speculation.py``).
    """
    k = len(draft)
    rows = torch.stack([_penalize(logits[i].clone(), st, [], n_output + i) for i in range(k + 1)])
    p = st.params
    if p.temperature == 0.0 or p.top_k == 1:
        target = torch.argmax(rows, dim=-1).tolist()  # one copy for the k + 1 rows
        a = 0
        while a < k and target[a] == draft[a]:
            a += 1
        out = draft[:a] + [target[a]]
    else:
        probs = torch.stack([_filter(rows[i] / p.temperature, p) for i in range(k + 1)])  # [k + 1, V]
        d = torch.tensor(draft, dtype=torch.long, device=probs.device)
        p_draft = probs[:k].gather(1, d[:, None])[:, 0]  # p(x_i) at each draft row
        u = torch.rand(k, generator=st.generator, device=probs.device, dtype=probs.dtype)
        ok = (u < p_draft).tolist()
        a = ok.index(False) if False in ok else k
        last = probs[a].clone()
        if a < k:
            last[draft[a]] = 0.0  # the residual of a one-hot proposal: p without x
            mass = last.sum()
            # p(x) within rounding of 1 and still rejected: nothing else has mass, keep p
            last = last / mass if float(mass) > 0 else probs[a]
        e = torch.empty_like(last).exponential_(generator=st.generator)
        out = draft[:a] + [int(torch.argmax(last / e))]
    for t in out:
        st.output_counts[t] = st.output_counts.get(t, 0) + 1
    return out
