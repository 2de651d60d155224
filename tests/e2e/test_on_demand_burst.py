"""A burst across more models than fit (issue 40 §2): a real ``pantheon serve`` with a
``--models-dir`` of four ``tiny`` models, ``--models-max 2`` and no ``--model``.

Only the configured models are served (the built-in default is not loaded beside them, so it
takes no room), and 16 requests at once over the four models are all answered, each by the
model it named: the loads that find no room wait, in order, for a model to be idle and evict it,
never a 507 while one will free. (``bench/on_demand.py --burst`` measures the same at size.)"""

from __future__ import annotations

import concurrent.futures
import shutil

import httpx
import pytest

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(300)

NAMES = ("m0", "m1", "m2", "m3")


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    base = tmp_path_factory.mktemp("burst")
    root = base / "models"
    root.mkdir()
    tiny = model_factory("tiny")
    for name in NAMES:
        shutil.copytree(tiny, root / name)
    # a generous queue timeout: the test is that every request waits its turn, not how fast a
    # shared 2-core host swaps models
    args = ["--models-dir", str(root), "--models-max", "2", "--cpu-dies", "1", "--queue-timeout", "120"]
    s = Server(args, base / "serve.log")
    try:
        s.wait_ready(())
        yield s
    finally:
        s.stop()


def _status(s: Server) -> dict[str, str]:
    data = httpx.get(s.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def test_only_the_configured_models_are_served(srv):
    assert _status(srv) == dict.fromkeys(NAMES, "unloaded")  # no built-in default beside them
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # ready to load on demand
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "nope", "messages": MSG}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_burst_over_more_models_than_fit_is_answered_in_full(srv):
    client = srv.client().with_options(timeout=240)

    def ask(name: str) -> str:
        r = client.chat.completions.create(model=name, messages=MSG, max_tokens=2)  # type: ignore[arg-type]
        return r.model

    asked = [NAMES[i % len(NAMES)] for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(len(asked)) as ex:
        answered = list(ex.map(ask, asked))  # a refusal (507, 429, 500) raises here
    assert answered == asked
    events = httpx.get(srv.url + "/admin/state", timeout=10).json()["events"]
    kinds = [e["kind"] for e in events]
    assert "evicted" in kinds and "load_failed" not in kinds, kinds
    assert sum(1 for v in _status(srv).values() if v == "loaded") <= 2
