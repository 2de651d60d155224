"""The prefix cache: identical greedy output with and without it, exact cached counts, salts."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.cache import kv_block_bytes
from workers.engine import Engine
from workers.model_config import load_config

BS = 8  # block size in these tests


def greedy(n=10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def path(model_factory):
    return str(model_factory("tiny-llama", dtype="float32"))


def make(path, cache=True, blocks=512, **kw) -> Engine:
    budget = kv_block_bytes(load_config(path), BS, torch.float32) * blocks
    return Engine(path, dtype="float32", block_size=BS, kv_budget_bytes=budget, prefix_cache=cache, **kw)


def run(eng: Engine, reqs: dict[str, tuple[list[int], dict]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Submit all, drain; return tokens and cached_tokens per request."""
    for rid, (prompt, kw) in reqs.items():
        eng.submit(rid, prompt, greedy(kw.pop("n", 10)), **kw)
    toks: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while eng.has_work():
        for o in eng.step():
            toks.setdefault(o.request_id, []).append(o.token)
            if o.cached_tokens is not None:
                cached[o.request_id] = o.cached_tokens
    return toks, cached


def conversation(eng: Engine, turns: int = 5, **kw) -> tuple[list[list[int]], list[int]]:
    history: list[int] = list(range(20, 45))
    outs, cached = [], []
    for t in range(turns):
        history += [100 + t, 200 + t, 300 + t]  # the user's new message
        toks, c = run(eng, {f"t{t}": (list(history), dict(kw))})
        outs.append(toks[f"t{t}"])
        cached.append(c[f"t{t}"])
        history += toks[f"t{t}"]
    return outs, cached


def test_multi_turn_identical_and_cached_counts_exact(path):
    with_cache, cached = conversation(make(path))
    without, none = conversation(make(path, cache=False))
    assert with_cache == without
    assert none == [0] * 5
    # Turn t's prompt starts with turn t-1's prompt and output, all computed but the last
    # output token; the cache gives the full blocks of that.
    prompt_len = 25
    expected = [0]
    for _ in range(1, 5):
        computed = prompt_len + 3 + 10 - 1  # previous prompt + its output, minus the last token
        prompt_len += 13
        expected.append(min(computed, prompt_len - 1) // BS * BS)
    assert cached == expected


def test_shared_prefix_across_requests_and_batching(path):
    system = list(range(300, 340))  # a 40-token shared "system prompt"
    reqs = {f"r{i}": (system + [i + 1, i + 2], {}) for i in range(6)}
    eng = make(path)
    warm, _ = run(eng, {"first": (system + [999], {})})
    toks, cached = run(eng, {k: (p, dict(kw)) for k, (p, kw) in reqs.items()})
    ref, _ = run(make(path, cache=False), {k: (p, dict(kw)) for k, (p, kw) in reqs.items()})
    assert toks == ref
    assert all(c == 40 for c in cached.values())


def test_salts_never_share(path):
    eng = make(path)
    prompt = list(range(50, 90))
    _, c1 = run(eng, {"a": (prompt, {"cache_salt": "alice"})})
    _, c2 = run(eng, {"b": (prompt, {"cache_salt": "bob"})})
    _, c3 = run(eng, {"c": (prompt, {})})
    _, c4 = run(eng, {"d": (prompt, {"cache_salt": "alice"})})
    assert (c1["a"], c2["b"], c3["c"]) == (0, 0, 0)
    assert c4["d"] == 32


def test_use_cache_false_bypasses(path):
    eng = make(path)
    prompt = list(range(50, 90))
    run(eng, {"a": (prompt, {"use_cache": False})})
    _, c = run(eng, {"b": (prompt, {})})
    assert c["b"] == 0  # "a" published nothing
    _, c = run(eng, {"c": (prompt, {"use_cache": False})})
    assert c["c"] == 0  # and "c" reused nothing although "b" published


def test_reset_cache(path):
    eng = make(path)
    prompt = list(range(50, 90))
    run(eng, {"a": (prompt, {})})
    assert eng.blocks.num_cached > 0
    eng.reset_cache()
    assert eng.blocks.num_cached == 0
    _, c = run(eng, {"b": (prompt, {})})
    assert c["b"] == 0


def test_eviction_under_small_budget_never_corrupts(path):
    """A pool of 24 blocks: cached prefixes are evicted LRU while others run, outputs exact."""
    reqs = {f"r{i}": ([i * 7 % 1000 + j for j in range(30)], {"n": 12}) for i in range(10)}
    small = make(path, blocks=24, num_slots=4)
    ref_eng = make(path, cache=False)
    for rnd in range(2):  # the second round finds some prefixes still cached, others evicted
        got, cached = run(small, {k: (p, dict(kw)) for k, (p, kw) in reqs.items()})
        ref, _ = run(ref_eng, {k: (p, dict(kw)) for k, (p, kw) in reqs.items()})
        assert got == ref, rnd
    st = small.stats("x")
    assert st.kv_blocks_used == 0 and st.cache_hit_blocks >= 0
    assert small.blocks.num_free == small.blocks.num_blocks
