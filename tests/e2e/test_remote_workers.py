"""Workers on other hosts, on loopback TCP with real CURVE keys (``pantheon keys new``): two
``pantheon worker --router`` processes join one router and serve; a worker with a key the router
does not know is refused, and both sides say so; ``kill -9`` of one remote worker fails its
model cleanly while the other keeps serving, and it comes back when the worker joins again; a
router restart finds the workers again, with nothing loaded twice.

The tests of this module run in order on one router and two workers (each test leaves them as
the next one expects). Timings are short on purpose: ``--worker-dead-after 3`` and the workers'
``--router-timeout 3``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from helpers.paths import REPO_ROOT
from helpers.serve import MSG, Server, check_error, until

GiB = 1 << 30


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys(folder, *workers: str) -> str:
    for w in workers:
        subprocess.run(
            [sys.executable, "-m", "pantheon", "keys", "new", str(folder), "--worker", w],
            check=True,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            capture_output=True,
        )
    return str(folder)


class RemoteWorker:
    """A ``pantheon worker --router tcp://...`` process, as an operator starts one on another host."""

    def __init__(self, endpoint: str, name: str, keys: str, key: str, log):
        self.name, self.log = name, log
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pantheon", "worker", "--router", endpoint, "--die", "cpu:0"]
            + ["--name", name, "--curve-dir", keys, "--key", key, "--budget-bytes", str(2 * GiB)]
            + ["--threads", "1", "--router-timeout", "3"],
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"),
            stdout=self._fh,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._fh.close()


def _router(tiny, listen: str, keys: str, log, *extra: str) -> Server:
    return Server(
        ["--model", str(tiny), "--name", "tiny", "--dies", "cpu:0", "--cpu-dies", "1"]
        + ["--worker-listen", listen, "--curve-dir", keys, "--worker-dead-after", "3", "--queue-timeout", "3"]
        + list(extra),
        log,
    )


def dies(s: Server) -> dict[str, dict]:
    return {d["die"]: d for d in httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]}


def models(s: Server) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(s.url + "/admin/models", timeout=10).json()["data"]}


def joined(s: Server, *workers: str) -> dict[str, dict] | None:
    """``/admin/dies`` once the dies of ``workers`` are alive, else None."""
    d = dies(s)
    return d if all(d.get(f"cpu:0@{w}", {}).get("alive") for w in workers) else None


def chat(s: Server, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": MSG, "max_tokens": 4, **kw}
    return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)


def _in_state(s: Server, name: str, state: str) -> dict | None:
    m = models(s)[name]
    return m if m["state"] == state else None


@pytest.fixture(scope="module")
def site(model_factory, tmp_path_factory):
    """One router listening for remote workers, and two workers (w1, w2) joined to it."""
    tmp = tmp_path_factory.mktemp("remote")
    keys = _keys(tmp / "keys", "w1", "w2")
    listen = f"tcp://127.0.0.1:{_port()}"
    tiny = model_factory("tiny")
    env = {"tiny": tiny, "keys": keys, "listen": listen, "tmp": tmp}
    env["router"] = _router(tiny, listen, keys, tmp / "router.log")
    env["router"].wait_ready(("tiny",))
    env["w1"] = RemoteWorker(listen, "w1", keys, "w1", tmp / "w1.log")
    env["w2"] = RemoteWorker(listen, "w2", keys, "w2", tmp / "w2.log")
    yield env
    for k in ("w1", "w2"):
        env[k].stop()
    env["router"].stop()


def test_two_remote_workers_join_and_serve(site):
    s = site["router"]
    got = until(lambda: joined(s, "w1", "w2"), timeout=60, what="both workers to join")
    for w in ("w1", "w2"):
        row = got[f"cpu:0@{w}"]
        assert row["remote"] is True and row["host"] == socket.gethostname()
        assert row["pid"] == site[w].proc.pid
        assert row["total_bytes"] == 2 * GiB  # its own budget, not the router's
    assert got["cpu:0"]["remote"] is False
    # the dashboard's snapshot names each remote die's machine too
    dies = {d["id"]: d for d in httpx.get(s.url + "/admin/state").json()["dies"]}
    assert dies["cpu:0@w1"]["host"] == dies["cpu:0@w2"]["host"] == socket.gethostname()
    assert dies["cpu:0"]["host"] is None
    # w2's host keeps the weights elsewhere: the load names that path for the worker
    copy = site["tmp"] / "w2-models" / "tiny"
    shutil.copytree(site["tiny"], copy)
    for w, extra in (("w1", {}), ("w2", {"worker_path": str(copy)})):
        r = httpx.post(
            s.url + "/admin/models/load",
            json={"path": str(site["tiny"]), "name": f"r-{w}", "dies": [f"cpu:0@{w}"], **extra},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["dies"] == [f"cpu:0@{w}"]
    assert f"from {copy}" in site["w2"].output()
    for w in ("w1", "w2"):
        r = chat(s, f"r-{w}")
        assert r.status_code == 200, r.text
        assert r.headers["X-Pantheon-Instance"] == models(s)[f"r-{w}"]["instance"]
    # a remote die nobody joined as is a 400 naming it, and changes nothing
    before = models(s)
    r = httpx.post(
        s.url + "/admin/models/load",
        json={"path": str(site["tiny"]), "name": "nope", "dies": ["cpu:0@nobody"]},
        timeout=30,
    )
    check_error(r, 400, param="dies", code="no_such_die")
    assert "cpu:0@nobody" in r.json()["error"]["message"]
    assert models(s).keys() == before.keys()


def test_a_worker_with_an_unknown_key_is_refused_on_both_sides(site, tmp_path):
    stranger = _keys(tmp_path / "stranger", "w9")  # its own keys: the router never authorized w9
    with open(os.path.join(site["keys"], "server.key"), "rb") as src:  # it does know the router
        with open(os.path.join(stranger, "server.key"), "wb") as dst:
            dst.write(src.read())
    w = RemoteWorker(site["listen"], "w9", stranger, "w9", tmp_path / "w9.log")
    try:
        assert w.proc.wait(60) == 5  # protocol.EXIT_REFUSED
    finally:
        w.stop()
    assert "refused our CURVE key" in w.output()
    until(
        lambda: "refused a worker: its CURVE public key" in site["router"].output(),
        what="the router's log line",
    )
    assert "cpu:0@w9" not in dies(site["router"])


def test_kill_9_of_one_remote_worker_while_the_other_serves(site):
    s = site["router"]
    stop, results = threading.Event(), []

    def traffic() -> None:  # r-w2 keeps streaming while w1 dies
        while not stop.is_set():
            body = {"model": "r-w2", "messages": MSG, "max_tokens": 8, "stream": True}
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            results.append((r.status_code, lines))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        os.kill(site["w1"].proc.pid, signal.SIGKILL)
        site["w1"].proc.wait()
        row = until(lambda: _in_state(s, "r-w1", "failed"), timeout=20, what="r-w1 to fail")
        assert "cpu:0@w1" in row["error"]
        # its requests fail cleanly (503, after the queue timeout, while it waits for its worker)
        r = chat(s, "r-w1")
        assert r.status_code == 503, r.text
        assert not dies(s)["cpu:0@w1"]["alive"]
        # the worker comes back (an operator or systemd restarts it): its model is offered again
        site["w1"] = RemoteWorker(site["listen"], "w1", site["keys"], "w1", site["tmp"] / "w1b.log")
        back = until(lambda: _in_state(s, "r-w1", "ready"), timeout=90, what="r-w1 to be reloaded")
        assert back["restarts"] == 1
        assert chat(s, "r-w1").status_code == 200
    finally:
        stop.set()
        t.join(60)
    assert len(results) >= 3
    for status, lines in results:
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-2:]
        assert not any('"error":' in x for x in lines), lines


def test_router_restart_workers_join_again_with_nothing_loaded_twice(site):
    site["router"].stop()
    pids = {w: site[w].proc.pid for w in ("w1", "w2")}
    # the new router is told to serve r-w1 on w1's die: it waits for w1 to join again
    s = site["router"] = _router(
        site["tiny"],
        site["listen"],
        site["keys"],
        site["tmp"] / "router2.log",
        "--model",
        str(site["tiny"]),
        "--name",
        "r-w1",
        "--dies",
        "cpu:0@w1",
    )
    s.wait_ready(("tiny", "r-w1"), timeout=120)
    got = until(lambda: joined(s, "w1", "w2"), timeout=60, what="both workers to join the new router")
    for w in ("w1", "w2"):
        assert got[f"cpu:0@{w}"]["pid"] == pids[w]  # the same processes: they re-registered
        assert site[w].proc.poll() is None
    # each dropped what the old router had loaded before it said Hello again
    assert "dropping 1 model(s) and saying Hello again" in site["w1"].output()
    assert "dropping 1 model(s) and saying Hello again" in site["w2"].output()
    assert list(got["cpu:0@w1"]["bookings"]) == [models(s)["r-w1"]["instance"]]
    assert got["cpu:0@w2"]["bookings"] == {}
    assert chat(s, "r-w1").status_code == 200
