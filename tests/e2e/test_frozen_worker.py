"""A frozen worker (SIGSTOP) and the requests queued behind it.

A frozen worker is declared dead only when its heartbeat has been silent for
``--worker-dead-after``; a request queued behind it must not time out (429 ``queue_timeout``)
meanwhile, but wait for the death and the restart, as one queued behind a killed worker does.
Here the queue timeout (4 s) is shorter than the silence that declares the worker dead (6 s):
without the pause the queued request would get 429 before the death is even noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from pantheon.control.registry import Registry

from helpers.serve import MSG, Server, until

pytestmark = pytest.mark.timeout(150)

QUEUE_TIMEOUT_S = 4.0
DEAD_AFTER_S = 6.0


def _stream(url: str, body: dict, out: list, first: threading.Event) -> None:
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=90) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    out.append(data if data == "[DONE]" else json.loads(data))
                    if len(out) >= 3:
                        first.set()
    except httpx.HTTPError as e:
        out.append(e)
        first.set()


def test_a_request_queued_behind_a_frozen_worker_waits_for_the_restart(model_factory, tmp_path):
    s = Server(
        [
            "--model",
            str(model_factory("tiny")),
            "--name",
            "tiny",
            "--cpu-dies",
            "1",
            "--slots",
            "2",
            "--restart-backoff",
            "0.2",
            "--queue-timeout",
            str(QUEUE_TIMEOUT_S),
            "--worker-dead-after",
            str(DEAD_AFTER_S),
            "--kv-budget",
            "32MiB",
        ],
        tmp_path / "frozen.log",
    )
    pid = None
    try:
        s.wait_ready(("tiny",))
        pid = next(d for d in httpx.get(s.url + "/admin/dies").json()["data"] if d["die"] == "cpu:0")["pid"]
        long = {"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        streams: list[list] = [[], []]
        started = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=_stream, args=(s.url, long, streams[i], started[i]), daemon=True)
            for i in range(2)
        ]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started), streams
        # both slots are busy: this one waits in tiny's queue
        queued: dict = {}

        def post() -> None:
            t0 = time.monotonic()
            queued["r"] = httpx.post(
                s.url + "/v1/chat/completions",
                timeout=120,
                json={"model": "tiny", "messages": MSG, "max_tokens": 3},
            )
            queued["s"] = time.monotonic() - t0

        waiter = threading.Thread(target=post, daemon=True)
        waiter.start()
        until(
            lambda: any(
                m["model"] == "tiny" and m["depth"] == 1
                for m in httpx.get(s.url + "/admin/state").json()["queues"]
            ),
            10,
            "the request to queue",
        )
        os.kill(pid, signal.SIGSTOP)  # alive but silent: declared dead after DEAD_AFTER_S
        waiter.join(120)
        r = queued["r"]
        assert r.status_code == 200, r.text  # not 429 queue_timeout: it waited for the restart
        assert r.json()["model"] == "tiny" and r.json()["choices"][0]["message"]["content"] is not None
        # it outlived the queue timeout: the freeze, the death and the restart were waited out
        assert queued["s"] > QUEUE_TIMEOUT_S + 1, queued["s"]
        for t in threads:
            t.join(60)
        for ev in streams:  # the running streams ended with the death's error event
            assert ev[0] == 200 and ev[-1] == "[DONE]", ev[-3:]
            assert ev[-2]["error"]["code"] == "worker_died", ev[-2]
        d = next(d for d in httpx.get(s.url + "/admin/dies").json()["data"] if d["die"] == "cpu:0")
        assert d["alive"] and d["pid"] != pid
        tiny = next(i for i in httpx.get(s.url + "/admin/models").json()["data"] if i["name"] == "tiny")
        assert tiny["state"] == "ready" and tiny["restarts"] == 1
        assert "heartbeat" in tiny["last_error"], tiny["last_error"]  # died of silence
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        s.stop()


def test_the_queue_timeout_clock_stands_still_while_the_model_is_paused():
    """In process: the registry's queue clock counts only the time ``paused`` says is live."""

    async def main() -> None:
        reg = Registry(slots=2, queue_depth=4, queue_timeout_s=0.4)
        inst = reg.reserve("m", "/m", ("cpu:0",))
        reg.publish(inst)
        held = [await reg.acquire_slot("m"), await reg.acquire_slot("m")]
        assert held == [inst, inst]
        frozen = {"on": True}
        reg.paused = lambda name: name == "m" and frozen["on"]
        waiter = asyncio.ensure_future(reg.acquire_slot("m"))
        await asyncio.sleep(1.2)  # three times the timeout, all of it paused
        assert not waiter.done()
        frozen["on"] = False
        t0 = time.monotonic()
        with pytest.raises(Exception) as ei:
            await waiter
        assert getattr(ei.value, "code", None) == "queue_timeout"
        assert 0.3 <= time.monotonic() - t0 < 1.5
        # paused then granted: the slot goes to it
        frozen["on"] = True
        waiter = asyncio.ensure_future(reg.acquire_slot("m"))
        await asyncio.sleep(0.8)
        reg.leave(held[0])
        assert await asyncio.wait_for(waiter, 1.0) is inst

    asyncio.run(main())
