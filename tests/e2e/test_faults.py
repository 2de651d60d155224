"""Failures that lose nothing, with a real ``pantheon serve``, real workers and real sockets.

One server: ``tiny`` on cpu:0 with 8 slots, quick restarts. In order:

- 8 clients leave mid-stream: every slot and KV block is free within a second, and the next 8
  requests are served;
- the request body fuzz (hypothesis) on chat, completions, responses and tokenize: no 5xx, no
  stream whose error a 400 should have been, no hang, and the server serves afterwards; integers
  past int64, long numeric keys, reserved template kwargs and foreign token ids, one by one: 400s
  naming the field, before any slot;
- kill -9 of the worker while 7 streams and one non-streamed request run and 4 more wait in
  the queue: each stream ends with one error event and ``[DONE]``, the non-streamed one gets
  503 with ``Retry-After``; the worker is killed again while it restarts; the queued requests
  complete once it is back; registry, slots and the die's memory account are exactly as before,
  and ``/admin/dies`` and ``/metrics`` count the two deaths and restarts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_backpressure import until

from helpers.openapi import check
from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(240)

LONG = {"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def fault(model_factory, tmp_path_factory):
    s = Server(
        [
            "--model",
            str(model_factory("tiny")),
            "--name",
            "tiny",
            "--cpu-dies",
            "1",
            "--restart-backoff",
            "0.2",
            "--queue-timeout",
            "90",
            "--kv-budget",
            "32MiB",
        ],  # room for 8 long streams at once
        tmp_path_factory.mktemp("faults") / "fault.log",
    )
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def state(s: Server) -> dict:
    return httpx.get(s.url + "/admin/state", timeout=10).json()


def die0(s: Server) -> dict:
    return next(d for d in httpx.get(s.url + "/admin/dies", timeout=10).json()["data"] if d["die"] == "cpu:0")


def idle(s: Server) -> bool:
    """No slot busy, no KV block held by a request, nothing queued or in flight."""
    snap = state(s)
    insts = [i for i in snap["instances"] if i["name"] == "tiny"]
    return (
        bool(insts)
        and all(
            i["state"] == "ready"
            and i["in_flight"] == 0
            and i["kv_blocks_used"] == 0
            and i["slots"]
            and all(sl["state"] == "idle" for sl in i["slots"])
            for i in insts
        )
        and all(q["depth"] == 0 for q in snap["queues"])
    )


def stream_into(url: str, body: dict, out: list, started: threading.Event) -> None:
    """One SSE response into ``out``: the status, then JSON events and "[DONE]"."""
    try:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                    if len(out) >= 3:
                        started.set()
    except httpx.HTTPError as e:
        out.append(e)
    finally:
        started.set()


def test_clients_that_leave_mid_stream_free_their_slots_at_once(fault):
    until(lambda: idle(fault), 30, "the server to be idle")
    responses = []
    with httpx.Client(timeout=60) as c:
        streams = [
            c.stream("POST", fault.url + "/v1/chat/completions", json={**LONG, "stream": True})
            for _ in range(8)
        ]
        for cm in streams:
            responses.append(cm.__enter__())
        # (the line iterators are kept: one that is collected closes its response)
        readers = [r.iter_lines() for r in responses]
        for lines in readers:  # a few chunks each: all 8 are decoding
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
        until(
            lambda: sum(sl["state"] != "idle" for i in state(fault)["instances"] for sl in i["slots"]) == 8,
            5,
            "all 8 slots to show busy",
        )
        for cm in streams:  # all 8 go away
            cm.__exit__(None, None, None)
    left = time.monotonic()
    until(lambda: idle(fault), 1.0 + 0.5, "the 8 slots and their KV blocks to be free")
    # (the half second on top: one /admin/state reflects the worker's Stats of 250 ms ago)
    assert time.monotonic() - left < 1.5
    done = []

    def short(i):
        done.append(
            httpx.post(
                fault.url + "/v1/chat/completions",
                timeout=60,
                json={"model": "tiny", "messages": MSG, "max_tokens": 4, "seed": i},
            ).status_code
        )

    threads = [threading.Thread(target=short, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert done == [200] * 8


# ---------------------------------------------------------------------- the request fuzz

# Integers past what the worker's wire (msgpack: 64 bits) or a float can hold, and the edges.
BIG_INTS = (2**63 - 1, 2**63, 2**64, -(2**63) - 1, -(2**64), 10**30, 10**400)
_big = st.one_of(st.sampled_from(BIG_INTS), st.integers(2**62, 2**70), st.integers(-(2**70), -(2**62)))
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    _big,
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
_content = st.one_of(
    st.text(max_size=40),
    _json,
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "x"]), "text": st.text(max_size=20)}
        ),
        max_size=2,
    ),
)
_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bogus"]),
            "content": _content,
        }
    ),
    _json,
)
# Token ids as JSON object keys (logit_bias): digits, up to 10**5000 (int() refuses past 4,300)
_id_key = st.one_of(
    st.integers(0, 5000).map(str),
    _big.map(lambda i: str(abs(i))),
    st.sampled_from(["1" + "0" * 5000, "9" * 4301, "0" * 30 + "7", "-1", "1e3", " 5"]),
    st.text(max_size=8),
)
_logit_bias = st.one_of(
    st.dictionaries(_id_key, st.one_of(st.integers(-100, 100), _scalar), min_size=1, max_size=3), _json
)
# The names the template renderer sets itself (pantheon.chat.template), and ordinary ones
_template_kwargs = st.one_of(
    st.dictionaries(
        st.one_of(
            st.sampled_from(["tools", "add_generation_prompt", "messages", "documents", "enable_thinking"]),
            st.text(max_size=8),
        ),
        _json,
        min_size=1,
        max_size=3,
    ),
    _json,
)
_int_field = st.one_of(st.integers(-3, 100), _big, _scalar)
# Every field of CreateChatCompletionRequest that we read, each with good and bad values;
# max_tokens stays small (or wrong) so that no example generates for long.
FIELDS = {
    "model": st.one_of(st.just("tiny"), _scalar),
    "messages": st.one_of(st.lists(_message, min_size=1, max_size=3), _json),
    "stream": st.one_of(st.booleans(), _scalar),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": _scalar}), _json),
    "temperature": st.one_of(st.floats(-1, 3), _scalar),
    "top_p": st.one_of(st.floats(-0.5, 1.5), _scalar),
    "top_k": _int_field,
    "repetition_window": _int_field,
    "min_p": _scalar,
    "n": st.one_of(st.integers(-1, 3), _scalar),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), _scalar),
    "seed": st.one_of(_big, _scalar),
    "logprobs": _scalar,
    "top_logprobs": st.one_of(st.integers(-1, 25), _scalar),
    "presence_penalty": _scalar,
    "frequency_penalty": _scalar,
    "repetition_penalty": _scalar,
    "logit_bias": _logit_bias,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}), _json
    ),
    "tools": st.one_of(
        st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": _json}), max_size=2), _json
    ),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), _json),
    "user": _scalar,
    "ignore_eos": _scalar,
    "min_tokens": st.one_of(st.integers(-1, 4), _big, _scalar),
    "chat_template_kwargs": _template_kwargs,
}
_max_tokens = st.one_of(st.integers(-2, 6), st.none(), st.text(max_size=3), st.booleans(), st.floats(0, 6))


# The completion API's prompt: text, token ids (in and out of the tiny model's vocabulary of
# 4032, past int64), or anything
_prompt = st.one_of(
    st.text(max_size=20),
    st.lists(st.one_of(st.integers(0, 4100), _big, st.integers(-3, -1)), min_size=1, max_size=4),
    st.lists(st.integers(4000, 4100), min_size=1, max_size=2),  # about the vocabulary's end
    _json,
)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize")


@st.composite
def bodies(draw):
    keys = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=8))
    body = {k: draw(FIELDS[k]) for k in keys}
    body.setdefault("model", "tiny")
    body.setdefault("messages", MSG)
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(_max_tokens)
    if not isinstance(body.get("max_tokens", 1), int) or not isinstance(
        body.get("max_completion_tokens", 1), int
    ):
        body["max_tokens"] = 4  # a wrong-typed limit must not leave the other one unbounded
    return body


# One or two of the fields that reach the worker or the template, each with a value that must
# be a 400 (or pass), on a body that is otherwise valid: among arbitrary fields most of these
# would be refused for another field first.
HAZARDS = {
    "top_k": _big,
    "repetition_window": _big,
    "min_tokens": _big,
    "seed": _big,
    "temperature": _big,
    "logit_bias": st.dictionaries(_id_key, st.integers(-100, 100), min_size=1, max_size=2),
    "chat_template_kwargs": _template_kwargs,
}


# a completion prompt's ids about the end of the tiny model's vocabulary (4032), or past int64
_hazard_prompt = st.lists(st.one_of(st.integers(4000, 4100), _big), min_size=1, max_size=2)


@st.composite
def hazardous(draw):
    keys = draw(st.sets(st.sampled_from(sorted(HAZARDS)), max_size=2))
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3, "stream": draw(st.booleans())}
    body["prompt"] = draw(_hazard_prompt)  # (the completion route's; dropped elsewhere)
    return {**body, **{k: draw(HAZARDS[k]) for k in keys}}


@st.composite
def requests(draw):
    """(route, body): a chat body, or the same fields in the shape of another route."""
    route = draw(st.sampled_from(ROUTES))
    body = draw(st.one_of(bodies(), bodies(), hazardous()))
    hazard_prompt = body.pop("prompt", None)
    if route == "/v1/completions":
        del body["messages"]
        body["prompt"] = draw(_prompt) if hazard_prompt is None else hazard_prompt
        body["max_tokens"] = body.pop("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(body["max_tokens"], int):  # its default is 16: bounded either way
            body["max_tokens"] = 4
    elif route == "/v1/responses":
        msgs = body.pop("messages")
        body["input"] = draw(st.one_of(st.just(msgs), st.text(max_size=20), _json))
        body["max_output_tokens"] = body.pop("max_completion_tokens", body.pop("max_tokens", 4))
        if not isinstance(body["max_output_tokens"], int) or body["max_output_tokens"] > 6:
            body["max_output_tokens"] = 4  # unread when wrong: it must not leave the output unbounded
    elif route == "/tokenize":
        body = {k: body[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in body}
        if draw(st.booleans()):
            body["add_generation_prompt"] = draw(st.one_of(st.booleans(), _scalar))
    return route, body


def _events(route: str, text: str) -> list[dict]:
    """An SSE body's JSON events (checked to end as the route ends a stream)."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    datas = [next(ln[6:] for ln in b.split("\n") if ln.startswith("data: ")) for b in blocks]
    if route == "/v1/responses":
        evs = [json.loads(d) for d in datas]
        assert evs and evs[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
        return evs
    assert datas and datas[-1] == "[DONE]", text[-300:]
    return [json.loads(d) for d in datas[:-1]]


def test_fuzzed_request_bodies_never_get_a_5xx(fault):
    """Chat, completions, responses and tokenize bodies: never a 5xx, and a stream's error is
    never a request error that a 400 should have answered before it started."""
    seen: dict[int, int] = {}
    with httpx.Client(base_url=fault.url, timeout=30) as c:

        @settings(
            max_examples=int(os.environ.get("PANTHEON_FUZZ_EXAMPLES", "150")),
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(requests())
        def one(route_body):
            route, body = route_body
            try:
                raw = json.dumps(body).encode()
            except (TypeError, ValueError):
                return
            r = c.post(route, content=raw, headers={"content-type": "application/json"})
            text = r.read().decode(errors="replace")
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, route, body, text)
            if r.status_code >= 400:
                check("ErrorResponse", json.loads(text))
            elif r.headers["content-type"].startswith("text/event-stream"):
                for ev in _events(route, text):
                    err = (
                        ev.get("error") if route != "/v1/responses" else ev if ev["type"] == "error" else None
                    )
                    if err:  # an in-stream error: never a crash, never the worker refusing the request
                        assert err["code"] not in ("internal_error", "invalid"), (route, body, ev)

        one()
    # both sides were explored (the exact split varies with hypothesis's generation)
    assert seen.get(200, 0) >= 3 and sum(v for k, v in seen.items() if k >= 400) >= 10, seen
    until(lambda: idle(fault), 10, "the fuzzed requests to let go of every slot")
    r = httpx.post(
        fault.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": MSG, "max_tokens": 3},
    )
    assert r.status_code == 200, r.text


_CASES = [  # (a field that reaches the worker or the template, its value, the param named)
    ({"logit_bias": {"1" + "0" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {str(2**64): 1}}, "logit_bias"),
    ({"logit_bias": {"4032": 1}}, "logit_bias"),  # the tiny model's vocabulary ends at 4031
    ({"top_k": 2**64}, "top_k"),
    ({"repetition_window": 2**64}, "repetition_window"),
    ({"min_tokens": 2**63}, "min_tokens"),
    ({"temperature": 10**400}, "temperature"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    (
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs.add_generation_prompt",
    ),
]


def _shaped(route: str, extra: dict, stream: bool) -> dict:
    if route == "/v1/completions":
        return {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": stream, **extra}
    if route == "/v1/responses":
        return {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": stream, **extra}
    if route == "/tokenize":
        return {"model": "tiny", "messages": MSG, **extra}
    return {"model": "tiny", "messages": MSG, "max_tokens": 2, "stream": stream, **extra}


def test_big_numbers_reserved_kwargs_and_foreign_ids_are_400s_before_any_slot(fault):
    """Each case on each route that reads it, streamed or not: a 400 naming the field, as an
    OpenAI error body, not a 500 and not a 200 stream with an error event; no slot is taken."""
    until(lambda: idle(fault), 30, "the server to be idle")
    served0 = sum(i["served"] for i in httpx.get(fault.url + "/admin/models", timeout=10).json()["data"])
    cases = [
        (route, extra, param, stream)
        for extra, param in _CASES
        for route in ROUTES
        if route != "/tokenize" or "chat_template_kwargs" in extra
        if route != "/v1/completions" or "chat_template_kwargs" not in extra  # not read there
        for stream in ((False,) if route == "/tokenize" else (False, True))
    ]
    cases += [
        ("/v1/completions", {"prompt": ids}, "prompt", stream)
        for ids in ([1, 4032], [2**63 - 1], [2**64])
        for stream in (False, True)
    ]
    with httpx.Client(base_url=fault.url, timeout=30) as c:
        for route, extra, param, stream in cases:
            r = c.post(route, json=_shaped(route, extra, stream))
            assert r.status_code == 400, (route, extra, stream, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith("application/json"), (route, extra)
            err = r.json()
            check("ErrorResponse", err)
            assert err["error"]["param"] == param, (route, extra, err)
        # the same route and fields, in range, are served
        for route in ROUTES:
            ok = _shaped(route, {"logit_bias": {"4031": 1}, "top_k": 2**63 - 1}, False)
            if route == "/tokenize":
                ok = _shaped(route, {"chat_template_kwargs": {"enable_thinking": False}}, False)
            r = c.post(route, json=ok)
            assert r.status_code == 200, (route, r.text[:300])
        r = c.post("/v1/completions", json=_shaped("/v1/completions", {"prompt": [1, 4031]}, True))
        assert r.status_code == 200 and "[DONE]" in r.text and '"error"' not in r.text, r.text[-300:]
    # (the last answer's slot and blocks show free once the worker's next stats arrive)
    until(lambda: idle(fault), 10, "the served requests to let go of every slot")
    served = sum(i["served"] for i in httpx.get(fault.url + "/admin/models", timeout=10).json()["data"])
    assert served == served0 + 4, (served0, served)  # only the 4 good requests took a slot


# ---------------------------------------------------------------------- kill -9


def accounts(s: Server) -> tuple:
    """What a death and recovery must leave as it was: instances, bookings, slots."""
    rows = sorted(
        (r["instance"], r["name"], r["state"], tuple(r["dies"]))
        for r in httpx.get(s.url + "/admin/models", timeout=10).json()["data"]
    )
    d = die0(s)
    snap = [(i["id"], len(i["slots"]), i["kv_blocks_total"]) for i in state(s)["instances"]]
    return rows, d["bookings"], d["used_bytes"], snap


def test_kill_9_during_8_requests_then_again_during_the_restart(fault):
    until(lambda: idle(fault), 30, "the server to be idle")
    before = accounts(fault)
    d = die0(fault)
    pid, deaths0, restarts0 = d["pid"], d["deaths"], d["restarts"]
    # 7 streams and 1 non-streamed request fill the 8 slots ...
    outs = [[] for _ in range(7)]
    started = [threading.Event() for _ in range(7)]
    threads = [
        threading.Thread(target=stream_into, args=(fault.url, LONG, outs[i], started[i])) for i in range(7)
    ]
    plain: list = []

    def post(body, into):
        into.append(httpx.post(fault.url + "/v1/chat/completions", json=body, timeout=150))

    threads.append(threading.Thread(target=post, args=(LONG, plain)))
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    until(
        lambda: sum(sl["state"] != "idle" for i in state(fault)["instances"] for sl in i["slots"]) == 8,
        30,
        "all 8 slots to be busy",
    )
    # ... and 4 more wait in the queue
    queued: list = []
    waiters = [
        threading.Thread(
            target=post, args=({"model": "tiny", "messages": MSG, "max_tokens": 3, "seed": i}, queued)
        )
        for i in range(4)
    ]
    for t in waiters:
        t.start()
    until(lambda: sum(q["depth"] for q in state(fault)["queues"]) == 4, 30, "4 queued requests")

    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a client hung after the worker died"
    for ev in outs:  # each stream: 200, chunks, one error event, [DONE]
        assert ev[0] == 200 and ev[-1] == "[DONE]", ev[-3:]
        check("ErrorResponse", ev[-2])
        assert ev[-2]["error"]["code"] == "worker_died", ev[-2]
        assert not any("error" in e for e in ev[1:-2] if isinstance(e, dict))
    r = plain[0]
    assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text)
    assert r.json()["error"]["code"] == "worker_died"
    # the client is told the request id, not the worker's pid or output (those are logged)
    for e in [ev[-2] for ev in outs] + [r.json()]:
        msg = e["error"]["message"]
        assert "request id chatcmpl-" in msg and str(pid) not in msg and "SIG" not in msg, msg

    # the second kill, while the die restarts (a new pid up, its model not yet back)
    second = until(lambda: (p := die0(fault)["pid"]) not in (None, pid) and p, 30, "the restarted worker")
    os.kill(second, signal.SIGKILL)
    for t in waiters:
        t.join(120)
        assert not t.is_alive(), "a queued request hung"
    assert [q.status_code for q in queued] == [200] * 4, [q.text for q in queued]
    for q in queued:
        check("CreateChatCompletionResponse", q.json())

    until(lambda: idle(fault), 30, "the restarted model to be ready and idle")
    d = die0(fault)
    assert d["alive"] and d["pid"] not in (pid, second)
    assert d["deaths"] == deaths0 + 2 and d["restarts"] == restarts0 + 2, d
    assert "SIGKILL" in d["last_death"]["reason"] and d["last_death"]["at"] > 0
    assert accounts(fault) == before  # same instance, same bookings, same slots and KV pool
    metrics = httpx.get(fault.url + "/metrics").text
    assert f'pantheon_worker_restarts{{die="cpu:0"}} {restarts0 + 2}.0' in metrics
    assert f'pantheon_worker_deaths_total{{die="cpu:0"}} {deaths0 + 2}.0' in metrics
    r = httpx.post(
        fault.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": MSG, "max_tokens": 3},
    )
    assert r.status_code == 200, r.text


def test_the_restart_limit_trips_within_its_window(model_factory, tmp_path):
    """``--worker-restarts 1``: the first death is restarted, the second (in the window) is not:
    the die is failed, its model too, and requests get a 503 that says so, with no Retry-After
    (nothing will bring the model back by itself: "retry shortly" would be a promise it cannot
    keep), without or with the model's name."""
    s = Server(
        [
            "--model",
            str(model_factory("tiny")),
            "--name",
            "tiny",
            "--cpu-dies",
            "1",
            "--worker-restarts",
            "1",
            "--restart-backoff",
            "0.2",
            "--queue-timeout",
            "5",
        ],
        tmp_path / "limit.log",
    )
    try:
        s.wait_ready(("tiny",))
        first = die0(s)["pid"]
        os.kill(first, signal.SIGKILL)
        until(
            lambda: (
                die0(s)["alive"]
                and die0(s)["pid"] != first
                and httpx.get(s.url + "/health", timeout=5).status_code == 200
            ),
            60,
            "the restart",
        )
        assert "death 1 of at most 1" in s.output()
        os.kill(die0(s)["pid"], signal.SIGKILL)
        until(lambda: die0(s)["failed"], 30, "the die to be failed")
        time.sleep(1.0)  # no restart comes
        d = die0(s)
        assert not d["alive"] and d["restarts"] == 1 and d["deaths"] == 2, d
        rows = httpx.get(s.url + "/admin/models", timeout=10).json()["data"]
        assert [r["state"] for r in rows if r["name"] == "tiny"] == ["failed"]
        for body in ({"model": "tiny"}, {}):
            r = httpx.post(
                s.url + "/v1/chat/completions",
                timeout=30,
                json={**body, "messages": MSG, "max_tokens": 2},
            )
            err = check_error(r, 503, code="model_failed")
            assert "retry-after" not in r.headers, r.headers
            assert "no more restarts" in err["message"] and "will not come back" in err["message"], err
        assert "died 2 times in 10 min (--worker-restarts 1): the die stays failed" in s.output()
    finally:
        s.stop()
