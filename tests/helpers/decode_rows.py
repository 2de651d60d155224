"""Test helpers for decode rows: a ``StepBatch`` of decode rows over a shuffled paged pool (as the
runner builds one), running an engine's requests to the end, and greedy tokens of a fresh engine."""

from __future__ import annotations

import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine
from workers.layers import attention as A


def decode_batch(
    lens: list[int], bs: int, seed: int = 0, idx: torch.dtype = torch.long, kernel: bool = True
) -> tuple[A.StepBatch, int]:
    """Decode rows of ``lens`` positions over shuffled blocks (the runner's padding: block 0 past
    a table's end; block tables and lengths as ``idx``); the batch and the pool's row count.
    ``kernel=False`` leaves out the rows' lengths, which the paged kernel needs: the torch path."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-max(lens) // bs)
    pool = len(lens) * nb + 3
    tab = (torch.randperm(pool - 1, generator=g) + 1)[: len(lens) * nb].view(len(lens), nb)
    for i, n in enumerate(lens):
        tab[i, -(-n // bs) :] = 0
    t = max(lens)
    gather = (tab[:, :, None] * bs + torch.arange(bs)).view(len(lens), -1)[:, :t]
    bias = None
    if min(lens) < t:
        pad = torch.arange(t)[None, :] >= torch.tensor(lens)[:, None]
        bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :]
    b = A.StepBatch(
        torch.zeros(1), torch.zeros(1), torch.zeros(len(lens), dtype=torch.long), len(lens), gather, bias, [],
        decode_blocks=tab.to(idx), block_size=bs, decode_lens=torch.tensor(lens, dtype=idx) if kernel else None,
    )  # fmt: skip
    return b, pool * bs


def greedy(spec: int, n: int = 40, **kw) -> SamplingParams:
    """Greedy, ``n`` tokens past any EOS, ``spec`` drafts per step."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=spec, **kw)


def drain(eng: Engine) -> dict[str, list[int]]:
    """Step ``eng`` until it has no work: each request's tokens."""
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token)
    return out


def seeded_speculation_repeats(eng: Engine, prompt: list[int], other: list[int], spec: int) -> None:
    """A seeded sampled request that speculates (``spec`` drafts a step) gives the same tokens
    alone and beside another sampled request (asserted)."""
    params = SamplingParams(
        temperature=0.8, top_k=40, seed=7, max_tokens=30, ignore_eos=True, speculative=spec
    )
    eng.submit("s", prompt, params)
    solo = drain(eng)["s"]
    eng.submit("s", prompt, params)
    eng.submit("o", other, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert drain(eng)["s"] == solo


PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(300, 420))]


def greedy_tokens(
    path,
    prompts: list[list[int]],
    kinds: tuple[str, str] = ("auto", "auto"),
    dtype: str = "float32",
    n: int = 8,
    **kw,
) -> list[list[int]]:
    """Greedy tokens (``n`` each, past EOS) of ``prompts`` submitted together to a fresh engine of
    ``path`` (a 4 MB KV budget of ``kinds``; ``kw``: more ``Engine`` options), closed after."""
    k, v = kinds
    e = Engine(str(path), dtype=dtype, kv_budget_bytes=4 << 20, kv_cache_k=k, kv_cache_v=v, **kw)
    for i, p in enumerate(prompts):
        e.submit(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out = drain(e)
    e.close()
    return [out[str(i)] for i in range(len(prompts))]
