"""The room queue (``pantheon.control.room``): which instance a load evicts, whether waiting can
help, and the line of loads: first come first served, bounded by its depth and its timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from pantheon.control.room import Holder, RoomQueue, victim, will_free
from pantheon.errors import ApiError


def h(
    iid: str, *, evictable: bool = True, idle: bool = True, used: float = 0.0, leaving: bool = False
) -> Holder:
    return Holder(iid, iid.split("#")[0], evictable, idle, used, leaving)


# ------------------------------------------------------------------ which instance goes


def test_the_victim_is_the_least_recently_used_idle_evictable_one_of_another_model():
    holders = [
        h("a#1", used=5.0),
        h("b#2", used=2.0),
        h("c#3", used=1.0, idle=False),  # busy: not now
        h("d#4", used=0.5, evictable=False),  # pinned, named at start or loaded by the admin API
        h("e#5", used=0.1, leaving=True),  # already being unloaded
        h("x#6", used=0.0),  # the model being loaded
    ]
    assert victim("x", holders) == holders[1]
    assert victim("b", holders) == holders[5]  # x is just another model to a load of b
    assert victim("b", holders[:5]) == holders[0]
    assert victim("x", [holders[2], holders[3], holders[4], holders[5]]) is None
    assert victim("x", []) is None


def test_equals_go_in_table_order():
    holders = [h("a#1", used=1.0), h("b#2", used=1.0)]
    assert victim("x", holders) == holders[0]


def test_waiting_helps_only_while_another_models_instance_is_evictable_or_leaving():
    assert will_free("x", [h("a#1", idle=False)])  # busy now, idle later
    assert will_free("x", [h("a#1", evictable=False), h("b#2", evictable=False, leaving=True)])
    assert not will_free("x", [h("a#1", evictable=False), h("x#2")])  # only its own model's
    assert not will_free("x", [])


# ------------------------------------------------------------------ the line


async def _enter(q: RoomQueue, name: str, order: list[str], hold: asyncio.Event) -> None:
    async with q.turn(name):
        order.append(name)
        await hold.wait()


async def test_loads_place_in_the_order_they_came():
    q = RoomQueue(depth=8, timeout_s=5)
    order: list[str] = []
    holds = {n: asyncio.Event() for n in "abcd"}
    tasks = []
    for n in "abcd":
        tasks.append(asyncio.create_task(_enter(q, n, order, holds[n])))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert order == ["a"] and q.waiting() == ["a", "b", "c", "d"]
    holds["c"].set()  # a later one done early changes nothing: it has not had its turn
    await asyncio.sleep(0.01)
    assert order == ["a"]
    holds["a"].set()
    await asyncio.sleep(0.01)
    assert order == ["a", "b"] and q.waiting() == ["b", "c", "d"]
    holds["b"].set()  # c's turn comes, and it is done at once: d's
    await asyncio.sleep(0.01)
    assert order == ["a", "b", "c", "d"] and q.waiting() == ["d"]
    holds["d"].set()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c", "d"] and len(q) == 0


async def test_a_load_that_fits_passes_at_once_when_nobody_waits():
    q = RoomQueue(depth=0, timeout_s=5)
    for _ in range(3):
        async with q.turn("a") as t:
            assert t.name == "a" and q.waiting() == ["a"]
    assert len(q) == 0


async def test_past_the_depth_a_load_gets_429_queue_full_and_the_line_is_unchanged():
    q = RoomQueue(depth=1, timeout_s=5)
    hold = asyncio.Event()
    order: list[str] = []
    t1 = asyncio.create_task(_enter(q, "a", order, hold))
    t2 = asyncio.create_task(_enter(q, "b", order, hold))
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as e:
        async with q.turn("c"):
            pass
    assert (e.value.status, e.value.code, e.value.headers) == (429, "queue_full", {"Retry-After": "5"})
    assert "'c'" in e.value.message
    assert q.waiting() == ["a", "b"]
    hold.set()
    await asyncio.gather(t1, t2)
    assert order == ["a", "b"]


async def test_a_load_behind_a_head_that_stays_times_out_with_429_naming_the_holders():
    q = RoomQueue(depth=4, timeout_s=0.2, holders=lambda name: f"a#1 (busy, for {name})")
    hold = asyncio.Event()
    t1 = asyncio.create_task(_enter(q, "a", [], hold))
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        async with q.turn("b"):
            pass
    took = time.monotonic() - t0
    assert 0.15 < took < 2.0
    assert (e.value.status, e.value.code, e.value.headers) == (429, "queue_timeout", {"Retry-After": "2"})
    assert "a#1 (busy, for b)" in e.value.message and "0.2 s" in e.value.message
    assert q.waiting() == ["a"]  # it left the line
    hold.set()
    await t1


async def test_the_head_waits_for_a_change_and_its_deadline_counts_from_joining():
    q = RoomQueue(depth=4, timeout_s=0.3)
    woke: list[float] = []

    async def head() -> None:
        async with q.turn("x") as t:
            t0 = time.monotonic()
            await q.wait_change(t)
            woke.append(time.monotonic() - t0)
            await q.wait_change(t)  # nothing changes again: the deadline

    task = asyncio.create_task(head())
    await asyncio.sleep(0.05)
    q.poke()
    with pytest.raises(ApiError) as e:
        await task
    assert e.value.code == "queue_timeout"
    assert woke and woke[0] < 0.2  # the poke, not the deadline
    assert len(q) == 0


async def test_a_poke_wakes_the_head_only():
    q = RoomQueue(depth=4, timeout_s=5)
    order: list[str] = []
    changed = asyncio.Event()

    async def head() -> None:
        async with q.turn("x") as t:
            await q.wait_change(t)
            changed.set()
            order.append("x")

    hold = asyncio.Event()
    t1 = asyncio.create_task(head())
    await asyncio.sleep(0)
    t2 = asyncio.create_task(_enter(q, "y", order, hold))
    await asyncio.sleep(0.01)
    q.poke()
    await asyncio.wait_for(changed.wait(), 1)
    await asyncio.sleep(0.01)
    assert order == ["x", "y"]  # y's turn came when x left, not at the poke
    hold.set()
    await asyncio.gather(t1, t2)


async def test_a_load_that_goes_away_leaves_the_line_and_the_order_holds():
    q = RoomQueue(depth=8, timeout_s=5)
    order: list[str] = []
    holds = {n: asyncio.Event() for n in "abc"}
    tasks = {n: asyncio.create_task(_enter(q, n, order, holds[n])) for n in "abc"}
    await asyncio.sleep(0.01)
    tasks["b"].cancel()  # waiting: it leaves
    await asyncio.sleep(0.01)
    assert q.waiting() == ["a", "c"]
    tasks["a"].cancel()  # the head: the next one's turn
    await asyncio.sleep(0.01)
    assert order == ["a", "c"] and q.waiting() == ["c"]
    holds["c"].set()
    await tasks["c"]
    assert len(q) == 0
