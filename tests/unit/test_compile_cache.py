"""The compile cache's bookkeeping (workers/compile_cache.py): keys, hits, the size bound."""

from __future__ import annotations

import os
import time

from workers.compile_cache import CompileCache, cache_folder, entry_key, max_bytes

LAYOUT = {"cpu_path": "bf16", "dtype": "torch.bfloat16", "slots": 8, "torch": "2.13.0", "isa": "AVX512"}


def test_the_key_changes_with_the_model_files_and_the_layout(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 10)
    k = entry_key(str(model), LAYOUT)
    assert k == entry_key(str(model), dict(LAYOUT))
    for change in ({"slots": 4}, {"torch": "2.14.0"}, {"isa": "AVX2"}, {"cpu_path": "int8"}):
        assert entry_key(str(model), {**LAYOUT, **change}) != k, change
    (model / "model.safetensors").write_bytes(b"y" * 11)  # another size
    k2 = entry_key(str(model), LAYOUT)
    assert k2 != k
    os.utime(model / "model.safetensors", ns=(1, 1))  # the same size, another mtime
    assert entry_key(str(model), LAYOUT) != k2
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"g")
    assert entry_key(str(gguf), LAYOUT) != entry_key(str(model), LAYOUT)


def test_an_entry_hits_once_a_compile_finished(tmp_path):
    cache = CompileCache(tmp_path / "c", limit=1 << 20)
    folder, hit = cache.open("k1")
    assert folder.is_dir() and not hit
    (folder / "kernel.so").write_bytes(b"k" * 100)
    assert not cache.open("k1")[1]  # a compile cut short is no hit: its folder is reused
    cache.finish("k1")
    assert cache.open("k1") == (folder, True)


def test_the_least_recently_used_entries_go_over_the_bound(tmp_path):
    cache = CompileCache(tmp_path, limit=2500)
    for i, key in enumerate(("a", "b", "c")):
        folder, _ = cache.open(key)
        (folder / "x.so").write_bytes(b"x" * 1000)
        os.utime(folder, (time.time() - 100 + i, time.time() - 100 + i))
    cache.open("a")  # used again: now the newest
    folder, _ = cache.open("d")
    (folder / "x.so").write_bytes(b"x" * 1000)
    cache.finish("d")  # 4000 bytes > 2500: b, then c go; d (just written) and a stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "d"]
    big = CompileCache(tmp_path, limit=10)
    big.finish("d")  # the entry just written stays even alone over the bound
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_settings_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PANTHEON_COMPILE_CACHE_DIR", str(tmp_path / "cc"))
    monkeypatch.setenv("PANTHEON_COMPILE_CACHE_MAX_MB", "3")
    assert cache_folder() == tmp_path / "cc" and max_bytes() == 3 << 20
    monkeypatch.delenv("PANTHEON_COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PANTHEON_CACHE_DIR", raising=False)
    assert cache_folder() == tmp_path / "xdg" / "pantheon" / "compile"
    monkeypatch.setenv("PANTHEON_COMPILE_CACHE_MAX_MB", "0")
    assert CompileCache().limit == 0
