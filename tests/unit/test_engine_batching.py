"""Continuous batching: what one request gets never depends on what shares its batch.

Run on a Llama-family model (paged KV in every layer), on a Qwen3.5 hybrid (three of four
layers keep a recurrent state per slot), on Gemma 3 (five of six layers read a 16-token window,
which the 30- and 60-token prompts pass) and on a mixture of experts (tokens grouped by expert
across the batch): joins, leaves, chunked prefill, preemption and aborts
must leave every neighbour's tokens exactly as they are alone."""

from __future__ import annotations

import math

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.cache import kv_block_bytes
from workers.engine import Engine, RequestRejected
from workers.model_config import load_config

PROMPTS = [
    [5, 17, 300, 41],
    [900, 2, 2, 2, 2, 8, 31, 77, 12, 1000, 44],
    [64],
    [1200, 13, 7],
    list(range(100, 160)),
    [3, 1, 4, 1, 5, 9, 2, 6],
    [800, 700, 600, 500, 400],
    list(range(1500, 1530)),
]


def greedy(n=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def drain(eng: Engine, on_step=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    step = 0
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token)
        step += 1
        if on_step:
            on_step(step)
    return out


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3.5-text", "tiny-gemma3", "tiny-qwen3-moe"])
def path(model_factory, request):
    return str(model_factory(request.param, dtype="float32"))


@pytest.fixture(scope="module")
def engine(path):
    return Engine(path, dtype="float32", kv_budget_bytes=8 << 20)


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt decoded by itself."""
    res = {}
    for i, p in enumerate(PROMPTS):
        engine.submit(f"p{i}", p, greedy())
        res[f"p{i}"] = drain(engine)[f"p{i}"]
    return res


def test_eight_prompts_together_equal_alone(engine, alone):
    for i, p in enumerate(PROMPTS):
        engine.submit(f"p{i}", p, greedy())
    assert drain(engine) == alone
    assert all(len(v) == 12 for v in alone.values())
    assert len({tuple(v) for v in alone.values()}) > 1  # the prompts really differ


def test_chunked_prefill_equals_unchunked(path, alone):
    eng = Engine(path, dtype="float32", prefill_chunk=5, block_size=4, kv_budget_bytes=8 << 20)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy())
    assert drain(eng) == alone


def test_join_and_leave_mid_decode(engine, alone):
    """Requests join at different steps and one is aborted; nobody else's tokens change."""
    engine.submit("p0", PROMPTS[0], greedy())
    engine.submit("victim", PROMPTS[4], greedy(50))

    def on_step(step):
        if step == 3:
            engine.submit("p1", PROMPTS[1], greedy())
        if step == 5:
            engine.abort("victim")
            engine.submit("p2", PROMPTS[2], greedy())
        if step == 7:
            engine.submit("p5", PROMPTS[5], greedy())

    out = drain(engine, on_step)
    for k in ("p0", "p1", "p2", "p5"):
        assert out[k] == alone[k], k
    assert len(out["victim"]) < 50


def test_seeded_sampling_is_batch_independent(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    engine.submit("s", PROMPTS[3], params)
    solo = drain(engine)["s"]
    engine.submit("s", PROMPTS[3], params)
    for i, p in enumerate(PROMPTS[:7]):
        engine.submit(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert drain(engine)["s"] == solo
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    engine.submit("s2", PROMPTS[3], other)
    assert drain(engine)["s2"] != solo  # another seed, other tokens


def test_more_requests_than_slots_wait_fifo(path, alone):
    eng = Engine(path, dtype="float32", num_slots=3, kv_budget_bytes=8 << 20)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy())
    first = eng.step()  # slots are taken when a step is planned
    assert eng.stats("x").waiting == 5
    out = drain(eng)
    for o in first:
        out[o.request_id].insert(0, o.token)
    assert out == alone


def test_pool_exhaustion_preempts_without_corruption(path, alone):
    """A pool too small for all eight: preempted requests resume, and every output is exact."""
    block = kv_block_bytes(load_config(path), 4, torch.float32)
    eng = Engine(path, dtype="float32", block_size=4, kv_budget_bytes=block * 40)
    preempted = []
    orig = eng.scheduler.schedule

    def spy(*args):
        plan = orig(*args)
        preempted.extend(s.request_id for s in plan.preempted)
        return plan

    eng.scheduler.schedule = spy
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy())
    assert drain(eng) == alone
    assert preempted, "the pool was meant to run dry"
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_prompt_larger_than_pool_is_rejected(path):
    block = kv_block_bytes(load_config(path), 16, torch.float32)
    eng = Engine(path, dtype="float32", kv_budget_bytes=block * 2)
    with pytest.raises(RequestRejected) as e:
        eng.submit("big", list(range(40)), greedy())
    assert e.value.kind == "context_length"
    eng.submit("ok", list(range(10)), greedy(100))
    out = []
    while eng.has_work():
        out += eng.step()
    assert out[-1].finish == "length" and len(out) <= 32  # stopped at the pool's size


def test_bad_requests_are_rejected_and_change_nothing(engine):
    for prompt, params in [
        ([], greedy()),
        ([10**9], greedy()),
        ([1, 2], SamplingParams(max_tokens=0)),
    ]:
        with pytest.raises(RequestRejected):
            engine.submit("bad", prompt, params)
    engine.submit("dup", [1, 2, 3], greedy(3))
    with pytest.raises(RequestRejected):
        engine.submit("dup", [1, 2, 3], greedy(3))
    assert len(drain(engine)["dup"]) == 3
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_frees_the_slot_at_once(engine):
    engine.submit("a", PROMPTS[4], greedy(100))
    engine.step()
    engine.step()
    assert engine.stats("x").slots[0].state == "decode"
    engine.abort("a")
    st = engine.stats("x")
    assert all(s.state == "idle" for s in st.slots) and st.kv_blocks_used == 0
    assert not engine.has_work()


def test_stop_ids_min_tokens_and_finish(engine, alone):
    first = alone["p0"][2]  # the third greedy token of p0
    engine.submit("st", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first]))
    out = []
    while engine.has_work():
        out += engine.step()
    assert [o.token for o in out] == alone["p0"][: alone["p0"].index(first) + 1]
    assert out[-1].finish == "stop"
    engine.submit("ln", PROMPTS[0], greedy(4))
    out = []
    while engine.has_work():
        out += engine.step()
    assert [o.finish for o in out] == [None, None, None, "length"]


def test_logprobs(engine, alone):
    rows = []
    engine.on_logits = lambda seqs, logits: rows.append(logits[0].clone())
    try:
        engine.submit("lp", PROMPTS[0], greedy(3, logprobs=True, top_logprobs=5))
        outs = []
        while engine.has_work():
            outs += engine.step()
    finally:
        engine.on_logits = None
    for o, row in zip(outs, rows):
        lsm = torch.log_softmax(row, -1)
        assert math.isclose(o.logprob, float(lsm[o.token]), abs_tol=1e-5)
        assert len(o.top) == 5 and o.top[0][0] == o.token  # greedy picks the top one
        assert [lp for _, lp in o.top] == sorted((lp for _, lp in o.top), reverse=True)


def test_sampling_controls(engine, alone):
    # top_k=1 is greedy whatever the temperature.
    engine.submit("k1", PROMPTS[1], SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))
    assert drain(engine)["k1"] == alone["p1"]
    # A huge repetition penalty never repeats a token from the window.
    engine.submit("rp", PROMPTS[2], greedy(12, repetition_penalty=1e6, repetition_window=64))
    toks = drain(engine)["rp"]
    assert len(set(toks + PROMPTS[2])) == len(toks) + len(PROMPTS[2])
    # A large presence penalty also forbids repeats among the generated tokens.
    engine.submit("pp", PROMPTS[2], greedy(12, presence_penalty=100.0))
    toks = drain(engine)["pp"]
    assert len(set(toks)) == len(toks)
    # min_p=1 keeps only the most likely token: greedy again.
    engine.submit(
        "mp", PROMPTS[1], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True)
    )
    assert drain(engine)["mp"] == alone["p1"]
