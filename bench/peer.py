"""llama.cpp as the peer to benchmark against: builds ``llama-server``, ``llama-bench`` and
``llama-quantize`` once.

    python bench/peer.py build      # once (skipped when the binaries are there); ~20 min on 2 cores
                                    # (a build tree without llama-quantize: a few minutes more)
    python bench/peer.py path       # prints the folder holding the binaries

The sources are the llama.cpp vendored in PyPI's ``llama-cpp-python`` sdist (pinned below), fetched
with pip (``pip download --no-binary :all:``) so nothing but the package registry is needed; built
with CMake + Ninja, CPU only, ``-march=native``, no curl/OpenSSL, into ``$LLAMA_CPP_CACHE``
(default ``~/.cache/pantheon/llama.cpp``): ``sdist/``, ``src/``, ``build/bin/``.
``LLAMA_CPP_DIR=DIR`` uses binaries from DIR instead (an existing llama.cpp build).

For other bench scripts: ``find_bins()``, ``llama_bench_tg()``, ``llama_server()`` and
``quantize()`` (a GGUF into another type, as users make the Q4_K_M files they download). Everything
binds and talks to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
BINARIES = ("llama-server", "llama-bench", "llama-quantize")


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA_CPP_CACHE") or Path.home() / ".cache" / "pantheon" / "llama.cpp")


def _has_bins(d: Path) -> bool:
    return all(os.access(d / b, os.X_OK) and (d / b).is_file() for b in BINARIES)


def find_bins() -> Path | None:
    """The folder holding ``BINARIES``: ``$LLAMA_CPP_DIR`` when set (an
    error if they are not there), else the cache's ``build/bin``; None when neither has them."""
    env = os.environ.get("LLAMA_CPP_DIR")
    if env:
        d = Path(env).expanduser()
        if not _has_bins(d):
            raise FileNotFoundError(f"LLAMA_CPP_DIR={env} does not hold {' and '.join(BINARIES)}")
        return d
    d = cache_dir() / "build" / "bin"
    return d if _has_bins(d) else None


# ---------------------------------------------------------------- build


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def _source(cache: Path) -> Path:
    """The vendored llama.cpp tree, downloading and unpacking the sdist on first use."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    src = cache / "src" / name / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    sdist = cache / "sdist" / f"{name}.tar.gz"
    if not sdist.exists():
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(sdist.parent),
            ]
        )
    prefix = f"{name}/vendor/llama.cpp/"
    print(f"unpacking {prefix} from {sdist} ...", flush=True)
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
        try:
            tf.extractall(cache / "src", members=members, filter="data")
        except TypeError:  # Python without extraction filters (< 3.11.4)
            tf.extractall(cache / "src", members=members)
    return src


def _configured_source(build: Path) -> Path | None:
    """The source folder an existing build tree was configured from, if it has a cache."""
    try:
        for line in (build / "CMakeCache.txt").read_text(errors="replace").splitlines():
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                return Path(line.split("=", 1)[1])
    except OSError:
        pass
    return None


def build(jobs: int = 2) -> Path:
    """Build ``BINARIES`` into the cache (nothing to do when they are there); their folder.
    A build tree left by an earlier (interrupted) build is resumed, whatever source it came from,
    as long as that source still exists."""
    found = find_bins()
    if found:
        print(f"llama.cpp binaries already in {found}")
        return found
    for tool in ("cmake", "ninja"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found (apt-get install cmake ninja-build, or pip install {tool})")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".build.lock", "w") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `peer.py build` waits for the first
        found = find_bins()
        if found:
            return found
        return _build(cache, jobs)


def _build(cache: Path, jobs: int) -> Path:
    bdir = cache / "build"
    configured = _configured_source(bdir)
    if configured is None or not (configured / "CMakeLists.txt").exists():
        if bdir.exists():
            shutil.rmtree(bdir)
        src = _source(cache)
        _run(
            [
                "cmake",
                "-S",
                str(src),
                "-B",
                str(bdir),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DGGML_NATIVE=ON",
            ]
        )
    t = time.monotonic()
    _run(["cmake", "--build", str(bdir), f"-j{jobs}", "--target", *BINARIES])
    print(f"built in {time.monotonic() - t:.0f} s: {bdir / 'bin'}")
    return bdir / "bin"


# ---------------------------------------------------------------- running


def _bins() -> Path:
    d = find_bins()
    if d is None:
        raise FileNotFoundError(
            f"no llama.cpp binaries in {cache_dir() / 'build' / 'bin'}; "
            "run `python bench/peer.py build` or set LLAMA_CPP_DIR"
        )
    return d


def llama_bench(gguf: str | Path, threads: int = 2, tokens: int = 64, reps: int = 5) -> dict:
    """``llama-bench -m FILE -t THREADS -n TOKENS -p 0`` (text generation at batch 1, no
    prompt): its JSON record of the tg test (``avg_ts``, ``stddev_ts``, ``cpu_info``, ...)."""
    out = subprocess.run(
        [
            str(_bins() / "llama-bench"),
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-n",
            str(tokens),
            "-p",
            "0",
            "-r",
            str(reps),
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for rec in json.loads(out):
        if rec.get("n_gen") == tokens and rec.get("n_prompt") == 0:
            return rec
    raise RuntimeError(f"no tg{tokens} record in llama-bench output:\n{out}")


def llama_bench_tg(gguf: str | Path, threads: int = 2, tokens: int = 64, best: bool = False) -> float:
    """Decode tokens/s at batch 1: llama-bench's tg``tokens``, the mean of its repetitions (or
    the fastest one with ``best``, which a shared machine's noise disturbs less)."""
    rec = llama_bench(gguf, threads, tokens)
    if best and rec.get("samples_ts"):
        return float(max(rec["samples_ts"]))
    return float(rec["avg_ts"])


# The types ``quantize`` makes (llama-quantize's names): the files users download
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1")


def quantize(
    src: str | Path, dst: str | Path, qtype: str, threads: int = 2, requantize: bool = False
) -> Path:
    """``llama-quantize SRC DST TYPE``: ``src`` (the converter's f16/bf16/f32 output; with
    ``requantize`` an already quantized file, which llama.cpp refuses without
    ``--allow-requantize``) into ``dst`` of ``qtype`` (``QUANT_TYPES``), written to a ``.part``
    file renamed once whole (a killed run leaves no file a later run would trust)."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantize type {qtype!r} is not one of {', '.join(QUANT_TYPES)}")
    dst = Path(dst)
    part = dst.with_name(dst.name + ".part")
    cmd = [str(_bins() / "llama-quantize")]
    if requantize:
        cmd.append("--allow-requantize")
    cmd += [str(src), str(part), qtype, str(threads)]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)  # a line a tensor: shown on failure
    if done.returncode:
        raise RuntimeError(f"llama-quantize exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    part.rename(dst)
    return dst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(
    gguf: str | Path,
    threads: int = 2,
    slots: int = 8,
    ctx_per_slot: int = 1024,
    port: int | None = None,
    log: str | Path | None = None,
    timeout: float = 300.0,
    extra: tuple[str, ...] = (),
) -> Iterator[str]:
    """``llama-server -m FILE -np SLOTS -c SLOTS*CTX -t THREADS`` on 127.0.0.1; yields its base URL
    once ``/health`` answers 200, stops it on exit. Output goes to ``log`` (default: a file in
    $TMPDIR). A llama-server that crashes at start is started again with ``--no-repack``.
    ``extra``: more flags (bench/speculative.py: its ``--spec-type`` options)."""
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(log or Path(os.environ.get("TMPDIR", "/tmp")) / "bench-llama-server.log")
    cmd = [
        str(_bins() / "llama-server"),
        "-m",
        str(gguf),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-t",
        str(threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        "bench",
        "--no-webui",
        *extra,
    ]
    try:
        proc = _start_server(cmd, url, log, timeout)
    except _StartCrashed as e:
        # Seen on a 2-core Intel Xeon VM with AMX: llama-server dies of SIGSEGV or SIGILL right
        # after its thread pool starts, in the CPU backend's weight repacking; llama-bench on the
        # same file runs. Without repacking it serves (other kernels: say so beside its figures).
        print(
            f"llama-server crashed at start (exit {e.returncode}); running it with --no-repack (see {log})",
            file=sys.stderr,
        )
        proc = _start_server(cmd + ["--no-repack"], url, log, timeout)
    try:
        yield url
    finally:
        stop(proc, 20)


class _StartCrashed(RuntimeError):
    """llama-server was killed by a signal (a crash) before it answered /health."""

    def __init__(self, returncode: int, log: Path):
        super().__init__(f"llama-server exited {returncode}; see {log}")
        self.returncode = returncode


def _start_server(cmd: list[str], url: str, log: Path, timeout: float) -> subprocess.Popen:
    """Start ``cmd``, output to ``log``; return it once ``url``/health answers 200."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            if code < 0:  # a signal: a crash, not a refusal of its flags
                raise _StartCrashed(code, log)
            raise RuntimeError(f"llama-server exited {code}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):  # 503 while loading, refused before
            pass
        if time.monotonic() > deadline:
            stop(proc, 5)
            raise RuntimeError(f"llama-server not ready in {timeout} s; see {log}")
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", help="build llama-server, llama-bench and llama-quantize into the cache (once)"
    )
    b.add_argument("-j", "--jobs", type=int, default=2)
    sub.add_parser("path", help="print the folder holding the binaries (exit 1 when not built)")
    sub.add_parser("source", help="print the llama.cpp source tree, downloading the sdist on first use")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.jobs)
        return 0
    if args.cmd == "source":
        print(_source(cache_dir()))
        return 0
    d = find_bins()
    if d is None:
        print(
            f"not built: run `python bench/peer.py build` ({cache_dir() / 'build' / 'bin'})", file=sys.stderr
        )
        return 1
    print(d)
    return 0


def stop(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM a server we started, SIGKILL it if it has not exited after ``wait_s``."""
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
