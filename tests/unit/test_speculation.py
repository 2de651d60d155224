"""Prompt-lookup speculation (workers/speculation.py): exact under greedy, distribution-exact and
reproducible under sampling, cut right by stop ids and max_tokens, off where it cannot be exact."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.block_manager import BlockManager
from workers.engine import Engine
from workers.sampler import SamplerState, verify
from workers.scheduler import Scheduler, Sequence
from workers.speculation import propose

from helpers.decode_rows import drain, greedy, seeded_speculation_repeats

# Prompts that repeat themselves, so the context drafts (and the random model's output loops).
PROMPTS = [
    list(range(100, 120)) * 3,
    [5, 17, 300, 41] * 4,
    [900, 2, 2, 2, 2, 8, 31, 77, 12, 1000, 44],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9],
]


# ---------------------------------------------------------------- the proposer


def test_propose_takes_what_followed_the_most_recent_longest_match():
    assert propose([1, 2, 3, 4, 1, 2, 3], k=3) == [4, 1, 2]
    assert propose([1, 2, 3, 4, 9, 2, 3, 7, 2, 3], k=2) == [7, 2]  # the most recent of equal length
    # a longer match wins over a more recent shorter one
    assert propose([5, 2, 3, 8, 9, 9, 2, 3, 6, 5, 2, 3], k=2, max_n=3) == [8, 9]
    assert propose([1, 2, 1, 2, 1, 2], k=4) == [1, 2]  # overlapping the suffix; fewer than k left
    assert propose([1, 2, 3, 4], k=3) == []  # no earlier occurrence
    assert propose([1, 2, 3, 4, 2, 3, 9, 4], k=3) == []  # only a 1-gram matches (below MIN_N)
    assert propose([1, 2, 3, 1, 2], k=0) == []


# ---------------------------------------------------------------- the scheduler's bookkeeping


def _decoding(sched: Scheduler, n_prompt: int, max_tokens: int, stop=()) -> Sequence:
    seq = Sequence("s", n_prompt, list(range(1, n_prompt + 1)), max_tokens, frozenset(stop))
    sched.add(seq)
    plan = sched.schedule()
    sched.commit(plan)
    sched.append_token(seq, 900)  # its first token: now it decodes
    assert seq.decoding
    return seq


def test_a_verify_chunk_takes_free_blocks_and_accept_keeps_the_agreed_rows():
    sched = Scheduler(BlockManager(num_blocks=8, block_size=4), num_slots=2)
    seq = _decoding(sched, 6, max_tokens=20)
    seq.draft = [1, 2, 3, 4]
    plan = sched.schedule()
    assert plan.verify == [seq] and plan.decode == [] and not plan.empty
    assert len(seq.block_table) == 3  # positions 0..10: the pending token (6) and 4 drafts
    taken, reason = sched.accept(seq, [1, 2, 77])  # 2 drafts kept, then the target's own
    assert taken == [1, 2, 77] and reason is None
    assert seq.num_computed == 9 and seq.pending == 1 and seq.draft == []
    assert seq.tokens[6:] == [900, 1, 2, 77]
    assert len(seq.block_table) == 3  # the rejected rows' block stays, to be overwritten


def test_accept_stops_at_a_stop_id_and_at_max_tokens():
    sched = Scheduler(BlockManager(num_blocks=8, block_size=4), num_slots=2)
    seq = _decoding(sched, 6, max_tokens=20, stop=[2])
    seq.draft = [1, 2, 3]
    sched.schedule()
    taken, reason = sched.accept(seq, [1, 2, 3, 9])
    assert taken == [1, 2] and reason == "stop" and seq.finish == "stop" and seq.block_table == []
    seq = _decoding(sched, 6, max_tokens=3)
    seq.draft = [1, 2]
    sched.schedule()
    assert sched.accept(seq, [1, 2, 5]) == ([1, 2], "length")


def test_a_draft_that_does_not_fit_decodes_one_token_instead():
    sched = Scheduler(BlockManager(num_blocks=2, block_size=4), num_slots=1)
    seq = _decoding(sched, 6, max_tokens=20)
    seq.draft = [1, 2, 3, 4]  # would need positions up to 10: 3 blocks, the pool has 2
    plan = sched.schedule()
    assert plan.decode == [seq] and plan.verify == [] and seq.draft == []


# ---------------------------------------------------------------- rejection sampling


@pytest.mark.parametrize("draft", [[2], [4, 1]])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """Whatever the draft, the first emitted token is distributed as the target's p."""
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5]] * (len(draft) + 1))
    p = torch.softmax(logits[0], -1)
    counts = torch.zeros(5)
    n = 6000
    for i in range(n):
        st = SamplerState.create(
            SamplingParams(temperature=1.0, max_tokens=8, seed=i), [], torch.device("cpu")
        )
        out = verify(logits, draft, st, 1)
        assert 1 <= len(out) <= len(draft) + 1 and out[:-1] == draft[: len(out) - 1]
        counts[out[0]] += 1
    assert torch.allclose(counts / n, p, atol=0.02), (counts / n, p)


def test_greedy_verify_accepts_the_argmax_prefix():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    st = SamplerState.create(SamplingParams(temperature=0.0), [], torch.device("cpu"))
    assert verify(logits, [3, 1, 4], st, 1) == [3, 1, 4, 2]  # all accepted, plus the bonus
    assert verify(logits, [3, 0, 4], st, 1) == [3, 1]  # the first mismatch ends it


# ---------------------------------------------------------------- the engine


def finishes(eng: Engine) -> dict[str, tuple[list[int], str | None]]:
    out: dict[str, tuple[list[int], str | None]] = {}
    while eng.has_work():
        for o in eng.step():
            toks, _f = out.get(o.request_id, ([], None))
            out[o.request_id] = (toks + [o.token], o.finish)
    return out


@pytest.fixture(scope="module", params=["tiny-llama", "tiny", "tiny-bf16"])
def engine(model_factory, request):
    """fp32, and bf16 weights on the CPU path the load picks: verify rows are decode rows, so the
    kernels (and their rounding) are those of plain decoding, on every path. (A hybrid model:
    tests/unit/test_speculation_hybrid.py.)"""
    if request.param == "tiny-bf16":
        return Engine(str(model_factory("tiny")), kv_budget_bytes=8 << 20)
    path = str(model_factory(request.param, dtype="float32"))
    return Engine(path, dtype="float32", kv_budget_bytes=8 << 20)


@pytest.fixture(scope="module")
def plain(engine):
    """Each prompt alone, without speculation."""
    res = {}
    for i, p in enumerate(PROMPTS):
        engine.submit(f"p{i}", p, greedy(0))
        res[f"p{i}"] = drain(engine)[f"p{i}"]
    return res


def test_greedy_with_speculation_is_token_for_token_the_same(engine, plain):
    assert engine.spec_supported
    before = (engine.spec.drafted, engine.spec.accepted)
    for i, p in enumerate(PROMPTS):  # alone
        engine.submit(f"p{i}", p, greedy(4))
        assert drain(engine)[f"p{i}"] == plain[f"p{i}"], i
    for i, p in enumerate(PROMPTS):  # batched, with a neighbour that does not speculate
        engine.submit(f"p{i}", p, greedy(3 if i % 2 else 4))
    engine.submit("other", PROMPTS[0][::-1], greedy(0))
    out = drain(engine)
    assert {k: out[k] for k in plain} == plain
    drafted, accepted = engine.spec.drafted - before[0], engine.spec.accepted - before[1]
    assert 0 < accepted < drafted  # drafts were both kept and rejected (and rolled back)


def test_blocks_filed_by_speculating_sequences_are_right(engine, plain):
    """The output blocks a speculating sequence put in the prefix cache hold the right K/V."""
    engine.submit("s", PROMPTS[1], greedy(4))
    out = drain(engine)["s"]
    follow = PROMPTS[1] + out[:-1]  # reuses the blocks the speculating decode filed
    engine.submit("hit", follow, greedy(0, n=6))
    hit = drain(engine)["hit"]
    engine.reset_cache()
    engine.submit("cold", follow, greedy(0, n=6))
    assert drain(engine)["cold"] == hit


def test_stop_ids_and_max_tokens_cut_the_accepted_tokens(engine, plain):
    out = plain["p1"]
    for j in (3, 9, 17, 30):
        stop = out[j]
        first = out.index(stop)
        engine.submit("a", PROMPTS[1], greedy(0, stop_token_ids=[stop]))
        engine.submit("b", PROMPTS[1], greedy(4, stop_token_ids=[stop]))
        res = finishes(engine)
        assert res["a"] == res["b"] == (out[: first + 1], "stop")
    for n in (1, 2, 5, 13):
        engine.submit("m", PROMPTS[1], greedy(4, n=n))
        assert finishes(engine)["m"] == (out[:n], "length")


def test_seeded_sampling_with_speculation_repeats_itself(engine):
    seeded_speculation_repeats(engine, PROMPTS[0], PROMPTS[1], 4)


def test_requests_that_cannot_be_verified_row_by_row_do_not_speculate(engine, plain):
    steps = engine.spec.verify_steps
    engine.submit("lp", PROMPTS[1], greedy(4, logprobs=True))
    engine.submit("rp", PROMPTS[1], greedy(4, repetition_penalty=1.3))
    drain(engine)
    assert engine.spec.verify_steps == steps


def test_sliding_models_are_excluded(model_factory):
    for preset in ("tiny-gemma3",):
        eng = Engine(str(model_factory(preset, dtype="float32")), dtype="float32", kv_budget_bytes=8 << 20)
        assert not eng.spec_supported
        eng.submit("a", PROMPTS[1], greedy(0, n=8))
        want = drain(eng)["a"]
        eng.submit("b", PROMPTS[1], greedy(4, n=8))
        assert drain(eng)["b"] == want
        assert eng.spec.verify_steps == 0
