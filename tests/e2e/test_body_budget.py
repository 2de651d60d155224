"""The router's bound on request-body bytes in flight (``--max-body-in-flight``) and the memory
it gives back, on a real ``pantheon serve`` with the ``tiny`` model:

- bodies whose declared ``Content-Length`` would take the bytes in flight past the bound get 503
  ``bodies_in_flight`` with ``Retry-After`` before their body is sent; a chunked body that grows
  past it gets the same 503; the admitted ones answer 200 (or 400 for bad JSON) once sent, and
  ``pantheon_body_bytes_in_flight`` (``/metrics``) shows the reservations, then 0;
- 10 concurrent 8 MB bodies grow the router's RSS, and most of that growth is handed back
  (``malloc_trim``) within seconds of the requests ending.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from email.message import Message

import httpx
import psutil
import pytest

from helpers.serve import Server, until

MAX_BODY = 9 << 20
IN_FLIGHT = 100 << 20
DECLARED = 9_000_000  # each held body: 11 fit under IN_FLIGHT (99 MB of 104.9), the 12th does not
MB = 1 << 20


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    logs = tmp_path_factory.mktemp("body-budget")
    s = Server(
        [
            "--model",
            str(tiny),
            "--name",
            "tiny",
            "--cpu-dies",
            "1",
            "--max-body",
            str(MAX_BODY),
            "--max-body-in-flight",
            str(IN_FLIGHT),
        ],
        logs / "serve.log",
    )
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def _in_flight(srv: Server) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(r"^pantheon_body_bytes_in_flight (\S+)$", text, re.M)
    assert m, "no pantheon_body_bytes_in_flight gauge"
    return float(m.group(1))


def _rejected(srv: Server) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(r'^pantheon_requests_rejected_total\{model_name="",status="503"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _body(size: int, valid: bool = True) -> bytes:
    """A chat request of exactly ``size`` bytes (the padding is JSON whitespace)."""
    obj = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    raw = obj.encode() if valid else b'{"model": "tiny", "messages": ['
    return b" " * (size - len(raw)) + raw


def _open(srv: Server, headers: dict[str, str]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall((head + "\r\n").encode())
    return s


def _answer(s: socket.socket) -> tuple[int, Message, bytes]:
    r = http.client.HTTPResponse(s)
    r.begin()
    data = r.read()
    s.close()
    return r.status, r.msg, data  # the headers, looked up case-insensitively


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_bodies_past_the_bound_get_503_and_the_count_returns_to_0(srv):
    assert _in_flight(srv) == 0
    rejected_before = _rejected(srv)  # /health's 503s while the model loaded count too
    held = [_open(srv, {"Content-Length": str(DECLARED)}) for _ in range(11)]
    bodies = [_body(DECLARED, valid=i != 0) for i in range(11)]  # the first is bad JSON: a 400
    for s, b in zip(held, bodies, strict=True):
        s.sendall(b[:1000])  # a first piece: the rest comes later
    # the 11 declared lengths are reserved (their headers reached the router first)
    until(lambda: _in_flight(srv) == 11 * DECLARED, 20, "11 reservations")

    # the 12th: 503 at once, before its body is sent
    over = _open(srv, {"Content-Length": str(DECLARED)})
    status, headers, data = _answer(over)
    assert status == 503, data[:300]
    assert headers.get("Retry-After") == "1"
    err = json.loads(data)["error"]
    assert err["code"] == "bodies_in_flight" and str(IN_FLIGHT) in err["message"], err

    # a chunked body is counted as it comes: its first 8 MB chunk goes past the bound
    ch = _open(srv, {"Transfer-Encoding": "chunked"})
    chunk = b" " * (8 * MB)
    ch.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    status, headers, data = _answer(ch)
    assert status == 503 and json.loads(data)["error"]["code"] == "bodies_in_flight", data[:300]
    assert headers.get("Retry-After") == "1"
    assert _in_flight(srv) == 11 * DECLARED  # the refused ones hold nothing

    # the held bodies finish: 400 for the bad one, 200 for the rest; nothing stays counted
    answers: list[int] = [0] * 11

    def finish(i: int) -> None:
        held[i].sendall(bodies[i][1000:])
        answers[i] = _answer(held[i])[0]

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [400] + [200] * 10, answers
    until(lambda: _in_flight(srv) == 0, 10, "the count back to 0")
    assert _rejected(srv) == rejected_before + 2  # the two refusals, once each


def test_memory_comes_back_after_10_concurrent_8_mb_bodies(srv):
    pid = srv.proc.pid
    payload = json.dumps(
        {
            "model": "tiny",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            "user": "x" * 8_000_000,  # parsed and kept as a string: the router's copies are real
        }
    ).encode()
    assert 8_000_000 < len(payload) < MAX_BODY
    small = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(srv.url + "/v1/chat/completions", json=small, timeout=60).status_code == 200
    assert psutil.Process(pid).cmdline()[1:4] == ["-m", "pantheon", "serve"]  # the router itself
    time.sleep(0.5)
    start = _rss(pid)
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    statuses: list[int] = []

    def post() -> None:
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            content=payload,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        statuses.append(r.status_code)

    posts = [threading.Thread(target=post) for _ in range(10)]
    for t in posts:
        t.start()
    for t in posts:
        t.join(180)
    stop.set()
    sampler.join()
    peak_rss = max(peak[0], _rss(pid))
    growth = peak_rss - start
    assert statuses == [200] * 10, statuses
    assert _in_flight(srv) == 0
    # the load was real: the router held at least half of the 80 MB sent at some point
    assert growth > 40 * MB, (start / MB, peak_rss / MB)
    # and at least half of the growth goes back within seconds (malloc_trim, at most every 2 s)
    deadline = time.monotonic() + 10
    end = _rss(pid)
    while peak_rss - end < growth / 2 and time.monotonic() < deadline:
        time.sleep(0.25)
        end = _rss(pid)
    print(f"router RSS: start {start / MB:.0f} MiB, peak {peak_rss / MB:.0f} MiB, end {end / MB:.0f} MiB")
    assert peak_rss - end >= growth / 2, (start / MB, peak_rss / MB, end / MB)
