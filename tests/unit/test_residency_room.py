"""Which instance a load with no room evicts, and when it waits instead (``Residency.make_room``
over ``pantheon.control.room``), on a real app state: ``build_state`` on a real config
(``--models-dir`` of ``tiny`` models, ``--models-max 2``), its real registry, catalog, residency
and loads (``Models``). The worker pool is never started: instances are put in the registry as a
load does (``reserve``, then ``publish``), and a load placed here fails later, at its upload,
for want of a worker (nothing here waits for that)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from pantheon.api.app import build_state
from pantheon.api.state import AppState
from pantheon.config.file import merge_config_file
from pantheon.config.settings import build_config
from pantheon.control.registry import Instance, Registry
from pantheon.control.residency import _Kept
from pantheon.errors import ApiError
from pantheon.workerlink.pool import WorkerPool

NAMES = ("a", "b", "x", "y", "pinned")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from makemodel import make_model

    tiny = make_model("tiny", tmp_path_factory.mktemp("room-tiny"))
    root = tmp_path_factory.mktemp("room-models")
    for name in NAMES:
        shutil.copytree(tiny, root / name)
    return root


@pytest.fixture
def state(root, tmp_path) -> AppState:
    cfg = tmp_path / "pantheon.toml"
    cfg.write_text(
        f'models_dir = ["{root}"]\nmodels_max = 2\ncpu_dies = 1\nqueue_timeout = 2\n'
        f'[[models]]\npath = "{root / "pinned"}"\nname = "pinned"\npin = true\npreload = false\n'
    )
    conf = build_config(merge_config_file({"config": str(cfg)}, {}), {})
    return build_state(conf, WorkerPool(), Registry(queue_timeout_s=conf.queue_timeout_s))


def resident(state: AppState, name: str, *, on_demand: bool = True, used: float = 0.0) -> Instance:
    """An instance of ``name`` as a finished load leaves it: loaded on demand (its idle clock
    says so, as ``Residency`` keeps it), or named at start / loaded by the admin API."""
    inst = state.registry.reserve(name, str(state.residency.catalog.lookup(name).path), ("cpu:0",))
    state.registry.publish(inst)
    if on_demand:
        state.residency._kept[inst.instance_id] = _Kept(on_demand=True, used=used)
    return inst


def names(state: AppState) -> list[str]:
    return [i.name for i in state.registry.instances()]


async def test_the_least_recently_used_idle_on_demand_instance_goes(state):
    resident(state, "a", used=2.0)
    resident(state, "b", used=1.0)
    resident(state, "pinned", used=0.0)  # older, but pinned (and not on demand)
    async with state.models.room.turn("x") as turn:
        assert await state.residency.make_room(turn)
    assert names(state) == ["a", "pinned"]
    (ev,) = [e for e in state.feed.events if e.kind == "evicted"]
    assert ev.instance == "b#2" and "make room for x" in ev.message


async def test_a_busy_one_is_waited_for_then_evicted(state):
    a = resident(state, "a")
    state.registry.acquire("a")  # in flight
    async with state.models.room.turn("x") as turn:
        wait = asyncio.create_task(state.residency.make_room(turn))
        await asyncio.sleep(0.1)
        assert not wait.done() and names(state) == ["a"]
        state.registry.release(a)
        state.residency.keep("a", None)  # the request ended: the head is woken
        assert await asyncio.wait_for(wait, 1)  # "try again"
        assert names(state) == ["a"]
        assert await state.residency.make_room(turn)  # idle now: it goes
    assert names(state) == []


async def test_a_request_on_its_way_to_a_slot_keeps_its_model(state):
    resident(state, "a")
    async with state.models.room.turn("x") as turn:
        with state.residency.wanting("a"):
            wait = asyncio.create_task(state.residency.make_room(turn))
            await asyncio.sleep(0.1)
            assert not wait.done()
        assert await asyncio.wait_for(wait, 1)  # leaving ``wanting`` woke it
        assert await state.residency.make_room(turn)
    assert names(state) == []


async def test_with_nothing_that_will_free_it_says_what_holds_the_room(state):
    resident(state, "a", on_demand=False)  # named at start, or loaded by the admin API
    resident(state, "pinned")
    resident(state, "x")  # the model being loaded: not a victim for itself
    async with state.models.room.turn("x") as turn:
        assert not await state.residency.make_room(turn)
    held = state.residency.holders("x")
    assert held == "a#1 (named at start or loaded by the admin API), pinned#2 (pinned)", held


async def until(cond, timeout: float = 10.0) -> None:
    """Until ``cond()`` (a load reads its model's files in a thread first: some time)."""
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def _load(state: AppState, name: str) -> Instance:
    """A load's phases 1-2 (what this module tests); the upload it starts fails for want of a
    worker, and is left to fail."""
    inst, task = await state.models.start_load(str(state.residency.catalog.lookup(name).path), name)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return inst


async def test_loads_wait_in_order_for_room_and_get_it_as_models_go_idle(state):
    a, b = resident(state, "a", used=1.0), resident(state, "b", used=2.0)
    state.registry.acquire("a")
    state.registry.acquire("b")
    x = asyncio.create_task(_load(state, "x"))
    await until(lambda: state.models.room.waiting() == ["x"])
    y = asyncio.create_task(_load(state, "y"))
    await until(lambda: len(state.models.room) == 2)
    await asyncio.sleep(0.1)
    assert not x.done() and not y.done()
    assert state.models.room.waiting() == ["x", "y"]
    assert state.residency.status("x") == {"value": "unloaded"}  # not an on-demand load here
    state.registry.release(b)
    state.residency.keep("b", None)
    got = await asyncio.wait_for(x, 2)  # the first in line gets the first room: b's
    assert got.name == "x" and not y.done()
    assert "b" not in names(state) and "a" in names(state)
    state.registry.release(a)
    state.residency.keep("a", None)
    got = await asyncio.wait_for(y, 2)  # a went, or x's failed upload gave its room back
    assert got.name == "y"


async def test_a_load_with_nothing_that_will_free_is_a_507_at_once(state):
    resident(state, "a", on_demand=False)
    resident(state, "pinned")
    with pytest.raises(ApiError) as e:
        await asyncio.wait_for(_load(state, "x"), 1)
    assert (e.value.status, e.value.code) == (507, "models_max")
    assert "a#1 (named at start or loaded by the admin API)" in e.value.message


async def test_no_room_freed_in_time_is_a_429_with_retry_after(state):
    resident(state, "a")
    resident(state, "b")
    state.registry.acquire("a")
    state.registry.acquire("b")  # both busy past the queue timeout (2 s)
    with pytest.raises(ApiError) as e:
        await _load(state, "x")
    assert (e.value.status, e.value.code, e.value.headers) == (429, "queue_timeout", {"Retry-After": "2"})
    assert "a#1 (busy: 1 in flight, 0 queued)" in e.value.message
    assert state.models.room.waiting() == []
