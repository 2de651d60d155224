"""A real ``pantheon serve`` for the benchmarks: started on a free loopback port, ready once
``/health`` answers 200 (a model is loaded), stopped on the way out; and the host's CPU line
every figure is printed beside.

    with serve(["--model", path], log) as url:
        ...
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(args: list[str], log: Path, timeout: float = 300.0) -> Iterator[str]:
    """``pantheon serve ARGS`` on 127.0.0.1 (its output to ``log``); yields its URL once ready."""
    from bench.peer import stop

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pantheon", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={"PANTHEON_COMPILE": "0", **os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"pantheon serve exited {proc.returncode}; see {log}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pantheon serve not ready in {timeout:g} s; see {log}")
                time.sleep(0.25)
            yield url
        finally:
            stop(proc, 30)


def cpu_info() -> dict:
    """lscpu's model name and the AVX-512 flags /proc/cpuinfo lists."""
    name = "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    return {"model_name": name, "cpus": os.cpu_count(), "avx512": "avx512f" in flags, "avx512_flags": avx512}


def host_line() -> str:
    """The CPU the figures were taken on: lscpu's model name, the CPU count, AVX-512 or not."""
    info = cpu_info()
    isa = "AVX-512" if info["avx512"] else "no AVX-512"
    return f"{info['model_name']}, {info['cpus']} CPUs, {isa}"
