"""Models on demand (issue 24 §1-2): a real ``pantheon serve`` with a ``--models-dir`` catalog of
``tiny`` models, a broken GGUF beside them, a pinned start model, ``--models-max 2`` and a short
``--keep-alive``.

The tests run in order on one server (each leaves the state the next starts from): the catalog
is listed with statuses; a broken file is a 4xx and nothing else changes; a name the catalog
knows is never answered by another model, nor is an unknown one (the single-model shortcut is
for a server with one model, and this catalog holds several: issue 40 §6); two
concurrent first requests make one load; an alias loads its model; keep-alive expiry unloads;
at the count limit the idle model is evicted and not the busy one, a load waits for a busy one
to be idle, the pinned one stays; a request's ``keep_alive: 0`` unloads once it is done; a model
copied into the folder is served without a restart; with nothing that will free, the 507 says
what holds the room."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import time

import httpx
import pytest

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    base = tmp_path_factory.mktemp("ondemand")
    root = base / "models"
    root.mkdir()
    tiny = model_factory("tiny")
    for name in ("alpha", "beta", "gamma"):
        shutil.copytree(tiny, root / name)
    (root / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    start = base / "start"
    shutil.copytree(tiny, start)
    cfg = base / "pantheon.toml"
    cfg.write_text(
        f'models_dir = ["{root}"]\nmodels_max = 2\nkeep_alive = "3s"\n'
        f'[[models]]\npath = "{start}"\nname = "start"\npin = true\n'
        f'[[models]]\npath = "{root / "alpha"}"\nname = "alpha"\naliases = ["a"]\npreload = false\n'
    )
    s = Server(["--config", str(cfg)], base / "serve.log")
    try:
        s.wait_ready(("start",))
        s.root = root  # type: ignore[attr-defined]
        yield s
    finally:
        s.stop()


def _chat(s: Server, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": MSG, "max_tokens": 2, **kw}
    return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)


def _status(s: Server) -> dict[str, str]:
    data = httpx.get(s.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def _events(s: Server, kind: str, model: str) -> list[dict]:
    evs = httpx.get(s.url + "/admin/state", timeout=10).json()["events"]
    return [e for e in evs if e["kind"] == kind and e.get("model") == model]


def _until(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_the_catalog_is_listed_with_statuses(srv):
    data = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
    by = {m["id"]: m for m in data}
    assert [m["id"] for m in data][:2] == ["start", "alpha"]  # configured first
    assert {k: v["status"]["value"] for k, v in by.items()} == {
        "start": "loaded",
        "alpha": "unloaded",
        "beta": "unloaded",
        "gamma": "unloaded",
        "broken": "failed",
    }
    assert "broken.gguf" in by["broken"]["status"]["reason"]
    assert by["alpha"]["aliases"] == ["a"]
    one = httpx.get(srv.url + "/v1/models/a", timeout=10).json()  # by alias
    assert one["id"] == "alpha" and one["status"] == {"value": "unloaded"}
    # the dashboard's snapshot lists the same catalog (pinned: never expires)
    cat = {m["name"]: m for m in httpx.get(srv.url + "/admin/state", timeout=10).json()["catalog"]}
    assert {k: (v["status"], v["aliases"], v["pinned"], v["expires_in_s"]) for k, v in cat.items()} == {
        "start": ("loaded", [], True, None),
        "alpha": ("unloaded", ["a"], False, None),
        "beta": ("unloaded", [], False, None),
        "gamma": ("unloaded", [], False, None),
        "broken": ("failed", [], False, None),
    } and "broken.gguf" in cat["broken"]["reason"]


def test_a_broken_file_is_a_4xx_naming_it_and_changes_nothing(srv):
    r = _chat(srv, "broken")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "model_unavailable" and err["param"] == "model"
    assert "broken.gguf" in err["message"]
    assert _status(srv)["start"] == "loaded"
    assert _chat(srv, "start").status_code == 200


def test_no_name_takes_the_shortcut_in_a_catalog_of_several(srv):
    # one model resident, several in the catalog: an unknown name is a 404, not "start"'s answer
    r = _chat(srv, "no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    # two concurrent first requests for a catalog model: one load, both answered by it
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda _: _chat(srv, "beta"), range(2)))
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    assert {r.json()["model"] for r in got} == {"beta"}
    assert len(_events(srv, "loaded", "beta")) == 1
    assert len(_events(srv, "load_on_demand", "beta")) == 1
    # with two resident models too
    assert _chat(srv, "no-such-model").status_code == 404


def test_keep_alive_expiry_unloads_an_on_demand_model(srv):
    assert _status(srv)["beta"] == "loaded"
    assert _until(lambda: _status(srv)["beta"] == "unloaded"), _status(srv)
    assert _events(srv, "expired", "beta")
    assert _status(srv)["start"] == "loaded"  # named at start and pinned: stays


def test_an_alias_loads_its_model_and_the_count_limit_evicts_the_idle_one(srv):
    r = _chat(srv, "a", keep_alive=-1)  # alpha, kept for ever: only eviction can unload it
    assert r.status_code == 200 and r.json()["model"] == "alpha"
    # start (pinned) + alpha is the limit: gamma evicts alpha, the idle unpinned one
    r = _chat(srv, "gamma", keep_alive=-1)
    assert r.status_code == 200, r.text
    st = _status(srv)
    assert (st["start"], st["alpha"], st["gamma"]) == ("loaded", "unloaded", "loaded")
    (ev,) = _events(srv, "evicted", "alpha")
    assert "make room for gamma" in ev["message"]


def test_a_load_waits_for_a_busy_model_to_be_idle_then_evicts_it(srv):
    # gamma busy with a long stream: a request for beta waits for room (not a 507), and gets
    # it once gamma is idle
    started, stop = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": "gamma", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    th = threading.Thread(target=stream)
    th.start()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        try:
            assert started.wait(60)
            beta = ex.submit(_chat, srv, "beta")
            time.sleep(1.5)
            assert not beta.done(), beta.result().text  # it waits while gamma is busy
            st = _status(srv)
            assert (st["gamma"], st["beta"]) == ("loaded", "loading"), st
        finally:
            stop.set()
            th.join(60)
        r = beta.result(120)
    assert r.status_code == 200 and r.json()["model"] == "beta", r.text
    st = _status(srv)
    assert (st["start"], st["gamma"], st["beta"]) == ("loaded", "unloaded", "loaded"), st
    (ev,) = _events(srv, "evicted", "gamma")
    assert "make room for beta" in ev["message"]


def test_keep_alive_zero_unloads_once_done_and_a_new_folder_is_served(srv):
    r = _chat(srv, "gamma", keep_alive=0)
    assert r.status_code == 200
    assert _until(lambda: _status(srv)["gamma"] == "unloaded"), _status(srv)
    shutil.copytree(srv.root / "beta", srv.root / "delta")  # copied in while serving
    r = _chat(srv, "delta")
    assert r.status_code == 200 and r.json()["model"] == "delta"
    assert _status(srv)["delta"] == "loaded"


def test_a_request_for_a_model_the_admin_api_is_loading_waits_for_that_load(srv):
    before = len(_events(srv, "load_on_demand", "beta"))
    r = httpx.post(
        srv.url + "/admin/models/load",
        json={"path": str(srv.root / "beta"), "name": "beta", "wait": False},
        timeout=60,
    )
    assert r.status_code == 202, r.text
    r = _chat(srv, "beta")  # no second load: it waits for the admin's
    assert r.status_code == 200 and r.json()["model"] == "beta", r.text
    assert len(_events(srv, "load_on_demand", "beta")) == before
    # the admin's load made room by evicting delta, the idle on-demand model; start stays
    st = _status(srv)
    assert (st["start"], st["beta"], st["delta"]) == ("loaded", "loaded", "unloaded")


def test_with_nothing_that_will_free_the_507_names_what_holds_the_room(srv):
    # start (pinned) and beta (loaded by the admin API) hold --models-max 2: neither can go
    r = _chat(srv, "gamma")
    assert r.status_code == 507, r.text
    msg = r.json()["error"]["message"]
    assert "--models-max 2" in msg and "start#" in msg and "pinned" in msg, msg
    assert "beta#" in msg and "admin API" in msg, msg
    assert _status(srv)["gamma"] == "unloaded"
