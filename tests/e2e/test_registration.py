"""Router registration with real ``pantheon serve`` processes and a small registry the test runs
(``http.server`` in a thread, on 127.0.0.1): register at startup, heartbeats with live load,
register/deregister on admin load/unload, deregister at shutdown; and serving unaffected when the
registry is slow or down.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(180)


class Registry:
    """Records every POST; ``delay`` makes it slow, ``close()`` makes it go away."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[tuple[float, str, dict]] = []
        self.delay = delay
        reg = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                reg.calls.append((time.monotonic(), self.path, json.loads(body or b"{}")))
                if reg.delay:
                    time.sleep(reg.delay)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def of(self, path: str, model: str | None = None) -> list[dict]:
        return [b for _, p, b in self.calls if p == path and (model is None or b.get("model_id") == model)]

    def wait_for(self, path: str, model: str, n: int = 1, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.of(path, model)
            if len(got) >= n:
                return got
            time.sleep(0.05)
        raise AssertionError(f"no {path} for {model} in {timeout} s: {self.calls[-10:]}")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def setup(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    logs = tmp_path_factory.mktemp("registration")
    good, slow = Registry(), Registry(delay=3.0)
    env = {
        "PANTHEON_REGISTRY_HEARTBEAT": "0.3",
        "PANTHEON_NODE_ID": "node-7",
        "PANTHEON_REGISTRY_TRANSPORT": "tcp",
    }
    main = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "1"],
        logs / "main.log",
        env={**env, "PANTHEON_REGISTRY_URL": good.url},
    )
    other = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "1"],
        logs / "slow.log",
        env={**env, "PANTHEON_REGISTRY_URL": slow.url + "/"},
    )
    try:
        main.wait_ready(("tiny",))
        other.wait_ready(("tiny",))
        yield {"main": main, "good": good, "other": other, "slow": slow}
    finally:
        main.stop()
        other.stop()
        good.close()
        slow.close()


def test_register_at_startup_and_heartbeat(setup):
    s, reg = setup["main"], setup["good"]
    first = reg.wait_for("/register", "tiny")[0]
    assert first == {
        "model_id": "tiny",
        "instance_id": f"127.0.0.1:{s.port}:tiny",
        "endpoint": f"http://127.0.0.1:{s.port}",
        "capacity": 8,
        "node_id": "node-7",
        "transport": "tcp",
        "max_model_len": first["max_model_len"],
    }
    assert first["max_model_len"] > 0
    beats = reg.wait_for("/heartbeat", "tiny", n=3)
    assert beats[0] == {
        "model_id": "tiny",
        "instance_id": f"127.0.0.1:{s.port}:tiny",
        "node_id": "node-7",
        "transport": "tcp",
        "capacity": 8,
        "busy": 0,
        "queued": 0,
    }
    times = [t for t, p, b in reg.calls if p == "/heartbeat"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) >= 2 and all(0.15 < g < 1.5 for g in gaps), gaps  # every ~0.3 s


def test_heartbeat_carries_live_load(setup):
    s, reg = setup["main"], setup["good"]
    with httpx.stream(
        "POST",
        s.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True},
    ) as r:
        it = r.iter_lines()
        next(line for line in it if line.startswith("data: "))
        n = len(reg.of("/heartbeat", "tiny"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(b["busy"] == 1 for b in reg.of("/heartbeat", "tiny")[n:]):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"no heartbeat with busy=1: {reg.of('/heartbeat', 'tiny')[n:]}")


def test_load_and_unload_register_and_deregister(setup, model_factory):
    s, reg = setup["main"], setup["good"]
    q = model_factory("tiny-qwen2")
    r = httpx.post(s.url + "/admin/models/load", json={"path": str(q), "name": "q2"}, timeout=120)
    assert r.status_code == 200, r.text
    got = reg.wait_for("/register", "q2")[0]
    assert got["instance_id"] == f"127.0.0.1:{s.port}:q2" and got["capacity"] == 8
    reg.wait_for("/heartbeat", "q2")
    r = httpx.post(s.url + "/admin/models/unload", json={"name": "q2"}, timeout=60)
    assert r.status_code == 200, r.text
    assert reg.wait_for("/deregister", "q2")[0] == {
        "model_id": "q2",
        "instance_id": f"127.0.0.1:{s.port}:q2",
        "node_id": "node-7",
    }
    assert not reg.of("/deregister", "tiny")


def test_slow_then_down_registry_never_slows_serving(setup):
    s, slow = setup["other"], setup["slow"]
    slow.wait_for("/register", "tiny")  # it is being answered, 3 s late each time

    def timed_chat() -> float:
        t0 = time.monotonic()
        r = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": MSG, "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    for _ in range(3):
        assert timed_chat() < 1.5
        t0 = time.monotonic()
        assert httpx.get(s.url + "/health").status_code == 200
        assert time.monotonic() - t0 < 0.5
    slow.close()  # now it is down: connections are refused
    time.sleep(1.0)
    for _ in range(3):
        assert timed_chat() < 1.5
    t0 = time.monotonic()
    assert s.stop() == 0  # the deregistration at shutdown gives up quickly
    assert time.monotonic() - t0 < 10
    assert "router registry" in s.output()  # the failure is logged


def test_deregister_at_shutdown(setup):
    s, reg = setup["main"], setup["good"]
    assert s.stop() == 0
    got = reg.of("/deregister", "tiny")
    assert got == [{"model_id": "tiny", "instance_id": f"127.0.0.1:{s.port}:tiny", "node_id": "node-7"}]
    last_beat = max(t for t, p, b in reg.calls if p == "/heartbeat" and b["model_id"] == "tiny")
    dereg = max(t for t, p, b in reg.calls if p == "/deregister" and b["model_id"] == "tiny")
    assert dereg >= last_beat  # nothing after the goodbye


def test_unset_sends_nothing():
    from pantheon.config.settings import build_config
    from pantheon.control.registration import from_config

    assert from_config(build_config({}, {}), object(), "127.0.0.1", 8000) is None
    cfg = build_config({}, {"PANTHEON_REGISTRY_URL": "http://127.0.0.1:9/x/"})
    assert cfg.ops.registry_url == "http://127.0.0.1:9/x"
    assert cfg.ops.node_id == "node0" and cfg.ops.registry_transport == "local"


def test_replicas_collapse_to_one_registration_with_summed_capacity(model_factory, tmp_path):
    """Two replicas of one name (one per CPU die) are one model to the registry: one
    registration, one instance id, and the capacity of both."""
    tiny = model_factory("tiny")
    reg = Registry()
    s = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "2", "--dies", "cpu:0"],
        tmp_path / "replicas.log",
        env={"PANTHEON_REGISTRY_HEARTBEAT": "0.2", "PANTHEON_REGISTRY_URL": reg.url},
    )
    try:
        s.wait_ready(("tiny",))
        assert reg.wait_for("/register", "tiny")[0]["capacity"] == 8
        r = httpx.post(
            s.url + "/admin/models/load",
            timeout=120,
            json={"path": str(tiny), "name": "tiny", "dies": ["cpu:1"]},
        )
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(b["capacity"] == 16 for b in reg.of("/heartbeat", "tiny")):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"no heartbeat with capacity 16: {reg.of('/heartbeat', 'tiny')[-3:]}")
        ids = {b["instance_id"] for p in ("/register", "/heartbeat") for b in reg.of(p, "tiny")}
        assert ids == {f"127.0.0.1:{s.port}:tiny"}
        assert not reg.of("/deregister", "tiny")  # the second replica replaced nothing
        registered = reg.of("/register", "tiny")
        assert registered and all(b["capacity"] in (8, 16) for b in registered), registered
    finally:
        s.stop()
        reg.close()
