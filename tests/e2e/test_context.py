"""A model's context is what its requests can really get (issue 16): the KV pool is sized from
the die's free memory, up to the full context, not capped at the --admit-ctx floor (8192)."""

from __future__ import annotations

import httpx
import pytest

from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(180)
LONG = 16384  # more than the 8192 that used to cap every model


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    long = model_factory("tiny", max_position_embeddings=LONG)
    s = Server(
        ["--model", str(long), "--name", "long", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("context") / "serve.log",
    )
    try:
        s.wait_ready(("long",))
        yield s
    finally:
        s.stop()


def test_models_advertises_the_full_context(srv):
    m = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
    assert m["max_model_len"] == LONG
    row = httpx.get(srv.url + "/admin/models", timeout=10).json()["data"][0]
    assert row["kv_pool_tokens"] >= LONG  # the pool holds one request of the full context


def test_a_request_past_8192_is_served(srv):
    # max_tokens past the old 8192 cap: accepted (stream, read the first chunk, go away)
    body = {"model": "long", "messages": MSG, "max_tokens": 12000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"error"' not in first


def test_past_the_real_limit_the_400_names_it(srv):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "long", "messages": MSG, "max_tokens": LONG + 100},
    )
    err = check_error(r, 400, param="max_tokens", code="context_length_exceeded")
    assert f"maximum context length is {LONG} tokens" in err["message"]


def test_a_die_without_room_for_the_full_context_gets_what_it_holds(model_factory, tmp_path):
    """A small die: the pool is what its free memory times --kv-fraction holds, and that is
    the limit /v1/models advertises and the 400 names (never less than --admit-ctx)."""
    long = model_factory("tiny", max_position_embeddings=LONG)
    s = Server(
        [
            "--model",
            str(long),
            "--name",
            "long",
            "--cpu-dies",
            "1",
            "--cpu-die-budget",
            "10MiB",
            "--admit-ctx",
            "1024",
            "--kv-fraction",
            "0.5",
        ],
        tmp_path / "small.log",
    )
    try:
        s.wait_ready(("long",))
        m = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]
        row = httpx.get(s.url + "/admin/models", timeout=10).json()["data"][0]
        limit = m["max_model_len"]
        assert 1024 <= limit < LONG and limit == min(LONG, row["kv_pool_tokens"]), (m, row)
        r = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=30,
            json={"model": "long", "messages": MSG, "max_tokens": limit + 10},
        )
        err = check_error(r, 400, param="max_tokens")
        assert f"maximum context length is {limit} tokens" in err["message"]
    finally:
        s.stop()


# Every "request does not fit the model" case is the client's 400 naming the numbers, on both
# routes (issue 26 §3); 503 stays for the server's own state. (route, extra body, param, the
# numbers the message says: "<N> in the <what>")
LONG_TEXT = "x " * 20000  # 20,001 tokens of the tiny tokenizer: past LONG alone
SYSTEM = [{"role": "system", "content": LONG_TEXT}, *MSG]  # a system message is never capped
NOT_FITTING = [
    ("chat", {"max_tokens": LONG - 4}, "max_tokens", f"{LONG - 4} in the completion"),  # not with the prompt
    ("chat", {"max_completion_tokens": LONG - 4}, "max_completion_tokens", f"{LONG - 4} in the completion"),
    ("chat", {"max_tokens": LONG - 4, "n": 2}, "max_tokens", f"{LONG - 4} in the completion"),  # per choice
    ("chat", {"max_tokens": LONG}, "max_tokens", f"{LONG} in the completion"),  # no context holds it
    ("chat", {"max_completion_tokens": LONG}, "max_completion_tokens", f"{LONG} in the completion"),
    ("chat", {"messages": SYSTEM}, "messages", "in the messages, 512 in the completion"),  # the prompt
    ("chat", {"messages": SYSTEM, "max_tokens": 8}, "max_tokens", "in the messages, 8 in the completion"),
    ("completions", {"max_tokens": LONG - 1}, "prompt", f"{LONG - 1} in the completion"),
    ("completions", {"max_tokens": LONG - 1, "n": 2}, "prompt", f"{LONG - 1} in the completion"),
    ("completions", {"max_tokens": LONG}, "max_tokens", f"{LONG} in the completion"),
    (
        "completions",
        {"prompt": LONG_TEXT, "max_tokens": 8},
        "prompt",
        "20001 in the prompt, 8 in the completion",
    ),
    ("completions", {"prompt": LONG_TEXT}, "prompt", "20001 in the prompt, 16 in the completion"),
    ("completions", {"prompt": LONG_TEXT, "echo": True, "max_tokens": 0}, "prompt", "20001 in the prompt"),
]


@pytest.mark.parametrize(("route", "extra", "param", "numbers"), NOT_FITTING)
def test_a_request_that_does_not_fit_is_a_400_naming_the_numbers(srv, route, extra, param, numbers):
    body: dict = {"model": "long"}
    if route == "chat":
        body["messages"] = MSG
    else:
        body["prompt"] = "Say something, and then something more."
    body.update(extra)
    r = httpx.post(f"{srv.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=30)
    err = check_error(r, 400, param=param, code="context_length_exceeded")
    assert f"This model's maximum context length is {LONG} tokens. However, you requested" in err["message"]
    assert numbers in err["message"], err["message"]
