"""A pathological chat template cannot freeze the router: a real ``pantheon serve`` with a
``tiny`` model whose template turns into a nested ``range()`` loop on request. Its render is a
400 naming the template and the bound, /health answers within 1 s meanwhile, SIGTERM still ends
the server promptly; a template that is costly on any conversation is refused at load (a 400)."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time

import httpx
import pytest

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(180)

SLOW = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
# costly only when a request asks for it: passes the load check, then stalls a request
ON_DEMAND = (
    "{% if stall %}"
    + SLOW
    + "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
)


def _with_template(src, dst, template: str):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    base = tmp_path_factory.mktemp("freeze")
    folder = _with_template(model_factory("tiny"), base / "stally", ON_DEMAND)
    s = Server(["--model", str(folder), "--name", "stally"], base / "serve.log")
    try:
        s.wait_ready(("stally",))
        yield s
    finally:
        s.stop()


def _health_gaps(s: Server, stop: threading.Event, gaps: list[float]) -> None:
    with httpx.Client(timeout=5) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            r = c.get(s.url + "/health")
            gaps.append(time.monotonic() - t0 if r.status_code == 200 else 99.0)
            time.sleep(0.02)


def test_a_stalling_render_is_a_400_naming_the_template_and_health_stays_live(srv):
    ok = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "stally", "messages": MSG, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    stop, gaps = threading.Event(), []
    poller = threading.Thread(target=_health_gaps, args=(srv, stop, gaps))
    poller.start()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            r = httpx.post(
                srv.url + "/v1/chat/completions",
                json={"model": "stally", "messages": MSG, "chat_template_kwargs": {"stall": True}},
                timeout=30,
            )
            took = time.monotonic() - t0
            assert r.status_code in (400, 422), r.text
            msg = r.json()["error"]["message"]
            assert "the chat template of stally (tokenizer_config.json)" in msg, msg
            assert "time bound" in msg, msg
            assert took < 3, took
    finally:
        stop.set()
        poller.join()
    assert len(gaps) >= 3
    assert max(gaps) < 1.0, gaps
    # nothing was taken: a normal request still runs at once
    again = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "stally", "messages": MSG, "max_tokens": 2},
        timeout=60,
    )
    assert again.status_code == 200, again.text


def test_a_costly_template_is_refused_at_load(srv, model_factory, tmp_path):
    bad = _with_template(model_factory("tiny"), tmp_path / "costly", SLOW)
    huge = _with_template(model_factory("tiny"), tmp_path / "huge", "{{ 'x' * 200000000 }}")
    for folder, bound in ((bad, "time"), (huge, "size")):
        t0 = time.monotonic()
        r = httpx.post(
            srv.url + "/admin/models/load", json={"path": str(folder), "name": folder.name}, timeout=60
        )
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert (
            f"the chat template of {folder.name} (tokenizer_config.json) exceeded its {bound} bound" in msg
        ), msg
        assert time.monotonic() - t0 < 5
        t1 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t1 < 1.0
    listed = {m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=5).json()["data"]}
    assert listed == {"stally"}


def test_sigterm_ends_the_server_during_stalling_renders(model_factory, tmp_path):
    folder = _with_template(model_factory("tiny"), tmp_path / "stally2", ON_DEMAND)
    s = Server(["--model", str(folder), "--name", "stally2"], tmp_path / "serve.log")
    try:
        s.wait_ready(("stally2",))
        stop = threading.Event()

        def hammer():
            with httpx.Client(timeout=5) as c:
                while not stop.is_set():
                    try:
                        c.post(
                            s.url + "/v1/chat/completions",
                            json={
                                "model": "stally2",
                                "messages": MSG,
                                "chat_template_kwargs": {"stall": True},
                            },
                        )
                    except httpx.HTTPError:
                        return

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for th in threads:
            th.start()
        time.sleep(1.0)  # renders are stalling now
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(10)
        finally:
            stop.set()
            for th in threads:
                th.join(10)
        assert s.proc.returncode is not None
        assert time.monotonic() - t0 < 10
    finally:
        s.stop()
