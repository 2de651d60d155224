"""One stream through a real ``pantheon serve`` with the per-token timestamps on
(``PANTHEON_DEBUG_TOKEN_TIMES``, what bench/http_path.py reads): every token leaves the worker
in its own ``StepOutput`` right after its step, the router receives each once, in order, and
hands the client one chunk per event it reads; and the spawned worker runs with the OpenMP wait
policy its thread count calls for (pantheon/workerlink/process.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from helpers.serve import MSG, Server, model_args

pytestmark = pytest.mark.timeout(240)

TOKENS = 12


@pytest.fixture(scope="module")
def traced(model_factory, tmp_path_factory):
    stamps = tmp_path_factory.mktemp("token-times")
    logs = tmp_path_factory.mktemp("token-path-logs")
    srv = Server(
        # torch threads on every CPU: the router and the client share them with the worker
        model_args(
            {"tiny": (model_factory("tiny"), "cpu:0")},
            1,
            "--worker-threads",
            str(len(os.sched_getaffinity(0))),
        ),
        logs / "serve.log",
        env={"PANTHEON_DEBUG_TOKEN_TIMES": str(stamps)},
    )
    try:
        srv.wait_ready(("tiny",))
        yield srv, stamps
    finally:
        srv.stop()


def _stamps(folder: Path, role: str) -> list[list[str]]:
    files = list(folder.glob(f"{role}-*.txt"))
    assert len(files) == 1, files
    return [line.split() for line in files[0].read_text().splitlines()]


def test_one_stream_token_by_token_in_order(traced):
    srv, folder = traced
    body = {
        "model": "tiny",
        "messages": MSG,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        buf = b""
        for data in r.iter_raw():
            buf += data
            *evs, buf = buf.split(b"\n\n")
            events += [e.removeprefix(b"data: ") for e in evs]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"

    steps = [s for s in _stamps(folder, "worker") if s[0] == "s"]
    router = _stamps(folder, "router")
    recvs = [float(s[1]) for s in router if s[0] == "r"]
    writes = [float(s[1]) for s in router if s[0] == "w"]
    # one step per token (the prefill gives the first), each sent alone, received once, in order
    assert [int(s[4]) for s in steps] == [1] * TOKENS
    assert len(recvs) == TOKENS
    starts, ends, before_send = ([float(s[i]) for s in steps] for i in (2, 3, 1))
    assert all(a <= b for a, b in zip(starts, ends))
    assert all(e <= n for e, n in zip(ends, starts[1:]))  # steps one after the other
    assert all(b <= r for b, r in zip(before_send, recvs))  # CLOCK_MONOTONIC: one clock for both
    assert recvs == sorted(recvs)
    # one chunk handed to hypercorn per event the client read, [DONE] included
    assert len(writes) == len(events)
