"""bench/peer.py without llama.cpp: binary lookup, the CLI and llama-bench's JSON, on stand-ins.

No build, no network, nothing timed: the "binaries" are shell scripts written here.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.fixture()
def peer(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("LLAMA_CPP_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("bench_peer_under_test", ROOT / "bench" / "peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_bins(d: Path, bench_stdout: str = "[]") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name in ("llama-server", "llama-bench", "llama-quantize"):
        f = d / name
        f.write_text("#!/bin/sh\ncat <<'EOF'\n" + bench_stdout + "\nEOF\n")
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return d


def test_no_binaries(peer, tmp_path, capsys):
    assert peer.cache_dir() == tmp_path / "cache"
    assert peer.find_bins() is None
    assert peer.main(["path"]) == 1
    assert "peer.py build" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="peer.py build"):
        peer.llama_bench_tg(tmp_path / "m.gguf")
    with pytest.raises(FileNotFoundError):
        with peer.llama_server(tmp_path / "m.gguf"):
            pass


def test_cache_binaries_found(peer, tmp_path, capsys):
    bins = _fake_bins(tmp_path / "cache" / "build" / "bin")
    assert peer.find_bins() == bins
    assert peer.main(["path"]) == 0
    assert capsys.readouterr().out.strip() == str(bins)
    assert peer.build() == bins  # already built: nothing to do, no cmake needed


def test_llama_cpp_dir(peer, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="LLAMA_CPP_DIR"):
        peer.find_bins()
    monkeypatch.setenv("LLAMA_CPP_DIR", str(_fake_bins(tmp_path / "mine")))
    _fake_bins(tmp_path / "cache" / "build" / "bin")
    assert peer.find_bins() == tmp_path / "mine"


def test_quantize(peer, tmp_path):
    """``quantize`` runs llama-quantize on a .part file, renamed once whole; an unknown type
    is refused before anything runs."""
    bins = _fake_bins(tmp_path / "cache" / "build" / "bin")
    (bins / "llama-quantize").write_text(
        '#!/bin/sh\n[ "$1" = --allow-requantize ] && shift\necho "$3" > "$2"\n'
    )
    src = tmp_path / "m-f16.gguf"
    src.write_bytes(b"GGUF")
    out = peer.quantize(src, tmp_path / "m-Q4_K_M.gguf", "Q4_K_M")
    assert out.read_text().strip() == "Q4_K_M" and not list(tmp_path.glob("*.part"))
    assert peer.quantize(src, tmp_path / "r.gguf", "Q8_0", requantize=True).read_text().strip() == "Q8_0"
    with pytest.raises(ValueError, match="Q4_K_M"):
        peer.quantize(src, tmp_path / "x.gguf", "Q3_X")


def test_llama_bench_json(peer, tmp_path):
    records = [
        {"n_prompt": 0, "n_gen": 64, "avg_ts": 123.5, "stddev_ts": 1.5, "cpu_info": "x"},
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 900.0, "stddev_ts": 3.0},
    ]
    _fake_bins(tmp_path / "cache" / "build" / "bin", json.dumps(records))
    assert peer.llama_bench_tg(tmp_path / "m.gguf", threads=2, tokens=64) == 123.5
    assert peer.llama_bench(tmp_path / "m.gguf")["stddev_ts"] == 1.5
    with pytest.raises(RuntimeError, match="tg32"):
        peer.llama_bench(tmp_path / "m.gguf", tokens=32)


# A llama-server stand-in: it answers /health on --port, or dies of SIGSEGV at start unless it
# was given --no-repack (what the real one did on an AMX host).
CRASHY_SERVER = """#!PYTHON
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status":"ok"}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_server_that_crashes_at_start_runs_without_repacking(peer, tmp_path, capsys):
    bins = _fake_bins(tmp_path / "cache" / "build" / "bin")
    (bins / "llama-server").write_text(CRASHY_SERVER.replace("PYTHON", sys.executable))
    with peer.llama_server(tmp_path / "m.gguf", timeout=30) as url:
        import urllib.request

        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
    assert "--no-repack" in capsys.readouterr().err


def test_configured_source(peer, tmp_path):
    build = tmp_path / "b"
    assert peer._configured_source(build) is None
    build.mkdir()
    (build / "CMakeCache.txt").write_text("X:BOOL=ON\nCMAKE_HOME_DIRECTORY:INTERNAL=/src/llama.cpp\n")
    assert peer._configured_source(build) == Path("/src/llama.cpp")


def test_decode_imports_peer():
    sys.path.insert(0, str(ROOT))
    try:
        from bench import peer as imported
    finally:
        sys.path.remove(str(ROOT))
    assert callable(imported.find_bins) and callable(imported.llama_bench_tg)
    assert callable(imported.llama_server)
