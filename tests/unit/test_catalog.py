"""The model catalog (``pantheon.control.catalog``) on real folders and files, and the one
keep-alive format (``parse_keep_alive``)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from pantheon.config.values import FOREVER, KeepAliveError, parse_keep_alive
from pantheon.control.catalog import CONFIGURED, Catalog, CatalogEntry, discover


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from makemodel import make_model

    return make_model("tiny", tmp_path_factory.mktemp("cat-tiny"))


@pytest.fixture
def root(tmp_path, tiny_folder):
    r = tmp_path / "models"
    r.mkdir()
    shutil.copytree(tiny_folder, r / "Alpha")
    (r / "org").mkdir()
    shutil.copytree(tiny_folder, r / "org" / "beta")
    (r / "org" / "notes.txt").write_text("not a model")
    (r / "broken.Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00\x00\x00cut")
    (r / "empty").mkdir()
    (r / ".hidden").mkdir()
    shutil.copytree(tiny_folder, r / ".hidden" / "x")
    return r


def test_discovery_finds_folders_ggufs_and_one_level_down(root):
    found = [os.path.relpath(p, root) for p in discover([str(root)])]
    assert found == ["Alpha", "broken.Q4_K_M.gguf", os.path.join("org", "beta")]


def test_entries_are_named_as_model_would_name_them_and_broken_ones_carry_their_error(root):
    cat = Catalog(roots=[str(root)])
    by = {e.name: e for e in cat.entries()}
    assert set(by) == {"Alpha", "broken", "beta"}  # a .gguf's stem, lower-cased, tag dropped
    assert by["Alpha"].error is None and by["Alpha"].context_limit == 4096
    assert by["Alpha"].size_bytes > 0 and by["Alpha"].modified > 0
    assert by["broken"].error is not None and "broken.Q4_K_M.gguf" in by["broken"].error
    assert all(not e.preload and not e.pin for e in cat.entries())


def test_configured_entries_come_first_win_their_names_and_paths_and_have_aliases(root, tmp_path):
    mine = CatalogEntry(
        name="beta", path=str(root / "Alpha"), aliases=("a", "b"), origin=CONFIGURED, pin=True
    )
    missing = CatalogEntry(name="gone", path=str(tmp_path / "nothing"), origin=CONFIGURED)
    cat = Catalog([mine, missing], [str(root)])
    names = [e.name for e in cat.entries()]
    # beta is configured (Alpha's path): the discovered org/beta and Alpha are not listed again
    assert names == ["beta", "gone", "broken"]
    assert cat.lookup("a") is cat.lookup("beta") and cat.canonical("b") == "beta"
    assert cat.canonical("unknown") == "unknown" and cat.lookup(None) is None
    assert cat.get("gone").error == f"{tmp_path / 'nothing'}: nothing there"


def test_a_model_copied_in_is_found_on_lookup_and_unchanged_folders_are_not_read_again(root, tiny_folder):
    cat = Catalog(roots=[str(root)])
    assert not cat.refresh()  # nothing changed since the first scan
    assert cat.get("gamma") is None
    shutil.copytree(tiny_folder, root / "org" / "gamma")  # one level down
    hit = cat.lookup("gamma")
    assert hit is not None and hit.path == str(root / "org" / "gamma")
    assert not cat.refresh()


def test_a_config_that_changes_is_described_again(root):
    cat = Catalog(roots=[str(root)])
    cfg = root / "Alpha" / "config.json"
    raw = json.loads(cfg.read_text())
    raw["architectures"] = ["NoSuchForCausalLM"]
    raw["model_type"] = "no_such"
    cfg.write_text(json.dumps(raw))
    os.utime(root / "Alpha", ns=(1, 1))  # the folder's time changes as a copy would change it
    cat.refresh()
    assert cat.get("Alpha").error is not None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (300, 300.0),
        (2.5, 2.5),
        (-1, FOREVER),
        ("-1", FOREVER),
        ("-1m", FOREVER),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5s", 1.5),
        ("90", 90.0),
        ("0", 0.0),
    ],
)
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", "5x", "", True, [], {"a": 1}, math.nan])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(KeepAliveError):
        parse_keep_alive(value)
