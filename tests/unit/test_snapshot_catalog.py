"""The dashboard's catalog (``Snapshot.catalog``, built by ``pantheon.control.feed``) from a real
app state: ``build_state`` on a real config file (``models_dir`` and ``[[models]]``), with its
real registry, catalog and residency. The pool has no workers (nothing here talks to one), so
instances are put in the registry as a load does (``reserve``, then ``publish``)."""

from __future__ import annotations

import shutil

import pytest

from pantheon.api.app import build_state
from pantheon.config.file import merge_config_file
from pantheon.config.settings import build_config
from pantheon.control.registry import Registry
from pantheon.snapshot import decode_snapshot, encode


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from makemodel import make_model

    return make_model("tiny", tmp_path_factory.mktemp("snap-tiny"))


class NoWorkers:
    """A pool before any worker started: the snapshot reads its dies, there are none."""

    def dies(self) -> list:
        return []


def test_the_snapshot_of_a_real_app_state_carries_the_catalog(tmp_path, tiny_folder):
    root = tmp_path / "models"
    root.mkdir()
    for name in ("alpha", "beta"):
        shutil.copytree(tiny_folder, root / name)
    (root / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00cut")
    cfg = tmp_path / "pantheon.toml"
    cfg.write_text(
        f'models_dir = ["{root}"]\nkeep_alive = "5m"\ncpu_dies = 1\n'
        f'[[models]]\npath = "{tiny_folder}"\nname = "start"\npin = true\n'
        f'[[models]]\npath = "{root / "alpha"}"\nname = "alpha"\naliases = ["a"]\n'
        f'keep_alive = "-1"\ndies = "cpu:0"\nquantize = true\npreload = false\n'
    )
    state = build_state(
        build_config(merge_config_file({"config": str(cfg)}, {}), {}), NoWorkers(), Registry()
    )

    snap = decode_snapshot(encode(state.snapshot()))  # over the wire, as the dashboard gets it
    by = {m.name: m for m in snap.catalog}
    assert list(by) == ["start", "alpha", "beta", "broken"]  # configured first
    assert {n: m.status for n, m in by.items()} == {
        "start": "unloaded",
        "alpha": "unloaded",
        "beta": "unloaded",
        "broken": "failed",
    }
    assert by["broken"].reason is not None and "broken.gguf" in by["broken"].reason
    alpha = by["alpha"]
    assert (alpha.path, alpha.aliases, alpha.dies, alpha.quantize) == (
        str(root / "alpha"),
        ["a"],
        ["cpu:0"],
        True,
    )
    assert alpha.keep_alive_s == -1.0  # forever (JSON has no infinity)
    assert by["beta"].keep_alive_s is None and by["beta"].path == str(root / "beta")  # the server's
    assert by["start"].pinned and not by["beta"].pinned
    assert all(m.expires_in_s is None for m in snap.catalog)  # nothing loaded

    reg = state.registry
    for name, path in (("start", tiny_folder), ("beta", root / "beta")):
        reg.publish(reg.reserve(name, str(path), ("cpu:0",)), max_model_len=128)
    reg.reserve("alpha", str(root / "alpha"), ("cpu:0",))  # still loading
    state.residency.keep("beta", 60.0)  # a request for beta ended, asking to keep it a minute
    state.residency.keep("start", 60.0)  # pinned: stays whatever a request says

    snap = decode_snapshot(encode(state.snapshot()))
    by = {m.name: m for m in snap.catalog}
    assert {n: m.status for n, m in by.items()} == {
        "start": "loaded",
        "alpha": "loading",
        "beta": "loaded",
        "broken": "failed",
    }
    assert by["beta"].expires_in_s is not None and 55 < by["beta"].expires_in_s <= 60
    assert by["start"].expires_in_s is None
