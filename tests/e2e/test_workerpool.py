"""The router's side of the link: ``WorkerPool`` with real worker processes over real sockets.

One pool with a cpu:0 worker and the ``tiny`` model serves most tests; the failure tests start
their own small pools, mostly with stand-in worker commands that cost no torch import.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import pytest_asyncio

from pantheon.core import protocol as p
from pantheon.workerlink.pool import (
    LoadFailedError,
    RequestRejectedError,
    WorkerDied,
    WorkerPool,
    WorkerStartError,
)

BUDGET = 256 << 20
KV = 4 << 20
in_module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPT = [5, 6, 7, 8, 9]


def submit(rid: str, n: int, instance: str = "m", prompt=PROMPT) -> p.Submit:
    params = p.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    return p.Submit(request_id=rid, instance=instance, prompt=list(prompt), params=params)


def load_msg(instance: str, path, **kw) -> p.LoadModel:
    return p.LoadModel(instance=instance, path=str(path), kv_budget_bytes=kw.pop("kv", KV), num_slots=4, **kw)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool():
    deaths: list[tuple[str, str]] = []
    pool = WorkerPool(worker_threads=1, on_worker_dead=lambda die, why: deaths.append((die, why)))
    pool.deaths = deaths  # for the tests to read
    await pool.start()
    yield pool
    await pool.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def die0(pool):
    return await pool.start_worker("cpu:0", budget_bytes=BUDGET)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model(pool, die0, tiny_model):
    """Instance ``m`` of the tiny model on cpu:0: ``(Loaded, progress messages)``."""
    progress: list[p.LoadProgress] = []
    loaded = await pool.load("cpu:0", load_msg("m", tiny_model), progress=progress.append)
    return loaded, progress


async def wait_for_stats(pool: WorkerPool, die: str, pred, timeout: float = 5.0) -> p.Stats:
    """Poll the die's latest Stats until ``pred`` holds (the worker sends them every 0.25-1 s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        st = pool.stats(die)
        if st is not None and pred(st):
            return st
        if loop.time() > deadline:
            pytest.fail(f"no Stats from {die} matched within {timeout} s; last: {st}")
        await asyncio.sleep(0.05)


def all_idle(st: p.Stats) -> bool:
    return all(s.state == "idle" for i in st.instances for s in i.slots) and all(
        i.waiting == 0 for i in st.instances
    )


# ---------------------------------------------------------------------- start, load


@in_module_loop
@pytest.mark.timeout(90)
async def test_hello_handshake(pool, die0):
    assert die0.die == "cpu:0" and die0.alive and die0.error is None
    assert die0.total_bytes == BUDGET and die0.device_name.startswith("CPU")
    assert die0.pid and die0.pid != os.getpid()
    assert [d.die for d in pool.dies()] == ["cpu:0"]
    st = await wait_for_stats(pool, "cpu:0", lambda st: True)
    assert st.total_bytes == BUDGET


@in_module_loop
@pytest.mark.timeout(30)
async def test_runtime_dir_is_private(pool):
    assert os.stat(pool.runtime_dir).st_mode & 0o777 == 0o700
    assert pool.endpoint.startswith("ipc://" + pool.runtime_dir)


@in_module_loop
@pytest.mark.timeout(90)
async def test_load(pool, model):
    loaded, progress = model
    assert loaded.instance == "m" and loaded.num_slots == 4 and loaded.kv_bytes > 0
    assert progress and progress[-1].done == progress[-1].total
    st = await wait_for_stats(pool, "cpu:0", lambda st: st.instances)
    assert st.free_bytes == BUDGET - loaded.weight_bytes - loaded.kv_bytes
    assert pool.dies()[0].free_bytes == st.free_bytes


@in_module_loop
@pytest.mark.timeout(60)
async def test_load_missing_path_keeps_worker_usable(pool, model, tmp_path):
    with pytest.raises(LoadFailedError) as e:
        await pool.load("cpu:0", load_msg("ghost", tmp_path / "missing"))
    assert e.value.kind == "not_found"
    toks = [t async for t in pool.submit("cpu:0", submit("after-fail", 3))]
    assert len(toks) == 3


@in_module_loop
@pytest.mark.timeout(60)
async def test_load_over_budget_is_out_of_memory(pool, model, tiny_model):
    with pytest.raises(LoadFailedError) as e:
        await pool.load("cpu:0", load_msg("huge", tiny_model, kv=BUDGET))
    assert e.value.kind == "out_of_memory"


# ---------------------------------------------------------------------- requests


@in_module_loop
@pytest.mark.timeout(60)
async def test_stream_to_length(pool, model):
    stream = pool.submit("cpu:0", submit("r1", 12))
    toks = [t async for t in stream]
    assert len(toks) == 12 and all(t.request_id == "r1" for t in toks)
    assert toks[-1].finish == "length" and all(t.finish is None for t in toks[:-1])
    loaded, _ = model
    assert all(0 <= t.token < loaded.vocab_size for t in toks)
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    stream.abort()  # finished: a no-op


@in_module_loop
@pytest.mark.timeout(60)
async def test_next_batch(pool, model):
    stream = pool.submit("cpu:0", submit("r2", 20))
    got = []
    while batch := await stream.next_batch():
        got += batch
    assert len(got) == 20 and got[-1].finish == "length"
    assert await stream.next_batch() == []


@in_module_loop
@pytest.mark.timeout(60)
async def test_abort_mid_stream_frees_the_slot(pool, model):
    stream = pool.submit("cpu:0", submit("long", 3000))
    first = await stream.__anext__()
    assert first.finish is None
    stream.abort()
    stream.abort()  # idempotent
    assert [t async for t in stream] == []
    await wait_for_stats(pool, "cpu:0", lambda st: all_idle(st) and st.instances)


@in_module_loop
@pytest.mark.timeout(60)
async def test_two_requests_interleave(pool, model):
    a = pool.submit("cpu:0", submit("a", 300))
    assert (await a.__anext__()).finish is None
    b = pool.submit("cpu:0", submit("b", 5, prompt=[20, 21, 22]))
    b_toks = [t async for t in b]
    assert len(b_toks) == 5 and b_toks[-1].finish == "length"
    # b ran start to end while a was still decoding: a has not finished yet.
    batch = await a.next_batch()
    assert batch and batch[-1].finish is None
    rest = [t async for t in a]
    assert 1 + len(batch) + len(rest) == 300 and rest[-1].finish == "length"
    assert {t.request_id for t in batch + rest} == {"a"}


@in_module_loop
@pytest.mark.timeout(30)
async def test_rejected_request_raises(pool, model):
    with pytest.raises(RequestRejectedError) as e:
        async for _ in pool.submit("cpu:0", submit("lost", 3, instance="no-such")):
            pass
    assert e.value.kind == "no_instance"
    with pytest.raises(ValueError):
        s = pool.submit("cpu:0", submit("dup", 50))
        pool.submit("cpu:0", submit("dup", 50))
    s.abort()


@in_module_loop
@pytest.mark.timeout(60)
async def test_unload(pool, model, tiny_model):
    await pool.load("cpu:0", load_msg("tmp", tiny_model))
    await pool.unload("cpu:0", "tmp")
    with pytest.raises(RequestRejectedError):
        await pool.submit("cpu:0", submit("to-unloaded", 3, instance="tmp")).__anext__()
    loaded, _ = model
    await wait_for_stats(pool, "cpu:0", lambda st: [i.instance for i in st.instances] == ["m"])
    assert pool.stats("cpu:0").free_bytes == BUDGET - loaded.weight_bytes - loaded.kv_bytes


# ---------------------------------------------------------------------- worker death


@in_module_loop
@pytest.mark.timeout(90)
async def test_sigkill_mid_request_raises_worker_died(pool, model, tiny_model):
    info = await pool.start_worker("cpu:1", budget_bytes=BUDGET)
    await pool.load("cpu:1", load_msg("m1", tiny_model))
    stream = pool.submit("cpu:1", submit("doomed", 3000, instance="m1"))
    await stream.__anext__()
    os.kill(info.pid, signal.SIGKILL)
    with pytest.raises(WorkerDied) as e:
        async with asyncio.timeout(5):
            async for _ in stream:
                pass
    assert e.value.die == "cpu:1" and "SIGKILL" in str(e.value)
    dead = {d.die: d for d in pool.dies()}["cpu:1"]
    assert not dead.alive and "SIGKILL" in dead.error
    assert [d for d, _ in pool.deaths] == ["cpu:1"]
    with pytest.raises(WorkerDied):
        pool.submit("cpu:1", submit("too-late", 3))
    # The other die and the pool go on; the dead die can be started again.
    assert len([t async for t in pool.submit("cpu:0", submit("survivor", 4))]) == 4
    again = await pool.start_worker("cpu:1", budget_bytes=BUDGET)
    assert again.alive and again.pid != info.pid


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_silent_worker_is_declared_dead():
    deaths = []
    async with WorkerPool(
        heartbeat_interval=0.2, dead_after=1.0, on_worker_dead=lambda d, r: deaths.append(r)
    ) as pool:
        info = await pool.start_worker("cpu:3", budget_bytes=BUDGET)
        os.kill(info.pid, signal.SIGSTOP)  # alive but silent, as a wedged worker would be
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(WorkerDied, match="sent nothing"):
            async with asyncio.timeout(6):
                await pool.unload("cpu:3", "anything")  # a pending reply fails too
        assert asyncio.get_running_loop().time() - t0 < 4
        assert len(deaths) == 1 and "sent nothing" in deaths[0]
        assert not pool.dies()[0].alive


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_long_step_is_not_a_dead_worker_but_a_hung_one_is(tiny_model, tmp_path, monkeypatch):
    """The step seam sleeps 4 s inside one step: longer than the pool's silence bound (2 s
    here; it was the whole liveness rule before), yet the heartbeat thread keeps the worker
    alive and the request completes. Then the seam hangs the step: after the step timeout
    (6 s) the worker is declared dead, its request fails with the reason, its process is gone."""
    hook = tmp_path / "hook"
    monkeypatch.setenv("PANTHEON_TEST_STEP_HOOK", str(hook))  # the worker inherits our env
    deaths = []
    async with WorkerPool(
        worker_threads=1,
        heartbeat_interval=0.2,
        dead_after=2.0,
        step_timeout=6.0,
        on_worker_dead=lambda d, r: deaths.append(r),
    ) as pool:
        info = await pool.start_worker("cpu:4", budget_bytes=BUDGET)
        await pool.load("cpu:4", load_msg("m", tiny_model))
        hook.write_text("4")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        toks = [t async for t in pool.submit("cpu:4", submit("slow", 3))]
        assert len(toks) == 3 and loop.time() - t0 > 3.5 and not hook.exists()
        await asyncio.sleep(1.0)  # the next beats
        d = pool.dies()[0]
        assert d.alive and not deaths and d.beat.steps >= 3 and d.beat.turn_s < 1.0

        hook.write_text("hang")
        stream = pool.submit("cpu:4", submit("stuck", 50))
        t0 = loop.time()
        with pytest.raises(WorkerDied, match="step has run") as e:
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        assert 6.0 <= loop.time() - t0 < 15
        assert "step timeout is 6 s" in str(e.value)
        d = pool.dies()[0]
        assert not d.alive and d.deaths == 1 and "step has run" in d.last_death
        assert len(deaths) == 1
        with pytest.raises(ProcessLookupError):
            for _ in range(50):  # the pool killed it: it must let go of the die
                os.kill(info.pid, 0)
                await asyncio.sleep(0.1)
        hook.unlink(missing_ok=True)
        again = await pool.start_worker("cpu:4", budget_bytes=BUDGET)
        assert again.alive and again.restarts == 1 and again.deaths == 1
        assert again.last_death == d.last_death  # kept after the restart


# ---------------------------------------------------------------------- start failures


def fake_worker(body: str) -> list[str]:
    """A worker command running ``body`` (argv as the pool passes it is in ``sys.argv``)."""
    return [sys.executable, "-c", textwrap.dedent(body)]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_hello_timeout_tells_what_to_check():
    pool = WorkerPool(hello_timeout=1.0, worker_command=fake_worker("import time; time.sleep(60)"))
    await pool.start()
    runtime = pool.runtime_dir
    try:
        with pytest.raises(WorkerStartError) as e:
            await pool.start_worker("cpu:0")
        msg = str(e.value)
        assert "sent no Hello within 1 s" in msg and "still running" in msg
        assert pool.endpoint in msg and sys.executable in msg and "Check that" in msg
        assert not pool.dies()[0].alive
    finally:
        await pool.close()
    assert not os.path.exists(runtime)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_worker_dying_before_hello_shows_its_output():
    body = "import sys; print('cannot import torch: no module', file=sys.stderr); sys.exit(7)"
    async with WorkerPool(worker_command=fake_worker(body)) as pool:
        with pytest.raises(WorkerStartError) as e:
            await pool.start_worker("cpu:0")
    msg = str(e.value)
    assert "exited with code 7" in msg and "cannot import torch: no module" in msg


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_bogus_python_is_reported():
    async with WorkerPool(worker_command=["/nonexistent/python3", "-m", "workers.worker"]) as pool:
        with pytest.raises(WorkerStartError, match="could not be spawned") as e:
            await pool.start_worker("cpu:0")
    assert "/nonexistent/python3" in str(e.value)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_nothing_is_sent_before_hello(tmp_path):
    out = tmp_path / "seen.txt"
    body = f"""
        import os, sys, zmq
        from pantheon.core import protocol as p
        a = sys.argv
        die, ep = a[a.index("--die") + 1], a[a.index("--endpoint") + 1]
        s = zmq.Context().socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, die.encode())
        s.connect(ep)
        seen = ["before:%d" % s.poll(1000)]
        s.send(p.encode(p.Hello(die=die, device_name="fake", total_bytes=1, free_bytes=1, pid=os.getpid())))
        if s.poll(5000):
            seen.append("after:" + type(p.decode_router_msg(s.recv())).__name__)
        open({str(out)!r}, "w").write(" ".join(seen))
    """
    async with WorkerPool(heartbeat_interval=0.1, worker_command=fake_worker(body)) as pool:
        await pool.start_worker("cpu:0")
        for _ in range(100):
            if out.exists() and out.read_text():
                break
            await asyncio.sleep(0.05)
    assert out.read_text() == "before:0 after:Ping"


@pytest.mark.asyncio
async def test_bad_die_id():
    async with WorkerPool() as pool:
        with pytest.raises(ValueError):
            await pool.start_worker("gpu:0")


def test_never_imports_torch():
    code = "import sys, pantheon.workerlink.pool; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
