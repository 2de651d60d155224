"""A draft model through a real server: the ``[[models]]`` key ``draft``, greedy output unchanged,
``/admin/dies`` naming the draft, and the admin load's ``draft`` refused with a 400 (a bad value,
another tokenizer, "mtp" for a model without a head) leaving the model table as it was; a
Qwen3.5 loaded with ``draft: "mtp"`` (its own head) answers as without it."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from helpers.serve import Server, _free_port, check_error, greedy_completion

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def paths(model_factory, tmp_path_factory):
    target = model_factory("tiny-llama")
    draft = model_factory("tiny", seed=5, num_hidden_layers=1)  # the same tokenizer, one layer
    other = tmp_path_factory.mktemp("other-tok") / "m"
    shutil.copytree(model_factory("tiny"), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["zqzqzq"] = vocab.pop(next(t for t, i in vocab.items() if i == 600))
    (other / "tokenizer.json").write_text(json.dumps(tok))
    return target, draft, other


@pytest.fixture(scope="module")
def srv(paths, tmp_path_factory):
    target, draft, _other = paths
    d = tmp_path_factory.mktemp("draft")
    f = d / "serve.toml"
    f.write_text(
        f"port = {_free_port()}\ncpu_dies = 1\nspeculative = 3\n"
        f'[[models]]\npath = "{target}"\nname = "t"\ndraft = "{draft}"\n'
    )
    s = Server(["--config", str(f)], d / "serve.log")
    try:
        s.wait_ready(("t",))
        yield s
    finally:
        s.stop()


def speculation(srv: Server, instance: str = "") -> dict[str, dict]:
    """``/admin/dies``' speculation figures of the instances named from ``instance`` on, once
    the workers' stats have reported some (they come a moment after the answer)."""
    deadline = time.monotonic() + 10
    while True:
        dies = httpx.get(srv.url + "/admin/dies", timeout=10).json()["data"]
        got = {k: v for d in dies for k, v in d["speculation"].items() if k.startswith(instance)}
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_greedy_text_is_the_same_and_the_dies_name_the_draft(srv, paths):
    off = greedy_completion(srv, speculative=False)
    on = greedy_completion(srv)  # the server's --speculative 3, drafted by the draft model
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    (stats,) = speculation(srv).values()
    assert stats["draft"] == str(paths[1]) and stats["verify_steps"] > 0 and stats["drafted"] > 0
    (row,) = httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]
    assert row["draft"] == str(paths[1])  # the instance table names it too


def test_the_admin_loads_draft_is_checked(srv, paths):
    target, _draft, other = paths

    def table() -> list[tuple]:
        rows = httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]
        return sorted((m["name"], m["instance"], m["state"]) for m in rows)

    models = table()
    assert [m[0] for m in models] == ["t"]
    for bad in (3, ""):
        r = httpx.post(srv.url + "/admin/models/load", json={"path": str(target), "name": "u", "draft": bad})
        assert check_error(r, 400)["param"] == "draft"
    r = httpx.post(
        srv.url + "/admin/models/load",
        json={"path": str(target), "name": "u", "draft": str(target) + "-none"},
    )
    assert check_error(r, 400)["param"] == "draft"
    r = httpx.post(
        srv.url + "/admin/models/load",
        json={"path": str(target), "name": "u", "draft": str(other)},
        timeout=120,
    )
    err = check_error(r, 400)
    assert "tokenizer differs" in err["message"], err
    assert table() == models  # the failed load left nothing behind
    r = httpx.post(srv.url + "/admin/models/load", json={"path": str(target), "name": "u", "draft": "mtp"})
    err = check_error(r, 400)
    assert err["param"] == "draft" and "no multi-token-prediction head" in err["message"], err
    assert table() == models


def test_a_qwen35_drafts_with_its_own_head(srv, model_factory):
    path = model_factory("tiny-qwen3.5-text", tie_word_embeddings=False)
    r = httpx.post(
        srv.url + "/admin/models/load", json={"path": str(path), "name": "q", "draft": "mtp"}, timeout=120
    )
    assert r.status_code == 200, r.text
    try:
        off = greedy_completion(srv, "q", speculative=False)
        on = greedy_completion(srv, "q")  # the server's --speculative 3
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        (stats,) = speculation(srv, "q").values()
        assert stats["draft"] == "mtp" and stats["drafted"] > 0, stats
        rows = httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]
        assert [m["draft"] for m in rows if m["name"] == "q"] == ["mtp"]
    finally:
        httpx.post(srv.url + "/admin/models/unload", json={"name": "q"}, timeout=60)
