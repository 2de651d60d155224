"""The engine's bookkeeping, exactly, without torch: blocks, slots, queue order, step plans."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.block_manager import BlockManager
from workers.scheduler import Scheduler, Sequence


def seq(rid: str, n_prompt: int, max_tokens: int = 8, stop=()) -> Sequence:
    return Sequence(rid, n_prompt, list(range(1, n_prompt + 1)), max_tokens, frozenset(stop))


def run_step(s: Scheduler, token: int = 500):
    """Schedule, pretend the model ran, and give every sampled sequence ``token``."""
    plan = s.schedule()
    sampled = plan.sampled()
    s.commit(plan)
    reasons = {q.request_id: s.append_token(q, token) for q in sampled}
    return plan, reasons


def test_no_torch_in_bookkeeping():
    code = "import sys, workers.scheduler, workers.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_manager_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    assert bm.ensure(table, 9) and table == [0, 1, 2] and bm.num_free == 1
    other: list[int] = []
    assert not bm.ensure(other, 8)  # needs 2, only 1 free
    assert other == [] and bm.num_free == 1
    assert bm.row(table, 5) == 1 * 4 + 1
    bm.free(table)
    assert table == [] and bm.num_free == 4


def test_waiting_is_fifo_beyond_the_slots():
    s = Scheduler(BlockManager(64, 4), num_slots=2, prefill_chunk=100)
    for i in range(4):
        s.add(seq(f"r{i}", 3))
    plan = s.schedule()
    assert [q.request_id for q, _ in plan.prefill] == ["r0", "r1"]
    assert [q.request_id for q in s.waiting] == ["r2", "r3"]
    s.abort("r0")
    plan = s.schedule()
    assert s.slots[0].request_id == "r2"  # the freed slot goes to the oldest waiter


def test_prefill_budget_is_one_chunk_and_decoders_always_run():
    s = Scheduler(BlockManager(256, 4), num_slots=4, prefill_chunk=10)
    s.add(seq("a", 3))
    run_step(s)  # a prefilled and got its first token
    s.add(seq("b", 25))
    s.add(seq("c", 4))
    plan, _ = run_step(s)
    assert [q.request_id for q in plan.decode] == ["a"]
    assert [(q.request_id, n) for q, n in plan.prefill] == [("b", 10)]
    plan, _ = run_step(s)
    assert [(q.request_id, n) for q, n in plan.prefill] == [("b", 10)]
    plan, _ = run_step(s)
    # b's last 5 tokens, then c gets the rest of the budget in the same step.
    assert [(q.request_id, n) for q, n in plan.prefill] == [("b", 5), ("c", 4)]
    assert {q.request_id for q in plan.sampled()} == {"a", "b", "c"}


def test_finish_reasons():
    s = Scheduler(BlockManager(64, 4), num_slots=2, prefill_chunk=100, max_model_len=100)
    a = seq("a", 3, max_tokens=2)
    b = seq("b", 3, max_tokens=10, stop={7})
    s.add(a)
    s.add(b)
    _, r = run_step(s, token=5)
    assert r == {"a": None, "b": None}
    plan = s.schedule()
    s.commit(plan)
    assert s.append_token(a, 5) == "length"
    assert s.append_token(b, 7) == "stop"
    assert not s.has_work() and s.blocks.num_free == 64


def test_min_tokens_holds_back_stop():
    s = Scheduler(BlockManager(64, 4), num_slots=1, prefill_chunk=100)
    a = seq("a", 3, max_tokens=10, stop={7})
    a.min_tokens = 2
    s.add(a)
    _, r = run_step(s, token=7)
    assert r["a"] is None  # one output token, min_tokens=2
    _, r = run_step(s, token=7)
    assert r["a"] == "stop"


def test_model_length_limit():
    s = Scheduler(BlockManager(64, 4), num_slots=1, prefill_chunk=100, max_model_len=6)
    s.add(seq("a", 4, max_tokens=100))
    _, r = run_step(s)
    assert r["a"] is None
    _, r = run_step(s)
    assert r["a"] == "length"


def test_pool_exhaustion_preempts_the_newest():
    # 6 blocks of 2 tokens. a and b each take 2 blocks for their 3-token prompt.
    s = Scheduler(BlockManager(6, 2), num_slots=2, prefill_chunk=100)
    a, b = seq("a", 3, max_tokens=20), seq("b", 3, max_tokens=20)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled; 4 blocks used, each holds 4 tokens of room
    run_step(s)  # positions 3: fits in the existing blocks
    plan, _ = run_step(s)  # position 4 needs a third block each: a gets it, b too (6 used)
    assert s.blocks.num_free == 0 and not plan.preempted
    run_step(s)
    plan, _ = run_step(s)  # position 6: a needs a 4th block; b (newer) is preempted
    assert [q.request_id for q in plan.preempted] == ["b"]
    assert [q.request_id for q in plan.decode] == ["a"]
    assert b.slot is None and b.num_computed == 0 and b.block_table == []
    assert s.waiting[0] is b and b.tokens[3:] == [500] * 4  # its output is kept for recompute


def test_lone_sequence_that_outgrows_the_pool_ends_with_length():
    s = Scheduler(BlockManager(2, 2), num_slots=1, prefill_chunk=100)
    s.add(seq("a", 3, max_tokens=50))
    run_step(s)  # 4 positions of room
    plan, _ = run_step(s)  # position 3 fits
    plan = s.schedule()  # position 4 would need a third block
    assert [q.request_id for q in plan.truncated] == ["a"] and plan.empty
    assert s.get("a") is None and s.blocks.num_free == 2


@pytest.mark.parametrize("where", ["waiting", "prefill", "decode"])
def test_abort_frees_everything(where):
    s = Scheduler(BlockManager(16, 4), num_slots=1, prefill_chunk=2)
    s.add(seq("x", 6))
    s.add(seq("w", 2))
    if where != "waiting":
        run_step(s)  # x prefilled 2 of 6
    if where == "decode":
        run_step(s)
        run_step(s)
    rid = "w" if where == "waiting" else "x"
    assert s.abort(rid)
    assert s.get(rid) is None
    if where != "waiting":
        assert s.blocks.num_free == 16 and s.slots[0] is None
    assert not s.abort(rid)


def test_prefix_blocks_are_shared_then_kept_lru_then_evicted():
    from workers.block_manager import block_hash

    bm = BlockManager(num_blocks=4, block_size=2)
    h0 = block_hash(None, [1, 2], None)
    h1 = block_hash(h0, [3, 4], None)
    assert block_hash(None, [1, 2], "salt") != h0
    a: list[int] = []
    bm.ensure(a, 5)  # 3 blocks
    bm.register(a[0], h0)
    bm.register(a[1], h1)
    b = bm.match([h0, h1, b"nope"])
    assert b == a[:2] and bm.num_used == 3  # shared, not copied
    bm.free(a)
    assert bm.num_cached == 0 and bm.num_used == 2  # b still holds the shared two
    bm.free(b)
    assert bm.num_cached == 2 and bm.num_free == 4
    # Plain free blocks go first (3, then 2), then the least recently used cached one: b freed
    # its tail first, so block 1 (h1) is older in the LRU than block 0 (h0), the shared head.
    c: list[int] = []
    assert bm.ensure(c, 6)
    assert c == [3, 2, 1] and bm.num_cached == 1
    assert bm.match([h0, h1]) == [0]


def test_the_budget_is_asked_at_the_context_a_joiner_starts_from():
    """A budget that depends on the context (the engine's: a token attends to every position
    before it) is asked once the step's joiner has its slot and its cached prefix: a joiner that
    finds 8 positions cached starts 8 deep, not at 0 (8k deep on SmolLM2, where planning at 0
    made a 1.4 s step of a 0.5 s target)."""
    s = Scheduler(BlockManager(32, 4), num_slots=2, prefill_chunk=100)
    a = seq("a", 10, max_tokens=3)
    s.add(a)
    asked: list[int] = []
    pending: list[int] = []

    def budget(context: int, waiting: int) -> int:
        asked.append(context)
        pending.append(waiting)
        return 100

    while not a.finish:
        plan = s.schedule(budget)
        s.commit(plan)
        for q in plan.sampled():
            s.append_token(q, 500)
    assert asked[0] == 0 and pending[0] == 10  # a fresh prompt, all of it to prefill
    s.add(Sequence("b", 10, list(range(1, 11)), 3))  # its first 8 positions are cached
    asked.clear()
    pending.clear()
    plan = s.schedule(budget)
    assert asked == [8] and [(q.request_id, n) for q, n in plan.prefill] == [("b", 2)]
    assert pending == [2]  # the tokens the prefilling sequences still have (b's uncached two)


def test_scheduler_reuses_prefix_and_publishes_full_blocks():
    s = Scheduler(BlockManager(32, 4), num_slots=2, prefill_chunk=100)
    a = seq("a", 10, max_tokens=3)
    s.add(a)
    for _ in range(3):
        run_step(s)
    assert a.finish == "length" and s.blocks.num_cached == 3  # 12 computed tokens: 3 full blocks
    b = Sequence("b", 10, list(range(1, 11)), 3)
    s.add(b)
    plan = s.schedule()
    assert b.cached_tokens == 8 and b.num_computed == 8  # two full prompt blocks; 2 tokens to go
    assert [(q.request_id, n) for q, n in plan.prefill] == [("b", 2)]
