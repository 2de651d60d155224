"""Backpressure end to end: a real ``pantheon serve`` with a tiny model on a CPU die, two slots, a
queue of depth 1 and a 1.5 s queue timeout, and the pressure test seam on
(``PANTHEON_TEST_HOOKS=1``).

- both slots busy and one request queued: the next gets 429 ``Retry-After: 5`` at once, the
  queued one 429 ``Retry-After: 2`` when its wait runs out;
- a client that goes away while queued leaves the queue;
- CRITICAL pressure (forced through the seam, not by eating memory): no fast path, so a request
  queues even with free slots; with the queue full the next gets 503; when the pressure drops
  the queued one runs;
- ``/admin/state`` validates as a ``Snapshot`` and shows the busy slots; ``/admin/events`` yields
  a snapshot and then the events as they happen.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pantheon.snapshot import decode_snapshot

from helpers.serve import MSG, Server, check_error, until

pytestmark = pytest.mark.timeout(120)
SHORT = {"model": "tiny", "messages": MSG, "max_tokens": 2}
LONG = {"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def bp(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    s = Server(
        [
            "--model",
            str(tiny),
            "--name",
            "tiny",
            "--dies",
            "cpu:0",
            "--cpu-dies",
            "1",
            "--slots",
            "2",
            "--queue-depth",
            "1",
            "--queue-timeout",
            "1.5",
        ],
        tmp_path_factory.mktemp("bp-logs") / "bp.log",
        env={"PANTHEON_TEST_HOOKS": "1"},
    )
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def state(s: Server):
    r = httpx.get(s.url + "/admin/state", timeout=10)
    assert r.status_code == 200, r.text
    return decode_snapshot(r.content)


def depth(s: Server) -> int:
    return sum(q.depth for q in state(s).queues if q.model == "tiny")


@contextlib.contextmanager
def holding(s: Server, n: int):
    """``n`` long streams, each past its first chunk (so each holds a slot) until exit."""
    stack = contextlib.ExitStack()
    lines = []  # kept: a line iterator that is let go closes its response
    with stack:
        for _ in range(n):
            r = stack.enter_context(
                httpx.stream("POST", s.url + "/v1/chat/completions", json=LONG, timeout=60)
            )
            assert r.status_code == 200
            lines.append(r.iter_lines())
            next(line for line in lines[-1] if line.startswith("data: "))
        yield


def force(s: Server, level):
    r = httpx.post(s.url + "/admin/test/pressure", json={"level": level}, timeout=10)
    assert r.status_code == 200, r.text


def test_queue_full_429_retry_after_5_and_timeout_retry_after_2(bp):
    pool = ThreadPoolExecutor(2)
    with holding(bp, 2):
        snap = state(bp)
        inst = next(i for i in snap.instances if i.name == "tiny")
        assert inst.in_flight == 2
        # the worker's Stats (every 250 ms while busy) show the slots decoding
        until(
            lambda: (
                sum(
                    sl.state != "idle"
                    for sl in next(i for i in state(bp).instances if i.name == "tiny").slots
                )
                == 2
            ),
            what="busy slots",
        )
        t0 = time.monotonic()
        queued = pool.submit(httpx.post, bp.url + "/v1/chat/completions", json=SHORT, timeout=30)
        until(lambda: depth(bp) == 1, what="a queued request")
        full = httpx.post(bp.url + "/v1/chat/completions", json=SHORT, timeout=30)
        check_error(full, 429, code="queue_full")
        assert full.headers["retry-after"] == "5"
        late = queued.result(timeout=30)
        check_error(late, 429, code="queue_timeout")
        assert late.headers["retry-after"] == "2"
        assert 1.4 < time.monotonic() - t0 < 5
    assert depth(bp) == 0
    counters = state(bp).counters
    assert counters.rejected_429 >= 2
    # the slots are free again: the fast path serves
    until(
        lambda: httpx.post(bp.url + "/v1/chat/completions", json=SHORT, timeout=30).status_code == 200,
        what="a free slot",
    )


def test_client_that_goes_away_leaves_the_queue(bp):
    with holding(bp, 2):

        def impatient():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(bp.url + "/v1/chat/completions", json=SHORT, timeout=0.4)

        th = threading.Thread(target=impatient)
        th.start()
        until(lambda: depth(bp) == 1, what="the request to queue")
        th.join()
        t_gone = time.monotonic()
        until(lambda: depth(bp) == 0, timeout=1.0, what="the queue to empty")
        assert time.monotonic() - t_gone < 1.0  # long before its 1.5 s queue timeout


def test_critical_pressure_gives_503_then_drains(bp):
    events = []

    def follow():
        with httpx.stream("GET", bp.url + "/admin/events?interval=0.2", timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            kind = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[6:])))
                    seen = [e[1].get("kind") for e in events if e[0] == "event"]
                    if kind == "snapshot" and "reject_503" in seen:
                        return  # the events, then the next periodic snapshot

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    until(lambda: events, what="the first snapshot")
    assert events[0][0] == "snapshot"
    decode_snapshot(json.dumps(events[0][1]))
    pool = ThreadPoolExecutor(1)
    force(bp, 3)
    try:
        dies = httpx.get(bp.url + "/admin/dies", timeout=10).json()["data"]
        assert [d["pressure"] for d in dies] == [3]
        held = pool.submit(httpx.post, bp.url + "/v1/chat/completions", json=SHORT, timeout=30)
        until(lambda: depth(bp) == 1, what="a request held at CRITICAL")
        assert not held.done()  # both slots are free: only the pressure holds it
        r = httpx.post(bp.url + "/v1/chat/completions", json=SHORT, timeout=30)
        check_error(r, 503, code="memory_pressure")
        assert r.headers["retry-after"] == "1"
    finally:
        force(bp, None)
    assert held.result(timeout=10).status_code == 200  # the pressure dropped: it ran
    watcher.join(10)
    kinds = [e[1]["kind"] for e in events if e[0] == "event"]
    assert "pressure" in kinds and "reject_503" in kinds, kinds
    snaps = [e for e in events if e[0] == "snapshot"]
    assert len(snaps) >= 2  # periodic snapshots between the events
    snap = state(bp)
    assert snap.counters.rejected_503 >= 1
    assert any(e.kind == "reject_503" for e in snap.events)
    assert snap.throughput.ttft_p50_s is not None and snap.counters.requests >= 1
