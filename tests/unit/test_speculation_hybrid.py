"""Speculation on a hybrid model (Qwen3.5: linear-attention layers with a recurrent state per
slot). A verify runs a sequence's rows one after another in the recurrent layers and keeps the
state after each; the engine keeps the one after the last accepted row (``keep_verified``) and
files the state of a block boundary the accepted rows passed (``save_verified``). A rejected
draft that left its state in the slot would change every later token: these tests make drafts
that are partly accepted and check the output against plain decoding token for token."""

from __future__ import annotations

import pytest

from workers.engine import Engine

from helpers.decode_rows import drain, greedy, seeded_speculation_repeats

SEGMENT = [3, 1, 4, 1, 5, 9, 2, 6]
JUNK = 999
LEAD = 42  # 21 prompt tokens: the first verify's accepted rows end on a 4-token block boundary


@pytest.fixture(scope="module")
def engine(model_factory):
    # An untied head: the random model's next token is not its last one (the tied tiny model
    # repeats its last token, so every draft of a repetition is accepted and none rolled back).
    path = model_factory("tiny-qwen3.5-text", dtype="float32", tie_word_embeddings=False)
    return Engine(str(path), dtype="float32", kv_budget_bytes=8 << 20, block_size=4)


def plain(engine: Engine, prompt: list[int], n: int = 40) -> list[int]:
    engine.submit("plain", prompt, greedy(0, n=n))
    return drain(engine)["plain"]


@pytest.fixture(scope="module")
def partial(engine) -> list[int]:
    """A prompt whose prompt-lookup draft the model partly accepts: ``LEAD S o0 o1 o2 JUNK S``,
    where ``o`` is the model's own continuation of this very prompt (found by iterating; the
    random model's next tokens depend mostly on the last few), so after ``S`` the lookup drafts
    ``o0 o1 o2 JUNK``: the first ones right, then a wrong one."""
    o = [0, 0, 0]
    for _ in range(6):
        prompt = [LEAD] + SEGMENT + o[:3] + [JUNK] + SEGMENT
        out = plain(engine, prompt, n=8)
        if out[:3] == o[:3]:
            assert JUNK not in out[3:4]
            return prompt
        o = out
    pytest.fail("no prompt the model continues with its own lookup draft")


def test_a_partly_accepted_draft_rolls_the_state_back(engine, partial):
    assert engine.spec_supported
    want = plain(engine, partial)
    before = (engine.spec.drafted, engine.spec.accepted)
    engine.submit("s", partial, greedy(4))
    assert drain(engine)["s"] == want
    drafted, accepted = engine.spec.drafted - before[0], engine.spec.accepted - before[1]
    assert 0 < accepted < drafted


def test_batched_verifies_of_different_lengths(engine, partial):
    """Runs of 2, 4 and 5 rows in one step (the shorter finish first), beside a plain decode row."""
    other = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    want = {"a": plain(engine, partial), "b": plain(engine, other), "c": plain(engine, partial[::-1])}
    engine.submit("a", partial, greedy(4))
    engine.submit("b", other, greedy(1))
    engine.submit("c", partial[::-1], greedy(0))
    engine.submit("d", partial, greedy(3))
    out = drain(engine)
    assert {k: out[k] for k in want} == want
    assert out["d"] == want["a"]


def test_a_boundary_passed_in_a_verify_is_checkpointed_right(engine, partial):
    """The state a verify files at a block boundary (4-token blocks; the first verify's accepted
    rows end on one, and the answer ends before the next) is the state there: the next turn,
    restored from it, answers as a cold prefill does."""
    engine.reset_cache()
    engine.submit("s", partial, greedy(4, n=5))
    out = drain(engine)["s"]
    assert engine.spec.verify_steps
    follow = partial + out + [11, 12]
    engine.submit("hit", follow, greedy(0, n=10))
    cached, hit = None, []
    while engine.has_work():
        for o in engine.step():
            cached = o.cached_tokens if cached is None else cached
            hit.append(o.token)
    assert cached is not None and cached > len(partial) // 4 * 4  # past the prompt's own checkpoint
    engine.reset_cache()
    engine.submit("cold", follow, greedy(0, n=10))
    assert drain(engine)["cold"] == hit


def test_stop_ids_cut_the_accepted_tokens(engine, partial):
    want = plain(engine, partial)
    for j in (1, 2, 5):
        stop = want[j]
        engine.submit("s", partial, greedy(4, n=40, stop_token_ids=[stop]))
        assert drain(engine)["s"] == want[: want.index(stop) + 1]


def test_seeded_sampling_with_speculation_repeats_itself(engine, partial):
    seeded_speculation_repeats(engine, partial, SEGMENT, 4)
