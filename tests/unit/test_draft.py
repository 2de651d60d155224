"""A draft model for speculative decoding (workers/draft.py): greedy output token for token the
output without speculation (alone, batched, through preemption, prefix hits and aborts), seeded
sampling reproducible, the target as its own draft accepted ~always, refusals at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pantheon.core.protocol import SamplingParams
from workers.block_manager import BlockManager
from workers.draft import _valid_rows
from workers.engine import Engine
from workers.errors import LoadError
from workers.scheduler import Scheduler, Sequence

from helpers.decode_rows import drain, greedy

# Prompts that repeat themselves and ones that do not (the random models loop on the former).
PROMPTS = [
    list(range(100, 120)) * 3,
    [5, 17, 300, 41] * 4,
    [900, 2, 2, 2, 2, 8, 31, 77, 12, 1000, 44],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9],
]


@pytest.fixture(scope="module")
def target(model_factory) -> str:
    return str(model_factory("tiny", dtype="float32"))


@pytest.fixture(scope="module")
def small_draft(model_factory) -> str:
    """Another model of the same tokenizer: one layer, other weights (it agrees only sometimes)."""
    return str(model_factory("tiny", dtype="float32", seed=3, num_hidden_layers=1))


@pytest.fixture(scope="module")
def plain(target) -> dict[str, list[int]]:
    eng = Engine(target, dtype="float32", kv_budget_bytes=8 << 20)
    res = {}
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy(0))
        res[f"p{i}"] = drain(eng)[f"p{i}"]
    return res


@pytest.fixture(scope="module")
def drafted(target, small_draft) -> Engine:
    return Engine(target, dtype="float32", kv_budget_bytes=8 << 20, draft=small_draft)


def test_greedy_with_a_draft_model_is_token_for_token_the_same(drafted, plain):
    eng = drafted
    assert eng.draft is not None and eng.draft_name
    before = (eng.spec.drafted, eng.spec.accepted)
    for i, p in enumerate(PROMPTS):  # alone
        eng.submit(f"p{i}", p, greedy(4))
        assert drain(eng)[f"p{i}"] == plain[f"p{i}"], i
    for i, p in enumerate(PROMPTS):  # batched, unequal k, with a neighbour that does not speculate
        eng.submit(f"p{i}", p, greedy(3 if i % 2 else 4))
    eng.submit("other", PROMPTS[0][::-1], greedy(0))
    out = drain(eng)
    assert {k: out[k] for k in plain} == plain
    drafted, accepted = eng.spec.drafted - before[0], eng.spec.accepted - before[1]
    assert 0 < accepted < drafted  # the draft was both right and wrong (and rolled back)
    assert eng.request_tables()["blocks_held"] == 0


def test_the_target_as_its_own_draft_is_accepted_almost_always(target, plain):
    eng = Engine(target, dtype="float32", kv_budget_bytes=8 << 20, draft=target)
    for i, p in enumerate(PROMPTS[:3]):
        eng.submit(f"p{i}", p, greedy(4))
    out = drain(eng)
    assert {k: out[k] for k in out} == {k: plain[k] for k in out}
    s = eng.spec
    assert s.drafted > 0 and s.accepted / s.drafted > 0.95, (s.accepted, s.drafted)
    assert s.emitted / s.verify_steps > 4.0  # about k + 1 tokens per verify step
    st = eng.stats("i")
    assert st.spec_draft == target and st.spec_accepted == s.accepted


def test_the_two_pools_share_the_budget_and_are_reported(target, small_draft):
    alone = Engine(target, dtype="float32", kv_budget_bytes=4 << 20)
    eng = Engine(target, dtype="float32", kv_budget_bytes=4 << 20, draft=small_draft)
    assert eng.draft is not None
    # the draft's pool has the target's block count, both together within the budget
    assert eng.kv_bytes == eng.runner.kv_bytes + eng.draft.kv_bytes <= 4 << 20
    assert eng.draft.kv_bytes * 2 == eng.runner.kv_bytes  # one layer against two
    assert eng.blocks.num_blocks == alone.blocks.num_blocks * 2 // 3
    assert eng.weight_bytes > alone.weight_bytes


def test_preemption_prefix_hits_and_aborts_keep_greedy_exact(target, small_draft, plain):
    # a pool of 12 blocks (192 tokens) for 4 sequences of up to ~100: the newest are preempted
    per_block = Engine(target, dtype="float32", kv_budget_bytes=1 << 20, draft=small_draft)
    block_bytes = per_block.kv_bytes // per_block.blocks.num_blocks
    eng = Engine(target, dtype="float32", kv_budget_bytes=12 * block_bytes, draft=small_draft)
    assert eng.blocks.num_blocks == 12
    preempted = []
    real = eng.scheduler._preempt

    def spy(seq, plan):
        preempted.append(seq.request_id)
        real(seq, plan)

    eng.scheduler._preempt = spy
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy(4))
    out = drain(eng)
    assert preempted and out == plain
    # a prefix hit: a prompt that continues a finished one reuses its blocks (the target's rows
    # and the draft's); the answer is the one without speculation
    follow = PROMPTS[1] + plain["p1"][:20]
    assert eng.draft is not None
    rows = eng.draft.caught_up
    eng.submit("hit", follow, greedy(4, n=12))
    hit = drain(eng)["hit"]
    assert eng.blocks.hits > 0
    # the draft's rows of the cached blocks were reused too: its catch-ups computed the rest only
    assert eng.draft.caught_up - rows < len(follow) - 16, (eng.draft.caught_up - rows, len(follow))
    eng.submit("ref", follow, greedy(0, n=12))
    assert drain(eng)["ref"] == hit
    # an abort mid-answer leaves the others exact
    eng.submit("a", PROMPTS[0], greedy(4))
    eng.submit("b", PROMPTS[2], greedy(4))
    for _ in range(3):
        eng.step()
    eng.abort("a")
    assert drain(eng)["b"][-10:] == plain["p2"][-10:]
    assert eng.request_tables()["blocks_held"] == 0


def test_each_proposal_is_the_draft_models_own_greedy_continuation(drafted, small_draft):
    """The draft's rows are right after rejections and catch-ups: what it proposes from a
    sequence's tokens is what the draft model alone decodes greedily from them."""
    eng = drafted
    assert eng.draft is not None
    seen: list[tuple[list[int], list[int]]] = []
    real = eng.draft.propose

    def spy(wants):
        real(wants)
        seen.extend((list(s.tokens), list(s.draft)) for s, _k in wants if s.draft)

    eng.draft.propose = spy
    try:
        eng.submit("a", PROMPTS[3], greedy(4))
        eng.submit("b", PROMPTS[2], greedy(3))
        drain(eng)
    finally:
        del eng.draft.propose
    assert len(seen) > 10
    alone = Engine(small_draft, dtype="float32", kv_budget_bytes=4 << 20, prefix_cache=False)
    for i, (tokens, draft) in enumerate(seen[::3]):
        alone.submit(f"r{i}", tokens, greedy(0, n=len(draft)))
        assert drain(alone)[f"r{i}"] == draft, i


def test_a_long_prompt_catches_the_draft_up_over_several_steps(target, small_draft, plain):
    eng = Engine(target, dtype="float32", kv_budget_bytes=8 << 20, draft=small_draft, prefill_chunk=16)
    assert eng.draft is not None and eng.draft.catch_up == 16
    eng.submit("p0", PROMPTS[0], greedy(4))  # 60 tokens: the draft is 4 steps behind at first
    assert drain(eng)["p0"] == plain["p0"]
    assert eng.spec.accepted > 0


def test_seeded_sampling_with_a_draft_repeats_itself(drafted):
    params = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=30, ignore_eos=True, speculative=4)
    drafted.submit("s", PROMPTS[0], params)
    solo = drain(drafted)["s"]
    drafted.submit("s", PROMPTS[0], params)
    assert drain(drafted)["s"] == solo
    drafted.submit("s", PROMPTS[0], params)
    drafted.submit("o", PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert drain(drafted)["s"] == solo


def test_draft_rows_count_only_as_far_as_the_step_kept_its_proposals():
    seq = Sequence("s", 4, [1, 2, 3, 4, 5, 6, 9], 20)
    seq.draft_computed, seq.draft_fed = 6, [5, 7]  # fed 5 at position 4 and 7 at 5; kept 5, then 6
    assert _valid_rows(seq) == 5
    seq.draft_computed, seq.draft_fed = 6, [5, 6]  # both kept: all but the pending token
    assert _valid_rows(seq) == 6
    seq.draft_computed, seq.draft_fed = 7, []  # never past the pending token (its logits give d0)
    assert _valid_rows(seq) == 6
    # a preemption drops the draft's progress with the blocks
    sched = Scheduler(BlockManager(num_blocks=8, block_size=4), num_slots=2)
    sched.add(seq)
    plan = sched.schedule()
    sched.commit(plan)
    seq.draft_computed, seq.draft_fed = 5, [5]
    sched._preempt(seq, plan)
    assert (seq.draft_computed, seq.draft_fed, seq.num_computed) == (0, [], 0)


def _other_tokenizer(src: str, dst: Path) -> str:
    """A copy of ``src`` whose tokenizer spells one token differently (same size, same ids)."""
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    victim = next(t for t, i in vocab.items() if i == 600)
    vocab["zqzqzq"] = vocab.pop(victim)
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return str(dst)


def test_a_draft_of_another_tokenizer_or_with_rolling_state_is_refused(target, model_factory, tmp_path):
    other = _other_tokenizer(target, tmp_path / "other")
    with pytest.raises(LoadError, match="tokenizer differs.*first id 600") as e:
        Engine(target, dtype="float32", kv_budget_bytes=4 << 20, draft=other)
    assert e.value.kind == "invalid"
    for preset, what in (("tiny-qwen3.5-text", "recurrent"), ("tiny-gemma3", "sliding-window")):
        with pytest.raises(LoadError, match=what):
            Engine(target, dtype="float32", kv_budget_bytes=4 << 20, draft=str(model_factory(preset)))
    # a model that cannot verify drafts takes none
    with pytest.raises(LoadError, match="cannot speculate"):
        Engine(str(model_factory("tiny-gemma3")), kv_budget_bytes=4 << 20, draft=target)
