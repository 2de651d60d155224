"""The worker process against a bare ROUTER socket: the wire protocol as the worker speaks it.

One real worker process (cpu:0, the ``tiny`` model) serves the whole module; a few short-lived
ones check how the worker exits. ``tests/e2e/test_workerpool.py`` covers the router's side.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from pantheon.core import protocol as p
from workers import devices

BUDGET = 256 << 20
KV = 4 << 20


class Router:
    """A bare ROUTER socket in a private dir, speaking the protocol by hand."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="pn-test-")
        self.endpoint = f"ipc://{self.dir}/r.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.beats: list = []  # (received at, identity, Beat)

    def spawn(self, die: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "workers.worker", "--die", die, "--endpoint", self.endpoint, *extra]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)

    def send(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, p.encode(msg)])

    def recv(self, timeout: float = 10.0, beats: bool = False):
        """The next ``(identity, message)``; fails the test after ``timeout`` seconds.

        Heartbeats (``Beat`` from ``<die>/hb``) are kept in ``self.beats`` and skipped unless
        ``beats``."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                pytest.fail(f"no message from a worker within {timeout} s")
            ident, data = self.sock.recv_multipart()
            msg = p.decode_worker_msg(data)
            if beats or not isinstance(msg, p.Beat):
                return ident, msg
            self.beats.append((time.monotonic(), ident, msg))

    def collect(self, until, timeout: float = 20.0) -> list:
        """Every message up to and including the first one for which ``until(msg)`` is true."""
        deadline = time.monotonic() + timeout
        out = []
        while True:
            _, msg = self.recv(max(0.01, deadline - time.monotonic()))
            out.append(msg)
            if until(msg):
                return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


class Worker:
    def __init__(self, router: Router, proc: subprocess.Popen, ident: bytes, first):
        self.router, self.proc, self.ident, self.first = router, proc, ident, first

    def send(self, msg) -> None:
        self.router.send(self.ident, msg)

    def collect(self, until, timeout: float = 20.0) -> list:
        return self.router.collect(until, timeout)

    def next(self, kind, timeout: float = 20.0):
        """The next message of type ``kind`` (others are skipped)."""
        return self.collect(lambda m: isinstance(m, kind), timeout)[-1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def router():
    r = Router()
    yield r
    r.close()


@pytest.fixture(scope="module")
def worker(router):
    # The bare router sends no Pings, so give the worker a long router timeout.
    proc = router.spawn("cpu:0", "--budget-bytes", str(BUDGET), "--threads", "1", "--router-timeout", "300")
    ident, first = router.recv(timeout=60)
    yield Worker(router, proc, ident, first)
    _stop(proc)


@pytest.fixture(scope="module")
def loaded(worker, tiny_model):
    """The tiny model loaded as instance ``m``: ``(messages up to Loaded, Loaded)``."""
    worker.send(p.LoadModel(instance="m", path=str(tiny_model), kv_budget_bytes=KV, num_slots=4))
    msgs = worker.collect(lambda m: isinstance(m, (p.Loaded, p.LoadFailed)), timeout=60)
    assert isinstance(msgs[-1], p.Loaded), msgs[-1]
    return msgs, msgs[-1]


def _submit(worker: Worker, rid: str, n: int, instance: str = "m", prompt=None) -> None:
    params = p.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    worker.send(p.Submit(request_id=rid, instance=instance, prompt=prompt or [5, 6, 7, 8, 9], params=params))


def _idle(stats: p.Stats) -> bool:
    return all(s.state == "idle" for i in stats.instances for s in i.slots) and all(
        i.waiting == 0 for i in stats.instances
    )


# ---------------------------------------------------------------------- handshake and basics


@pytest.mark.timeout(90)
def test_hello_comes_first(worker):
    assert worker.ident == b"cpu:0"
    hello = worker.first
    assert isinstance(hello, p.Hello)
    assert hello.die == "cpu:0" and hello.pid == worker.proc.pid
    assert hello.version == p.PROTOCOL_VERSION
    assert hello.total_bytes == BUDGET and hello.free_bytes == BUDGET
    assert hello.device_name.startswith("CPU")


@pytest.mark.timeout(30)
def test_ping_pong(worker):
    worker.send(p.Ping(seq=41, sent_at=123.5))
    pong = worker.next(p.Pong)
    assert (pong.seq, pong.sent_at) == (41, 123.5)


@pytest.mark.timeout(30)
def test_idle_stats_come_every_second(worker):
    worker.next(p.Stats)
    t0 = time.monotonic()
    worker.next(p.Stats)
    assert 0.5 < time.monotonic() - t0 < 1.6  # ~1 s apart when idle


@pytest.mark.timeout(90)
def test_the_heart_beats_through_a_long_step(router, tiny_model, tmp_path):
    """Beats come from ``<die>/hb`` every 0.5 s, also while one step sleeps 3 s (the test seam),
    and say how long that step has run; the main loop's own messages pause meanwhile."""
    hook = tmp_path / "hook"
    env = dict(os.environ, PANTHEON_TEST_STEP_HOOK=str(hook))
    proc = router.spawn(
        "cpu:5", "--budget-bytes", str(BUDGET), "--threads", "1", "--router-timeout", "300", env=env
    )
    ident = b"cpu:5"

    def wait_for(until, timeout):  # this worker's messages (the module's cpu:0 talks too)
        deadline = time.monotonic() + timeout
        while True:
            who, msg = router.recv(max(0.01, deadline - time.monotonic()))
            if who == ident and until(msg):
                return msg

    try:
        assert isinstance(wait_for(lambda m: True, 60), p.Hello)
        router.send(ident, p.LoadModel(instance="m", path=str(tiny_model), kv_budget_bytes=KV))
        assert isinstance(wait_for(lambda m: isinstance(m, (p.Loaded, p.LoadFailed)), 60), p.Loaded)
        hook.write_text("3")
        router.send(
            ident,
            p.Submit(
                request_id="r",
                instance="m",
                prompt=[5, 6, 7],
                params=p.SamplingParams(max_tokens=2, ignore_eos=True),
            ),
        )
        router.beats.clear()
        t0 = time.monotonic()
        wait_for(lambda m: isinstance(m, p.StepOutput) and any(t.finish for t in m.tokens), 30)
        took = time.monotonic() - t0
        assert took > 2.5 and not hook.exists()  # the hook ran, once
        beats = [(at, b) for at, who, b in router.beats if who == b"cpu:5/hb"]
        during = [b.turn_s for at, b in beats if at - t0 < took]
        assert len(during) >= 4, beats  # about one per 0.5 s, while the main loop slept
        assert max(during) > 2.0  # ... and they said how long the step had run
        gaps = [b[0] - a[0] for a, b in zip(beats, beats[1:])]
        assert max(gaps) < 1.5, gaps
    finally:
        _stop(proc)


@pytest.mark.timeout(30)
def test_load_missing_path_fails_not_found(worker, tmp_path):
    worker.send(p.LoadModel(instance="nope", path=str(tmp_path / "missing")))
    failed = worker.next(p.LoadFailed)
    assert failed.instance == "nope" and failed.kind == "not_found", failed
    worker.send(p.Ping(seq=1, sent_at=0.0))
    assert worker.next(p.Pong).seq == 1  # still serving


@pytest.mark.timeout(90)
def test_load_reports_progress_then_loaded(loaded, worker):
    msgs, done = loaded
    progress = [m for m in msgs if isinstance(m, p.LoadProgress)]
    assert progress and all(m.instance == "m" for m in progress)
    assert progress[-1].done == progress[-1].total > 0  # the final count comes before Loaded
    assert done.instance == "m" and done.num_slots == 4 and done.kv_bytes > 0 and done.weight_bytes > 0
    assert done.vocab_size > 100 and done.eos_token_ids
    stats = worker.next(p.Stats)
    assert stats.free_bytes == BUDGET - done.weight_bytes - done.kv_bytes  # booked on the virtual die
    assert [i.instance for i in stats.instances] == ["m"]


@pytest.mark.timeout(30)
def test_duplicate_load_is_invalid(loaded, worker, tiny_model):
    worker.send(p.LoadModel(instance="m", path=str(tiny_model), kv_budget_bytes=KV))
    failed = worker.next(p.LoadFailed)
    assert failed.kind == "invalid" and "already" in failed.reason


@pytest.mark.timeout(60)
def test_cpu_budget_is_enforced(loaded, worker, tiny_model):
    worker.send(p.LoadModel(instance="big", path=str(tiny_model), kv_budget_bytes=BUDGET))
    failed = worker.next(p.LoadFailed)
    assert failed.instance == "big" and failed.kind == "out_of_memory", failed
    assert "budget" in failed.reason


# ---------------------------------------------------------------------- requests


@pytest.mark.timeout(60)
def test_two_requests_share_steps(loaded, worker):
    _submit(worker, "a", 6)
    _submit(worker, "b", 6, prompt=[11, 12, 13])
    outs = []
    finished = set()

    def until(m):
        if isinstance(m, p.StepOutput):
            finished.update(t.request_id for t in m.tokens if t.finish)
        return finished == {"a", "b"}

    steps = [m for m in worker.collect(until) if isinstance(m, p.StepOutput)]
    assert all(s.instance == "m" and s.step_ms > 0 for s in steps)
    for s in steps:
        outs += s.tokens
    for rid in "ab":
        mine = [t for t in outs if t.request_id == rid]
        assert len(mine) == 6 and mine[-1].finish == "length"
        assert all(t.finish is None for t in mine[:-1])
    assert any({t.request_id for t in s.tokens} == {"a", "b"} for s in steps)  # batched together


@pytest.mark.timeout(60)
def test_abort_frees_the_slot(loaded, worker):
    steps_before = worker.next(p.Stats).steps
    _submit(worker, "long", 3000)
    worker.collect(lambda m: isinstance(m, p.StepOutput) and any(t.request_id == "long" for t in m.tokens))
    worker.send(p.Abort(request_ids=["long", "never-heard-of"]))
    idle = worker.collect(lambda m: isinstance(m, p.Stats) and _idle(m), timeout=10)[-1]
    assert idle.steps - steps_before < 3000  # it stopped long before max_tokens
    later = worker.collect(lambda m: isinstance(m, p.Stats))
    assert not any(isinstance(m, p.StepOutput) for m in later)  # and nothing more came for it


@pytest.mark.timeout(30)
def test_bad_submits_are_rejected(loaded, worker):
    _submit(worker, "x", 4, instance="no-such-instance")
    rej = worker.next(p.Rejected)
    assert (rej.request_id, rej.kind) == ("x", "no_instance")
    worker.send(p.Submit(request_id="y", instance="m", prompt=[], params=p.SamplingParams()))
    rej = worker.next(p.Rejected)
    assert (rej.request_id, rej.kind) == ("y", "invalid")


@pytest.mark.timeout(90)
def test_unload_frees_memory(loaded, worker, tiny_model):
    worker.send(p.LoadModel(instance="tmp", path=str(tiny_model), kv_budget_bytes=KV))
    assert isinstance(worker.collect(lambda m: isinstance(m, (p.Loaded, p.LoadFailed)), 60)[-1], p.Loaded)
    worker.send(p.UnloadModel(instance="tmp"))
    assert worker.next(p.Unloaded).instance == "tmp"
    stats = worker.next(p.Stats)
    _, m = loaded
    assert stats.free_bytes == BUDGET - m.weight_bytes - m.kv_bytes
    assert [i.instance for i in stats.instances] == ["m"]
    worker.send(p.UnloadModel(instance="tmp"))  # idempotent
    assert worker.next(p.Unloaded).instance == "tmp"


@pytest.mark.timeout(30)
def test_shutdown_exits_zero(worker):
    """Runs last among the tests that use the module's worker."""
    worker.send(p.Shutdown())
    assert worker.proc.wait(10) == 0


# ---------------------------------------------------------------------- exits


@pytest.mark.timeout(60)
def test_exits_when_router_goes_silent(router):
    proc = router.spawn("cpu:7", "--router-timeout", "1")
    try:
        _, hello = router.recv(timeout=60)
        assert isinstance(hello, p.Hello) and hello.die == "cpu:7"
        t0 = time.monotonic()
        assert proc.wait(30) == 3
        assert time.monotonic() - t0 > 0.8  # not before its timeout (exiting itself can take seconds)
    finally:
        _stop(proc)


@pytest.mark.timeout(60)
def test_exits_when_parent_is_gone(router):
    proc = router.spawn("cpu:8", "--parent-pid", "1")  # pid 1 is not our parent
    try:
        assert proc.wait(30) == 4
    finally:
        _stop(proc)


@pytest.mark.timeout(30)
def test_bad_die_exits_2(router):
    proc = router.spawn("gpu:0")
    try:
        assert proc.wait(20) == 2
    finally:
        _stop(proc)


@pytest.mark.timeout(60)
def test_never_imports_http_tui_or_tokenizers():
    code = (
        "import sys, workers.worker; from workers.load_queue import engine_class; engine_class(); "
        "bad = [m for m in ('quart', 'textual', 'tokenizers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


# ---------------------------------------------------------------------- devices


def test_die_ids():
    assert devices.parse_die("cpu:0") == ("cpu", 0)
    assert devices.parse_die("cuda:3") == ("cuda", 3)
    assert devices.normalize_die("2") == "cuda:2"
    assert devices.engine_device("cpu:5") == "cpu"
    assert devices.engine_device("cuda:1") == "cuda:1"
    for bad in ("gpu:0", "cpu", "cuda:-1", ""):
        with pytest.raises(ValueError):
            devices.parse_die(bad)


def test_cpu_die_books_memory():
    die = devices.open_die("cpu:1", budget_bytes=1000)
    assert die.memory() == (1000, 1000)
    die.book(300)
    assert die.memory() == (700, 1000)
    die.book(900)
    assert die.memory() == (0, 1000)  # never negative
    die.release(1200)
    assert die.memory() == (1000, 1000)
    assert devices.open_die("cpu:0").memory()[1] > 0  # no budget: the machine's RAM
    with pytest.raises(ValueError):
        devices.open_die("cpu:0", budget_bytes=0)


def test_cuda_die_needs_a_device():
    import torch

    if torch.cuda.is_available():
        die = devices.open_die("cuda:0")
        free, total = die.memory()
        assert 0 < free <= total
    else:
        with pytest.raises(ValueError, match="CUDA"):
            devices.open_die("cuda:0")
