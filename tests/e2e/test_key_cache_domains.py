"""With API keys configured, each key is its own prefix-cache domain: ``cached_tokens`` tells a key
only about its own earlier prompts, never another key's (``pantheon/api/auth.py``). And a
constraint the worker could not enforce is a 400 that takes no slot (``structured.py``), on the
same keyed server.

One ``pantheon serve`` of the ``tiny`` model with ``PANTHEON_API_KEY=k-one,k-two``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from helpers.serve import Server, check_error, until

pytestmark = pytest.mark.timeout(240)

KEYS = ("k-one", "k-two")
# ~260 prompt tokens on the tiny model's tokenizer (asserted below)
PROMPT = " ".join(f"item{i} is {i * 7 % 13} apples and {i % 5} pears;" for i in range(17))


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    s = Server(
        ["--model", str(tiny_model), "--name", "tiny", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("keys") / "server.log",
        env={"PANTHEON_API_KEY": ",".join(KEYS)},
    )
    try:
        s.wait_ready(None)  # /v1/models needs a key
        until(
            lambda: httpx.get(s.url + "/admin/models", timeout=5).json()["data"][0]["state"] == "ready",
            what="the tiny model loaded",
        )
        yield s
    finally:
        s.stop()


def _ask(srv: Server, key: str, content: str = PROMPT, **extra) -> dict:
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
            "temperature": 0,
            **extra,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_a_key_sees_only_its_own_cached_prompts(srv):
    first = _ask(srv, KEYS[0])
    assert 250 <= first["prompt_tokens"] <= 300, first
    assert _cached(first) == 0, first  # nothing was cached before
    again = _ask(srv, KEYS[0])
    assert _cached(again) > 0, again  # the same key: its prefix is cached
    other = _ask(srv, KEYS[1])  # key two learns nothing of key one's prompt
    assert other["prompt_tokens"] == first["prompt_tokens"]
    assert _cached(other) == 0, other
    own = _ask(srv, KEYS[1])  # key two's own domain still caches
    assert _cached(own) > 0, own


def test_a_guess_of_the_first_half_tells_another_key_nothing(srv):
    secret = PROMPT.replace("pears", "figs")
    _ask(srv, KEYS[0], secret)
    assert _cached(_ask(srv, KEYS[0], secret[: len(secret) // 2] + " and then?")) > 0  # the same key: a hit
    guess = _ask(srv, KEYS[1], secret[: len(secret) // 2] + " and then?")
    assert guess["prompt_tokens"] > 100 and _cached(guess) == 0, guess


def test_the_same_cache_salt_does_not_join_two_keys(srv):
    salted = PROMPT.replace("apples", "plums")
    assert _cached(_ask(srv, KEYS[0], salted, cache_salt="shared")) == 0
    assert _cached(_ask(srv, KEYS[0], salted, cache_salt="shared")) > 0
    assert _cached(_ask(srv, KEYS[1], salted, cache_salt="shared")) == 0
    assert _cached(_ask(srv, KEYS[0], salted, cache_salt="other")) == 0  # a salt still splits a key


BIG_LARK = "start: " + " | ".join(json.dumps(f"w{i:05d}") for i in range(5500)) + "\n"
BIG_SCHEMA = {"type": "object", "properties": {f"p{i:03d}": {"type": "integer"} for i in range(2000)}}
RED_TEAM: list[tuple[dict, Any]] = [  # (body, the parameter its 400 names)
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_regex": "(.{1,100}){1,100}x"}, "guided_regex"),
    ({"guided_grammar": BIG_LARK}, "guided_grammar"),
    ({"guided_json": BIG_SCHEMA}, "guided_json"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}},
        "response_format.json_schema.schema",
    ),
]


def _instance(srv: Server) -> dict:
    return httpx.get(srv.url + "/admin/models", timeout=5).json()["data"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_unenforceable_constraints_are_400s_that_take_no_slot(srv, stream):
    _ask(srv, KEYS[0], "hi")  # one admitted request, so the counts below exist
    until(lambda: _instance(srv)["slots_busy"] == 0, what="no busy slot")
    before = _instance(srv)
    admitted = _admitted(srv)
    for body, param in RED_TEAM:
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEYS[0]}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body},
            timeout=60,
        )
        err = check_error(r, 400, param=param)
        assert "cannot be enforced" in err["message"], err
        assert len(r.content) < 2000  # the error does not quote the grammar
        now = _instance(srv)
        assert now["slots_busy"] == before["slots_busy"] == 0, now
        assert now["queue_depth"] == before["queue_depth"] == 0, now
    assert _admitted(srv) == admitted  # no request reached a slot, a queue or a worker


def _admitted(srv: Server) -> dict[str, float]:
    """The router's counts of requests that took a slot: finished, prompt tokens, queue time."""
    out = {}
    for line in httpx.get(srv.url + "/metrics", timeout=5).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (
            "vllm:request_success_total",
            "vllm:prompt_tokens_total",
            "vllm:request_queue_time_seconds_count",
        ):
            out[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    assert out, "no request counts in /metrics"
    return out


def test_the_worker_never_logs_a_whole_grammar(srv):
    log = srv.log.read_text(errors="replace")
    assert "w05499" not in log and "p1999" not in log  # no grammar written whole to any log
