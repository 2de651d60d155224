"""Unit tests of the registry, the die manager, sizing, pressure, context admission and the feed:
no processes (the sizing test builds real engines in-process to check the estimate).
"""

from __future__ import annotations

import asyncio

import pytest

from pantheon.api.openai.protocol import parse_chat_request
from pantheon.control.registry import MAX_INSTANCES, Registry
from pantheon.errors import ApiError

# ---------------------------------------------------------------- routing (moved from test_openai_api)


def _registry(*names, slots=8, queue_depth=32, timeout=30.0):
    reg = Registry(slots=slots, queue_depth=queue_depth, queue_timeout_s=timeout)
    out = []
    for n in names:
        inst = reg.reserve(n, f"/models/{n}", ("cpu:0",))
        reg.publish(inst, max_model_len=128)
        out.append(inst)
    return reg, out


def _status(fn, *a):
    with pytest.raises(ApiError) as ei:
        fn(*a)
    return ei.value.status, ei.value.code


def test_routing_single_model_takes_everything():
    reg, (a,) = _registry("a")
    assert reg.route("gpt-4o") is a and reg.route(None) is a and reg.route("a") is a


def test_the_shortcut_is_for_one_model_only():
    """Issue 40 §6: with another model loading, failed or in the catalog, an unknown name is a
    404, not the ready model's answer; a name with a control character is never shortcut."""
    reg, (a,) = _registry("a")
    loading = reg.reserve("b", "/models/b", ("cpu:0",))
    assert _status(reg.route, "gpt-4o") == (404, "model_not_found")
    assert reg.route(None) is a  # no name: the first resident model, as before
    reg.discard(loading)
    assert reg.route("gpt-4o") is a
    reg.catalog_names = lambda: ["a", "c"]  # another model the catalog can load
    assert _status(reg.route, "gpt-4o") == (404, "model_not_found")
    reg.catalog_names = lambda: ["a"]
    assert reg.route("gpt-4o") is a
    assert _status(reg.route, "a\nb") == (404, "model_not_found")
    assert _status(reg.route, "a\x00") == (404, "model_not_found")


def test_routing_many_models():
    reg, (a, b) = _registry("a", "b")
    assert reg.route("b") is b and reg.route("a") is a and reg.route(None) is a
    assert _status(reg.route, "c") == (404, "model_not_found")
    loading = reg.reserve("c", "/models/c", ("cpu:0",))
    assert _status(reg.route, "c")[0] == 503
    reg.discard(loading)
    assert _status(reg.route, "c")[0] == 404


def test_routing_none_loaded():
    reg = Registry()
    assert _status(reg.route, "a")[0] == 503
    reg.reserve("a", "/m", ("cpu:0",))
    assert _status(reg.route, "a")[0] == 503  # loading only
    assert not reg.has_ready


def test_replicas_least_busy_and_dedupe():
    reg, (a1, a2, b) = _registry("a", "a", "b")
    assert reg.names() == ["a", "b"]
    x = reg.acquire("a")
    y = reg.acquire("a")
    assert {x, y} == {a1, a2}
    reg.release(x)
    assert reg.acquire("a") is x


async def test_session_affinity_across_replicas():
    reg, (a1, a2) = _registry("a", "a", slots=3)
    first = await reg.acquire_slot("a", "s1")
    x = await reg.acquire_slot("a")
    y = await reg.acquire_slot("a")
    assert (first, x, y) == (a1, a2, a1)  # least busy, ties to the earliest
    again = await reg.acquire_slot("a", "s1")
    assert again is a1  # sticky, although a2 is less busy (1 against 2)
    moved = await reg.acquire_slot("a", "s1")  # a1 is full (3 slots): the session moves on
    assert moved is a2
    assert reg.route("a", "s1") is a2  # ... and sticks to its new replica
    for i in (first, x, y, again, moved):
        reg.leave(i)
    assert a1.refs == a2.refs == 0


async def test_single_user_gate_429_while_other_model_serves():
    reg, (a, b) = _registry("a", "b", slots=1)
    first = await reg.acquire_slot("a")
    with pytest.raises(ApiError) as ei:
        await reg.acquire_slot("a")
    assert ei.value.status == 429 and ei.value.code == "server_busy"
    other = await reg.acquire_slot("b")  # a different model still serves
    reg.leave(first)
    again = await reg.acquire_slot("a")
    assert again is a
    reg.leave(again)
    reg.leave(other)
    assert a.refs == 0 and b.refs == 0 and a.gate.active == 0


async def test_drain_waits_for_in_flight():
    reg, (a,) = _registry("a")
    inst = reg.acquire("a")
    task = asyncio.create_task(reg.drain(inst, 5))
    await asyncio.sleep(0.01)
    assert not task.done() and inst.state == "draining"
    assert _status(reg.route, "a")[0] == 503
    reg.release(inst)
    assert await asyncio.wait_for(task, 1) is True


# ---------------------------------------------------------------- the per-model queue and gate


async def _acquire_task(reg, name, session=None):
    t = asyncio.create_task(reg.acquire_slot(name, session))
    await asyncio.sleep(0.01)
    return t


async def test_queue_full_429_retry_after_5_then_timeout_retry_after_2():
    reg, (a,) = _registry("a", slots=1 + 1, queue_depth=1, timeout=0.2)
    held = [await reg.acquire_slot("a"), await reg.acquire_slot("a")]
    waiter = await _acquire_task(reg, "a")
    assert len(reg.queue("a")) == 1
    with pytest.raises(ApiError) as ei:
        await reg.acquire_slot("a")  # the queue (depth 1) is full
    assert (ei.value.status, ei.value.headers["Retry-After"]) == (429, "5")
    with pytest.raises(ApiError) as ei:
        await waiter  # nobody left within 0.2 s
    assert (ei.value.status, ei.value.code, ei.value.headers["Retry-After"]) == (429, "queue_timeout", "2")
    assert len(reg.queue("a")) == 0
    for i in held:
        reg.leave(i)
    assert a.refs == 0 and a.gate.active == 0


async def test_queue_is_fifo_and_a_freed_slot_of_any_replica_serves_its_head():
    reg, (a1, a2) = _registry("a", "a", slots=1 + 1, queue_depth=8)
    held = [await reg.acquire_slot("a") for _ in range(4)]  # both replicas full
    assert sorted(i.instance_id for i in held) == sorted([a1.instance_id] * 2 + [a2.instance_id] * 2)
    w1, w2 = await _acquire_task(reg, "a"), await _acquire_task(reg, "a")
    reg.leave(held[-1])  # a slot frees on one replica: the first waiter gets it
    got1 = await asyncio.wait_for(w1, 1)
    assert got1 is held[-1] and not w2.done()
    reg.leave(held[0])
    assert await asyncio.wait_for(w2, 1) is held[0]
    # a new arrival does not overtake a waiter: the fast path needs an empty queue
    w3 = await _acquire_task(reg, "a")
    assert not w3.done()
    reg.leave(got1)
    assert await asyncio.wait_for(w3, 1) is got1


async def test_client_that_goes_away_leaves_the_queue():
    reg, (a,) = _registry("a", slots=2, queue_depth=4)
    held = [await reg.acquire_slot("a"), await reg.acquire_slot("a")]
    w = await _acquire_task(reg, "a")
    assert len(reg.queue("a")) == 1
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    assert len(reg.queue("a")) == 0
    for i in held:
        reg.leave(i)
    assert a.refs == 0 and a.gate.active == 0


async def test_critical_pressure_holds_the_fast_path_then_503_when_full():
    level = {"v": 3}
    reg, (a,) = _registry("a", slots=4, queue_depth=1)
    reg.pressure = lambda dies: level["v"]
    w = await _acquire_task(reg, "a")
    assert not w.done()  # a free slot, but CRITICAL: it waits
    with pytest.raises(ApiError) as ei:
        await reg.acquire_slot("a")
    assert (ei.value.status, ei.value.code) == (503, "memory_pressure")
    reg.poke()
    assert not w.done()
    level["v"] = 2
    reg.poke()  # the server's ticker does this a few times a second
    inst = await asyncio.wait_for(w, 1)
    assert inst is a
    reg.leave(inst)


async def test_shutdown_fails_waiters_and_new_requests_with_503():
    reg, (a,) = _registry("a", slots=2, queue_depth=4)
    held = [await reg.acquire_slot("a"), await reg.acquire_slot("a")]
    w = await _acquire_task(reg, "a")
    reg.shut_down()
    with pytest.raises(ApiError) as ei:
        await w
    assert (ei.value.status, ei.value.code) == (503, "shutting_down")
    with pytest.raises(ApiError) as ei:
        await reg.acquire_slot("a")
    assert ei.value.status == 503
    for i in held:
        reg.leave(i)


async def test_unloading_the_last_replica_fails_its_queue_others_move_on():
    reg, (a1, a2) = _registry("a", "a", slots=2, queue_depth=4)
    held = [await reg.acquire_slot("a") for _ in range(4)]
    w = await _acquire_task(reg, "a")
    drain = asyncio.create_task(reg.drain(a1, 5))
    await asyncio.sleep(0.01)
    assert not w.done()  # a2 still serves the name: it keeps waiting
    for i in [h for h in held if h is a2][:1]:
        reg.leave(i)
    assert await asyncio.wait_for(w, 1) is a2
    reg.discard(a2)  # a2 gone too (its holders let go later): a new waiter fails
    w2 = await _acquire_task(reg, "a")
    with pytest.raises(ApiError):
        await w2
    for i in held:
        if i is a1:
            reg.leave(i)
    assert await asyncio.wait_for(drain, 1) is True


async def test_sessions_stick_unless_saturated_and_sequential_traffic_alternates():
    reg, (a1, a2) = _registry("a", "a", slots=2)
    seen = []
    for _ in range(4):  # one at a time: least busy ties, fewest served wins
        i = await reg.acquire_slot("a")
        seen.append(i)
        reg.leave(i)
    assert seen == [a1, a2, a1, a2]
    s = await reg.acquire_slot("a", "sess")
    reg.leave(s)
    for _ in range(3):
        i = await reg.acquire_slot("a", "sess")
        assert i is s  # although the other replica has served fewer
        reg.leave(i)
    other = a2 if s is a1 else a1
    held = [await reg.acquire_slot("a", "sess"), await reg.acquire_slot("a", "sess")]
    assert held == [s, s]
    moved = await reg.acquire_slot("a", "sess")  # its replica is saturated: the session moves
    assert moved is other
    for i in held + [moved]:
        reg.leave(i)


def test_table_holds_16_instances():
    reg = Registry()
    for n in range(MAX_INSTANCES):
        reg.reserve(f"m{n}", "/m")
    with pytest.raises(ApiError) as ei:
        reg.reserve("one-too-many", "/m")
    assert (ei.value.status, ei.value.code) == (507, "table_full")


# ---------------------------------------------------------------- dies


def _dm(**kw):
    from pantheon.control.dies import DieManager

    kw.setdefault("cuda_count", 0)
    return DieManager(**kw)


def test_die_budgets_reserve_and_bookings():
    dm = _dm(cpu_dies=2, cpu_budget=100 << 20, reserve=10 << 20)
    d0 = dm.get("cpu:0")
    assert (d0.total_bytes, d0.budget_bytes, dm.free(d0)) == (100 << 20, 90 << 20, 90 << 20)
    dm.book("x#1", {"cpu:0": (30 << 20, 10 << 20)})
    assert (d0.weights_bytes, d0.kv_bytes, dm.free(d0)) == (30 << 20, 10 << 20, 50 << 20)
    dm.book("x#1", {"cpu:0": (20 << 20, 10 << 20)})  # the real figures replace the estimate
    assert dm.free(d0) == 60 << 20
    dm.release("x#1")
    assert dm.free(d0) == 90 << 20 and d0.bookings == {}
    cuda = _dm(cuda_count=2)
    assert cuda.check("1") == "cuda:1"
    cuda.on_worker("cuda:1", 80 << 30, 70 << 30, "H200")
    c1 = cuda.get("cuda:1")
    assert c1.budget_bytes == 79 << 30  # 1 GiB reserve on CUDA by default
    assert cuda.free(c1) == 69 << 30  # no more than the device really has free, minus reserve
    for bad in ("cuda:2", "cpu:0", "gpu"):
        with pytest.raises(ApiError) as ei:
            cuda.check(bad)
        assert ei.value.status == 400


def test_placement_auto_most_free_explicit_split_and_507_naming_the_die():
    from pantheon.core.sizing import Estimate

    est = Estimate(
        base=4 << 20,
        layer_bytes=(2 << 20,) * 4,
        kv_layer_bytes=(256,) * 4,
        state_layer_bytes=(0,) * 4,
        context_limit=4096,
    )
    dm = _dm(cpu_dies=3, cpu_budget=64 << 20)
    dm.book("busy#1", {"cpu:0": (48 << 20, 0)})
    dm.book("busy#2", {"cpu:2": (10 << 20, 0)})

    def need(ds):
        return est.split(ds, kv=8 << 20)

    assert dm.place(need) == ("cpu:1",)  # the most free memory
    split = est.split(("cpu:1", "cpu:2"), kv=8 << 20)
    assert split == {"cpu:1": ((4 + 4) << 20, 4 << 20), "cpu:2": (4 << 20, 4 << 20)}
    real = est.split(("cpu:1", "cpu:2"), weights=1000, kv=101)
    assert sum(w for w, _ in real.values()) == 1000 and sum(k for _, k in real.values()) == 101
    assert dm.place(need, ("cpu:1", "cpu:2")) == ("cpu:1", "cpu:2")
    with pytest.raises(ApiError) as ei:
        dm.place(need, ("cpu:0",))  # 16 MiB free, needs 12 + 8
    assert ei.value.status == 507 and "cpu:0 lacks 4.0 MiB" in ei.value.message
    big = Estimate(
        base=200 << 20, layer_bytes=(0,), kv_layer_bytes=(1,), state_layer_bytes=(0,), context_limit=16
    )
    with pytest.raises(ApiError) as ei:
        dm.place(lambda ds: big.split(ds))
    assert ei.value.status == 507 and all(f"cpu:{i} lacks" in ei.value.message for i in range(3))


def test_worker_threads_share_the_cores(monkeypatch):
    from pantheon.control import dies

    monkeypatch.setattr(dies.os, "cpu_count", lambda: 16)
    assert dies.default_worker_threads(4, None) == 4
    assert dies.default_worker_threads(32, None) == 1
    assert dies.default_worker_threads(1, None) is None  # one die: torch decides
    assert dies.default_worker_threads(4, 3) == 3  # --worker-threads wins


# ---------------------------------------------------------------- sizing


@pytest.mark.parametrize(
    "preset,quantize,path",
    [
        ("tiny", False, "auto"),
        ("tiny-llama", False, "auto"),
        ("tiny-qwen2", False, "auto"),
        ("tiny-qwen3.5", False, "auto"),
        ("tiny-qwen3.5", False, "bf16-packed"),
        ("tiny-qwen3.5", True, "int8"),
        ("tiny", True, "auto"),
        ("tiny", False, "bf16-packed"),
        ("tiny", False, "bf16"),
        ("tiny-llama", False, "fp32-packed"),
        ("tiny-llama", False, "fp32"),
        ("tiny-llama", True, "int8"),
        ("tiny-llama", False, "bf16-packed"),
    ],
)
def test_estimate_matches_the_engine(model_factory, preset, quantize, path):
    """The router's estimate from config.json against what a real engine allocates, for every
    CPU path forced (skipped where the path does not work on this host) and for the auto choice
    (sized with the path the engine chose; unsized, the estimate is the upper bound of all)."""
    from pantheon.core.sizing import estimate, read_shape, state_pool_slots
    from workers import cpu_paths
    from workers.engine import Engine

    if path != "auto" and cpu_paths.probe(path):
        pytest.skip(f"{path} does not work here: {cpu_paths.probe(path)}")
    shape = read_shape(model_factory(preset))
    eng = Engine(
        str(model_factory(preset)), devices=["cpu"], kv_budget_bytes=1 << 20, quantize=quantize, cpu_path=path
    )
    assert eng.cpu_path == (path if path != "auto" else eng.cpu_path)
    est = estimate(shape, quantize=quantize, cpu_path=eng.cpu_path)
    kv = est.kv_pool(1000)
    eng = Engine(
        str(model_factory(preset)),
        devices=["cpu"],
        kv_budget_bytes=kv,
        quantize=quantize,
        cpu_path=eng.cpu_path,
    )
    assert eng.kv_bytes == kv
    # the slots, the scratch one and the prefix cache's checkpoints
    assert eng.state_bytes == state_pool_slots(eng.num_slots, 2 * eng.num_slots) * est.state_per_slot
    assert (est.state_per_slot > 0) == preset.startswith("tiny-qwen3.5")
    assert abs(eng.weight_bytes - est.weights) <= 0.01 * est.weights, (eng.weight_bytes, est.weights)
    bound = estimate(shape, quantize=quantize)  # before the choice: the largest it may be
    assert bound.weights >= est.weights and bound.kv_per_token >= est.kv_per_token


def test_sizing_refuses_unsupported_and_invalid(tmp_path):
    import json

    from pantheon.core.sizing import SizingError, read_shape

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SizingError) as ei:
        read_shape(tmp_path)
    assert ei.value.kind == "unsupported"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SizingError) as ei:
        read_shape(tmp_path)
    assert ei.value.kind == "invalid"
    with pytest.raises(SizingError) as ei:
        read_shape(tmp_path / "nope")
    assert ei.value.kind == "not_found"


# ---------------------------------------------------------------- pressure


def test_pressure_levels_thresholds_and_the_test_seam():
    from pantheon.control.pressure import CRITICAL, PressureSource, level_for, parse_thresholds

    th = parse_thresholds("0.5,0.7,0.9")
    assert [level_for(x, th) for x in (0.1, 0.5, 0.75, 0.95)] == [0, 1, 2, 3]
    for bad in ("0.5,0.4,0.9", "1", "0,0.5,2"):
        with pytest.raises(ValueError):
            parse_thresholds(bad)
    host = {"v": (100, 60)}  # 40 % used
    cuda = {"cuda:0": (100, 5)}  # 95 % used
    src = PressureSource(th, host_probe=lambda: host["v"], die_probe=cuda.get)
    assert src.host_level() == 0 and src.die_level("cpu:0") == 0
    assert src.die_level("cuda:0") == 3 and src.level(["cpu:0"]) == 0
    assert src.level(["cpu:0", "cuda:0"]) == 3
    src.force(CRITICAL)
    assert src.level() == CRITICAL and src.die_level("cpu:1") == CRITICAL
    src.clear()
    src.force(2, "cpu:1")
    assert src.die_level("cpu:1") == 2 and src.die_level("cpu:0") == 0
    src.clear()
    assert src.level(["cpu:1"]) == 0
    with pytest.raises(ValueError):
        src.force(4)


# ---------------------------------------------------------------- context admission


def _chat(messages, **kw):
    return parse_chat_request({"messages": messages, **kw})


def _convo(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        msgs += [
            {"role": "user", "content": f"question {i} about the weather in the town"},
            {"role": "assistant", "content": f"answer {i}: sunny and warm all day"},
        ]
    return msgs + [{"role": "user", "content": "and tomorrow?"}]


def test_admission_pass_cap_deny(tiny_model):
    from pantheon.control.context import fit_context
    from pantheon.models.assets import ModelAssets

    assets = ModelAssets(tiny_model)
    short = fit_context(assets, _chat(_convo(1), max_tokens=8), 4096)
    assert not short.capped and short.max_tokens == 8
    full = fit_context(assets, _chat(_convo(8), max_tokens=8), 4096)
    assert not full.capped
    capped = fit_context(assets, _chat(_convo(8), max_tokens=8), 4096, limit=96)
    assert capped.capped and len(capped.prompt_ids) + 8 <= 96
    assert capped.dropped_messages > 0 and capped.dropped_messages % 2 == 0  # whole turns
    text = assets.tokenizer.decode(capped.prompt_ids, skip_special_tokens=False)
    assert "Be brief." in text and "and tomorrow?" in text and "question 0" not in text
    # the fewest turns are dropped: with one more turn kept it would not fit
    assert len(fit_context(assets, _chat(_convo(2), max_tokens=8), 4096).prompt_ids) + 8 > 96
    # one long message: its oldest tokens go
    long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(200))}]
    cut = fit_context(assets, _chat(long), 64)
    assert cut.capped and len(cut.prompt_ids) + cut.max_tokens <= 64 and cut.max_tokens == 16
    assert "w199" in assets.tokenizer.decode(cut.prompt_ids) and cut.dropped_tokens > 0
    # deny: the system prompt alone does not fit
    with pytest.raises(ApiError) as ei:
        fit_context(
            assets,
            _chat(
                [{"role": "system", "content": "word " * 80}, {"role": "user", "content": "hi"}], max_tokens=8
            ),
            64,
        )
    assert (ei.value.status, ei.value.code, ei.value.param) == (400, "context_length_exceeded", "max_tokens")
    assert "maximum context length is 64 tokens" in ei.value.message
    # a max_tokens no context can hold stays the OpenAI 400
    with pytest.raises(ApiError) as ei:
        fit_context(assets, _chat(_convo(0), max_tokens=64), 64)
    assert (ei.value.status, ei.value.param) == (400, "max_tokens")


# ---------------------------------------------------------------- the feed


def test_feed_counts_coalesces_rejects_and_measures_throughput():
    from pantheon.control.feed import Feed

    feed = Feed()
    q = feed.subscribe()
    for _ in range(50):
        feed.reject(429, "m", "queue_full", "full")
    feed.reject(503, "m", "memory_pressure", "critical")
    assert (feed.counters.rejected_429, feed.counters.rejected_503) == (50, 1)
    kinds = [e.kind for e in feed.events]
    assert kinds == ["reject_429", "reject_503"]  # 50 rejections, one event per second
    assert q.qsize() == 2
    feed.event("loaded", "x")
    feed.tokens(30)
    feed.request_done(0.1)
    feed.request_done(0.3)
    tp = feed.throughput()
    assert tp.tokens_per_s > 0 and tp.requests_per_s > 0
    assert tp.ttft_p50_s in (0.1, 0.3) and tp.ttft_p99_s == 0.3
    assert feed.counters.loads == 1 and feed.counters.requests == 2
    feed.close()
    while q.qsize() > 1:
        q.get_nowait()
    assert q.get_nowait() is None


def test_the_snapshot_carries_an_instances_speculation_counters():
    """``feed.instance_state`` copies the worker's latest speculation counters and draft into the
    dashboard's ``InstanceState``; before the first stats they are zero (and the draft "")."""
    import msgspec

    from pantheon.control.feed import instance_state
    from pantheon.control.live import InstanceFacts
    from pantheon.core.protocol import InstanceStats
    from pantheon.snapshot import decode_snapshot

    _, (inst,) = _registry("m")
    stats = InstanceStats(
        instance=inst.instance_id,
        slots=[],
        waiting=0,
        kv_blocks_total=8,
        kv_blocks_used=2,
        weight_bytes=0,
        kv_bytes=0,
        spec_verify_steps=100,
        spec_drafted=400,
        spec_accepted=284,
        spec_emitted=384,
        spec_draft="/models/draft-68m",
    )
    got = instance_state(InstanceFacts(inst=inst, engine=stats, queued=0, weights_bytes=1, kv_bytes=2))
    spec = (got.draft, got.spec_verify_steps, got.spec_drafted, got.spec_accepted, got.spec_emitted)
    assert spec == ("/models/draft-68m", 100, 400, 284, 384)
    assert got.kv_blocks_used == 2  # the other engine fields come from the same stats
    none = instance_state(InstanceFacts(inst=inst, engine=None, queued=0, weights_bytes=1, kv_bytes=2))
    spec = (none.draft, none.spec_verify_steps, none.spec_drafted, none.spec_accepted, none.spec_emitted)
    assert spec == ("", 0, 0, 0, 0)

    # over the wire as the dashboard gets it; an older router's (no such fields) decodes with zeros
    def over_the_wire(inst: dict):
        return decode_snapshot(msgspec.json.encode({"ts": 1.0, "started_at": 0.0, "instances": [inst]}))

    wire = msgspec.to_builtins(got)
    assert over_the_wire(wire).instances == [got]
    for k in ("draft", "spec_verify_steps", "spec_drafted", "spec_accepted", "spec_emitted"):
        del wire[k]
    (old,) = over_the_wire(wire).instances
    assert (old.draft, old.spec_drafted, old.spec_verify_steps) == ("", 0, 0)


def test_a_failure_is_error_while_failed_and_last_error_after():
    import time as _time

    reg, (inst,) = _registry("m")
    reg.fail(inst, "the worker died (SIGKILL)")
    assert (inst.state, inst.error, inst.last_error) == (
        "failed",
        "the worker died (SIGKILL)",
        "the worker died (SIGKILL)",
    )
    assert abs(inst.last_error_at - _time.time()) < 5
    info = inst.info()
    assert info["error"] == info["last_error"] == "the worker died (SIGKILL)"
    reg.publish(inst)  # back after a reload
    assert inst.state == "ready" and inst.error is None
    assert inst.info()["last_error"] == "the worker died (SIGKILL)" and inst.last_error_at
