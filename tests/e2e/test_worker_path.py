"""An admin load's ``worker_path`` end to end: a router with ``--models-dir ROOT`` that listens
for remote workers, and one ``pantheon worker --router`` (w1) on loopback TCP with CURVE keys.

- ``worker_path`` is checked like ``path``: outside ROOT is a 403 naming ``worker_path`` whose
  message is the same whether or not the folder exists; a NUL byte or an over-long value is a
  400 naming it (``path`` too).
- It applies to remote dies only: a load placed on a local die (named, or placed there) is a 400,
  and nothing is loaded or booked.
- It must hold the model ``path`` describes: a folder of another vocabulary is unloaded and
  refused (400 naming ``worker_path``); the same model in another folder loads and serves.

The tests run in order on one router (the worker joins in the third).
"""

from __future__ import annotations

import shutil

import httpx
import pytest
from test_remote_workers import RemoteWorker, _keys, _port, _router, chat, joined, models

from helpers.serve import check_error, until

pytestmark = pytest.mark.timeout(180)
TINY_VOCAB_EXTRA = 64  # the "other" model: the tiny preset with a larger vocabulary


@pytest.fixture(scope="module")
def site(model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker-path")
    root = tmp / "root"
    root.mkdir()
    tiny = model_factory("tiny")
    shutil.copytree(tiny, root / "tiny")
    shutil.copytree(tiny, root / "tiny-copy")
    from makemodel.families.common import TINY_VOCAB

    other = model_factory("tiny", vocab_size=TINY_VOCAB + TINY_VOCAB_EXTRA)
    shutil.copytree(other, root / "other")
    deeper = model_factory("tiny", num_hidden_layers=3)  # the same vocabulary, another shape
    shutil.copytree(deeper, root / "deeper")
    outside = tmp / "outside"
    shutil.copytree(tiny, outside)
    keys = _keys(tmp / "keys", "w1")
    listen = f"tcp://127.0.0.1:{_port()}"
    s = _router(tiny, listen, keys, tmp / "router.log", "--models-dir", str(root))
    env = {"s": s, "root": root, "outside": outside, "keys": keys, "listen": listen, "tmp": tmp}
    try:
        s.wait_ready(("tiny",))
        yield env
    finally:
        if "w1" in env:
            env["w1"].stop()
        s.stop()


def load(s, **body) -> httpx.Response:
    return httpx.post(s.url + "/admin/models/load", json=body, timeout=120)


def booked(s) -> dict[str, int]:
    rows = httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]
    return {d["die"]: d["used_bytes"] for d in rows}


def test_worker_path_is_checked_like_path(site):
    s, root, outside = site["s"], site["root"], site["outside"]
    before = (sorted(models(s)), booked(s))
    msgs = []
    for wp in (str(outside), str(site["tmp"] / "no-such-folder"), str(root / ".." / "outside")):
        r = load(s, path=str(root / "tiny"), name="wp", dies=["cpu:0@w1"], worker_path=wp)
        err = check_error(r, 403, param="worker_path")
        msgs.append(err["message"].replace(repr(wp), "<P>"))
    assert msgs[0] == msgs[1] == msgs[2], msgs  # nothing says whether it exists
    assert "exist" not in msgs[0] and "no such" not in msgs[0].lower()
    # path itself: the same rule, the same words
    for p in (str(outside), str(site["tmp"] / "no-such-folder")):
        err = check_error(load(s, path=p, name="wp"), 403, param="path")
        assert err["message"].replace(repr(p), "<P>") == msgs[0]
    for field in ("path", "worker_path"):
        for bad in ("/x/a\x00b", "a" * 5000, str(root) + "/" + "n" * 300):
            body = {"path": str(root / "tiny"), "name": "wp", "dies": ["cpu:0@w1"], field: bad}
            check_error(load(s, **body), 400, param=field)
    assert (sorted(models(s)), booked(s)) == before


def test_worker_path_is_for_remote_dies_only(site):
    s, root = site["s"], site["root"]
    before = (sorted(models(s)), booked(s))
    for dies in (["cpu:0"], None):  # named, or placed (the only die up is the local one)
        body = {"path": str(root / "tiny"), "name": "wp", "worker_path": str(root / "tiny-copy")}
        if dies:
            body["dies"] = dies
        err = check_error(load(s, **body), 400, param="worker_path")
        assert "cpu:0" in err["message"]
    assert (sorted(models(s)), booked(s)) == before
    # without worker_path the same load works (so the 400 above was worker_path's)
    r = load(s, path=str(root / "tiny"), name="wp", dies=["cpu:0"])
    assert r.status_code == 200, r.text
    assert httpx.post(s.url + "/admin/models/unload", json={"name": "wp"}, timeout=60).status_code == 200


def test_worker_path_must_be_the_same_model(site):
    s, root = site["s"], site["root"]
    site["w1"] = RemoteWorker(site["listen"], "w1", site["keys"], "w1", site["tmp"] / "w1.log")
    until(lambda: joined(s, "w1"), timeout=60, what="w1 to join")
    before = (sorted(models(s)), booked(s))
    # another model (its vocabulary differs) at worker_path: loaded, found out, unloaded, refused
    r = load(s, path=str(root / "tiny"), name="wrong", dies=["cpu:0@w1"], worker_path=str(root / "other"))
    err = check_error(r, 400, param="worker_path")
    assert "vocabulary" in err["message"], err
    assert "wrong" not in models(s)
    until(lambda: booked(s) == before[1], timeout=10, what="the booking released")
    # the same vocabulary but other layers: found out by the shape digest
    r = load(s, path=str(root / "tiny"), name="wrong", dies=["cpu:0@w1"], worker_path=str(root / "deeper"))
    err = check_error(r, 400, param="worker_path")
    assert "other layers" in err["message"], err
    until(lambda: booked(s) == before[1], timeout=10, what="the booking released")
    assert sorted(models(s)) == before[0]
    # the same model in another folder: loads on the remote die and serves
    r = load(s, path=str(root / "tiny"), name="right", dies=["cpu:0@w1"], worker_path=str(root / "tiny-copy"))
    assert r.status_code == 200, r.text
    assert r.json()["dies"] == ["cpu:0@w1"]
    assert f"from {root / 'tiny-copy'}" in site["w1"].output()
    assert chat(s, "right").status_code == 200
    assert httpx.post(s.url + "/admin/models/unload", json={"name": "right"}, timeout=60).status_code == 200
