"""The step budget: prefill tokens per step sized from measured step times (no torch)."""

from __future__ import annotations

import pytest

from workers.step_budget import StepBudget


def test_the_ceiling_until_something_was_measured():
    b = StepBudget(target_s=0.5, ceiling=512)
    assert b.tokens() == 512
    b.observe(n_decode=4, n_prefill=0, seconds=0.05)  # decode alone says nothing of prefill
    assert b.tokens() == 512


def test_sized_to_the_target_from_the_measured_costs():
    b = StepBudget(target_s=0.5, ceiling=4096)
    b.observe(n_decode=8, n_prefill=0, seconds=0.1)  # decode: 100 ms a step
    b.observe(n_decode=8, n_prefill=100, seconds=0.1 + 100 * 0.004)  # 4 ms a prompt token
    assert b.decode_s == pytest.approx(0.1) and b.per_token_s == pytest.approx(0.004)
    assert b.tokens() == 75  # (min(0.5, 4 x 0.1) - 0.1) / 0.004: streams keep a quarter
    assert b.tokens(decoding=False) == 125  # nothing decodes: the whole target is prefill
    b.decode_s = 0.02  # a fast decode: the step beside it stays short (4 x 20 ms)
    assert b.tokens() == 15 + 1 == b.floor  # (0.08 - 0.02) / 0.004 = 15, lifted to the floor
    b.per_token_s = 0.001
    assert b.tokens() == 60  # (0.08 - 0.02) / 0.001


def test_a_slow_machine_gets_small_chunks_but_never_below_the_floor():
    b = StepBudget(target_s=0.5, ceiling=512, floor=16)
    b.observe(0, 128, 1.6)  # 12.5 ms a token: the qwen3-0.6b-on-AVX2 case
    assert b.tokens() == 40
    b.observe(8, 0, 0.6)  # decoding alone already takes longer than the target
    b.decode_s = 0.6
    assert b.tokens() == 16


def test_a_fast_machine_is_capped_by_the_ceiling():
    b = StepBudget(target_s=0.5, ceiling=512)
    b.observe(0, 512, 0.01)
    assert b.tokens() == 512


def test_moving_average_follows_a_change():
    b = StepBudget(target_s=1.0, ceiling=10_000)
    b.observe(0, 100, 1.0)  # 10 ms a token
    for _ in range(20):
        b.observe(0, 100, 0.1)  # then 1 ms a token (the page cache warmed up, say)
    assert 900 <= b.tokens() <= 1000


def test_bad_samples_and_settings():
    b = StepBudget(target_s=0.5, ceiling=64)
    b.observe(0, 0, 1.0)  # an empty step
    b.observe(1, 1, -1.0)  # a clock that went backwards
    assert b.decode_s is None and b.per_token_s is None
    with pytest.raises(ValueError):
        StepBudget(target_s=0)
    assert StepBudget(ceiling=8, floor=16).floor == 8  # the floor never exceeds the ceiling


def test_context_shrinks_the_chunk_to_keep_the_step_near_the_target() -> None:
    # Cost model: 1 ms a token at no context, doubled at a context of 1000.
    def cost(n: int, p0: int) -> float:
        return n * 0.001 * (1 + (p0 + (n + 1) / 2) / 1000)

    b = StepBudget(target_s=0.5, ceiling=4096, crossover=1000)
    b.observe(0, 64, cost(64, 0), 32.5)
    assert b.tokens(False, 0) > b.tokens(False, 4000) > 0
    for p0 in (0, 2000, 8000):
        n = b.tokens(False, p0)
        assert cost(n, p0) == pytest.approx(0.5, rel=0.02)
    # Observed at a long context, the base cost is scaled back: the same answer at no context.
    b2 = StepBudget(target_s=0.5, ceiling=4096, crossover=1000)
    b2.observe(0, 64, cost(64, 6000), 6032.5)
    assert b2.tokens(False, 0) == b.tokens(False, 0)


def test_a_short_prompt_is_not_measured_but_a_small_budget_is():
    b = StepBudget(target_s=0.5, ceiling=512, floor=16)
    b.observe(0, 512, 512 * 0.02)  # a cold first step: 20 ms a token
    assert b.tokens(decoding=False) == 25
    b.observe(0, 8, 0.2)  # an 8-token prompt alone: the step's fixed cost, not a token's
    assert b.per_token_s == pytest.approx(0.02)
    chunks = []
    for _ in range(12):  # the budget's own chunks, rounded down to a block (16 of 25 at first)
        n = b.tokens(decoding=False) // 16 * 16
        chunks.append(n)
        b.observe(0, n, n * 0.008)  # 8 ms a token once warm
    assert chunks[0] == 16 and chunks[-1] == 48  # (before: 16 for good)
    assert b.per_token_s == pytest.approx(0.008, rel=0.05)
    assert b.tokens(decoding=False) in (61, 62)
    b2 = StepBudget(target_s=0.5, ceiling=512)
    b2.observe(0, 512, 512 * 0.001)
    assert b2.tokens() == 500
    b2.observe(0, 8, 0.2)  # few tokens against a budget of 500: a short prompt, not measured
    assert b2.per_token_s == pytest.approx(0.001)


def test_prompts_that_all_finish_within_the_target_are_taken_whole():
    """Beside decoding streams the cap (DECODE_SHARE decode steps) holds a long prompt back; a
    burst of prompts that all finish within the target gets them all in one step."""
    b = StepBudget(target_s=0.5, ceiling=4096)
    b.observe(n_decode=8, n_prefill=0, seconds=0.1)
    b.observe(n_decode=8, n_prefill=100, seconds=0.1 + 100 * 0.004)
    assert b.tokens() == 75  # capped: (min(0.5, 4 x 0.1) - 0.1) / 0.004
    assert b.tokens(pending=100) == 100  # (0.5 - 0.1) / 0.004 = 100: every waiting token fits
    assert b.tokens(pending=72) == 100  # the room (the scheduler takes the 72 there are)
    assert b.tokens(pending=101) == 75  # one token more than fits: the cap, as for a long prompt
    assert b.tokens(decoding=False, pending=500) == 125  # nothing decodes: the target, as before
