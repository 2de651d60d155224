"""Speculative decoding through a real server: the ``speculative`` extension and the server's
``--speculative`` default, greedy output unchanged, and ``/admin/dies`` reporting it."""

from __future__ import annotations

import time

import httpx
import pytest

from helpers.serve import Server, greedy_completion

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    s = Server(
        ["--model", str(model_factory("tiny-llama")), "--name", "t", "--cpu-dies", "1", "--speculative", "3"],
        tmp_path_factory.mktemp("speculative") / "serve.log",
    )
    try:
        s.wait_ready(("t",))
        yield s
    finally:
        s.stop()


def speculation(s: Server, wait: bool = False) -> dict:
    """The instances' speculation figures; ``wait``: until the worker's next stats carry some."""
    deadline = time.monotonic() + (10 if wait else 0)
    while True:
        dies = httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]
        got = {k: v for d in dies for k, v in d["speculation"].items()}
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(0.2)


def test_greedy_text_is_the_same_with_and_without(srv):
    off = greedy_completion(srv, speculative=False)
    assert speculation(srv) == {}
    on = greedy_completion(srv, speculative=True)
    default = greedy_completion(srv)  # the server's --speculative 3
    assert on["choices"][0]["text"] == off["choices"][0]["text"] == default["choices"][0]["text"]
    assert on["usage"]["completion_tokens"] == 24
    stats = next(iter(speculation(srv, wait=True).values()))
    assert stats["verify_steps"] > 0 and stats["drafted"] >= stats["accepted"] >= 0
    assert 1.0 <= stats["tokens_per_step"] <= 5.0


def test_the_extension_is_a_bool(srv):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "t", "messages": [{"role": "user", "content": "hi"}], "speculative": "yes"},
        timeout=30,
    )
    assert r.status_code == 400 and "speculative" in r.text
