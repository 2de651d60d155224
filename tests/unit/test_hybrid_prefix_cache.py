"""The prefix cache on models with per-slot states (Qwen3.5: three of four layers keep a recurrent
state; Gemma 3 and Mistral: sliding-window layers keep a ring of their window): KV blocks plus
state checkpoints at block boundaries (workers/state_checkpoints.py).

A wrong restored state is the worst bug this can have, and it does not crash: it changes the
answer. So every test compares the tokens with the cache against the tokens without it, at
temperature 0, token for token, and checks that the cache really served tokens."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.cache import kv_block_bytes
from workers.engine import Engine
from workers.model_config import load_config
from workers.state_checkpoints import CheckpointIndex


def greedy(n=10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# Qwen3.5 (recurrent states), Gemma 3 (five of six layers keep a 16-position sliding-window
# ring per slot, checkpointed the same way) and Mistral on the Llama module (every layer an
# 8-position ring: no paged layer at all, the blocks are bookkeeping only)
MODELS = {
    "qwen3.5": ("tiny-qwen3.5-text", {}),
    "gemma3": ("tiny-gemma3", {}),
    "mistral": (
        "tiny-llama",
        dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8),
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def path(model_factory, request):
    preset, overrides = MODELS[request.param]
    return str(model_factory(preset, dtype="float32", **overrides))


def make(path, bs: int, cache=True, **kw) -> Engine:
    budget = kv_block_bytes(load_config(path), bs, torch.float32) * 512
    eng = Engine(path, dtype="float32", block_size=bs, kv_budget_bytes=budget, prefix_cache=cache, **kw)
    for key in [k for k in LOGITS if k[0] == id(eng)]:  # an id a collected engine had
        del LOGITS[key]
    return eng


LOGITS: dict[tuple[int, str], list[torch.Tensor]] = {}  # (engine id, request) -> each step's logits


def run(eng: Engine, reqs: dict[str, tuple[list[int], dict]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Submit all, drain; return tokens and cached_tokens per request (each sampled row's logits
    go to ``LOGITS``)."""

    def keep(seqs, logits):
        for i, s in enumerate(seqs):
            LOGITS.setdefault((id(eng), s.request_id), []).append(logits[i].clone())

    eng.on_logits = keep
    for rid, (prompt, kw) in reqs.items():
        kw = dict(kw)
        eng.submit(rid, prompt, greedy(kw.pop("n", 10)), **kw)
    toks: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while eng.has_work():
        for o in eng.step():
            toks.setdefault(o.request_id, []).append(o.token)
            if o.cached_tokens is not None:
                cached[o.request_id] = o.cached_tokens
    return toks, cached


def same_logits(a: Engine, b: Engine, rid: str) -> None:
    """Request ``rid``'s logits at every sampled step agree between the two engines: a restored
    state that is slightly off would still often pick the same greedy tokens."""
    la, lb = LOGITS[(id(a), rid)], LOGITS[(id(b), rid)]
    assert len(la) == len(lb)
    err = max((x - y).abs().max().item() for x, y in zip(la, lb))
    assert err < 1e-4, f"{rid}: logits differ by {err:.2e}"


def conversation(eng: Engine, first: int, turns: int = 4) -> tuple[list[list[int]], list[int]]:
    history: list[int] = [(37 * i + 11) % 3900 for i in range(first)]
    outs, cached = [], []
    for t in range(turns):
        history += [100 + t, 200 + t, 300 + t]  # the user's new message
        toks, c = run(eng, {f"t{t}": (list(history), {})})
        outs.append(toks[f"t{t}"])
        cached.append(c[f"t{t}"])
        history += toks[f"t{t}"]
    return outs, cached


@pytest.mark.parametrize("bs,first", [(4, 5), (8, 25), (16, 13), (16, 61)])
def test_multi_turn_identical_and_cached_counts_exact(path, bs, first):
    """Turn t's prompt starts with turn t-1's prompt and answer; the cache restores the newest
    block boundary of that which the previous turn passed (its decode checkpoint), and every
    turn's tokens equal those of an engine without a cache."""
    a, b = make(path, bs), make(path, bs, cache=False)
    with_cache, cached = conversation(a, first)
    without, none = conversation(b, first)
    assert with_cache == without
    for t in range(4):
        same_logits(a, b, f"t{t}")
    assert none == [0] * 4
    prompt_len, expected = first + 3, [0]
    for _ in range(1, 4):
        computed = prompt_len + 10 - 1  # previous prompt + its output, minus the last token
        prompt_len += 13
        expected.append(min(computed, prompt_len - 1) // bs * bs)
    assert cached == expected
    assert all(c > 0 for c in cached[1:])


@pytest.mark.parametrize("bs", [4, 8, 16])
def test_shared_prefix_across_requests_and_batching(path, bs):
    """A shared system prompt, checkpointed at its last boundary by the first request, is
    restored into six batched requests at once (each into its own slot)."""
    system = [(13 * i + 5) % 3900 for i in range(40)]
    reqs = {f"r{i}": (system + [i + 1, i + 2], {}) for i in range(6)}
    eng = make(path, bs)
    run(eng, {"first": (system + [999], {})})
    toks, cached = run(eng, reqs)
    other = make(path, bs, cache=False)
    ref, _ = run(other, reqs)
    assert toks == ref
    for rid in reqs:
        same_logits(eng, other, rid)
    assert set(cached.values()) == {40 // bs * bs}
    assert eng.checkpoints is not None and eng.checkpoints.hits >= 6


def test_chunked_prefill_ends_on_the_checkpoint_boundary(path):
    """With small chunks, the prompt's last boundary still gets its checkpoint and a second
    request restores it; the tokens equal the uncached ones."""
    prompt = [(7 * i + 1) % 3900 for i in range(53)]
    eng = make(path, 8, prefill_chunk=6)
    a, _ = run(eng, {"a": (prompt, {})})
    b, cached = run(eng, {"b": (prompt + [5, 6], {})})
    other = make(path, 8, cache=False, prefill_chunk=6)
    ref, _ = run(other, {"b": (prompt + [5, 6], {})})
    assert b == ref and cached["b"] == 48
    same_logits(eng, other, "b")


def test_salts_and_eviction(path):
    """Another cache salt sees nothing; a pool of one checkpoint keeps only the newest, and a
    prefix whose checkpoint was evicted is recomputed (its KV blocks are not enough)."""
    prompt = [(11 * i + 3) % 3900 for i in range(33)]
    eng = make(path, 8, state_checkpoints=1)
    run(eng, {"a": (prompt, {"cache_salt": "one", "n": 2})})  # prompt checkpoint, then a decode one
    toks, cached = run(eng, {"b": (prompt + [1], {"cache_salt": "two"})})
    assert cached["b"] == 0
    other = [(5 * i + 9) % 3900 for i in range(33)]
    run(eng, {"c": (other, {"n": 1})})  # takes the only checkpoint
    toks, cached = run(eng, {"e": (other + [2], {})})
    ref, _ = run(make(path, 8, cache=False), {"e": (other + [2], {})})
    assert cached["e"] == 32 and toks == ref
    toks, cached = run(eng, {"d": (prompt + [1], {"cache_salt": "one"})})  # its KV blocks are still there
    ref, _ = run(make(path, 8, cache=False), {"d": (prompt + [1], {})})
    assert cached["d"] == 0 and toks == ref


def test_no_checkpoints_means_no_prefix_cache(path):
    eng = make(path, 8, state_checkpoints=0)
    assert eng.checkpoints is None and not eng.prefix_cache
    prompt = list(range(50, 90))
    run(eng, {"a": (prompt, {})})
    _, cached = run(eng, {"b": (prompt + [1], {})})
    assert cached["b"] == 0


def test_the_checkpoint_pool_is_booked(path):
    eng = make(path, 8, num_slots=4, state_checkpoints=3)
    per = load_config(path).state_bytes_per_slot(4)
    assert eng.state_bytes == (4 + 1 + 3) * per


# ---------------------------------------------------------------- the index alone


def test_index_lru_drop_and_capacity():
    ix = CheckpointIndex(2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    ia, ib = ix.put(a), ix.put(b)
    assert {ia, ib} == {0, 1} and ix.num_used == 2
    assert ix.put(a) is None  # kept already: nothing to write, now the newest
    ic = ix.put(c)  # full: the least recently used (b) goes
    assert ic == ib and not ix.has(b) and ix.has(a) and ix.get(c) == ic
    ix.drop(a)
    assert not ix.has(a) and ix.put(b) == ia
    ix.reset()
    assert ix.num_used == 0 and ix.put(a) is not None
    assert CheckpointIndex(0).put(a) is None
    with pytest.raises(ValueError):
        CheckpointIndex(-1)
