"""The worker's native memory (``workers/native_memory.py``, issue 23 §7).

oneDNN keeps a primitive per shape in two caches of 1024 entries each; a worker that runs bf16
matmuls of ever new shapes (decode attention: the context grows each step) grew by gigabytes.
The worker caps both before its first oneDNN op. Tested in fresh processes, since the
capacities are read once per process: a real ``pantheon worker`` runs (its Hello probes the
CPU paths, oneDNN ops included) and gives up on a silent router, then the same process runs
bf16 linears of 400 row counts; a plain torch process runs them uncapped as the control.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.native_memory import CACHE_CAPACITY, CACHE_VARIABLES, Trimmer, cap_caches

ROOT = Path(__file__).resolve().parents[2]

SHAPES = """
import torch, torch.nn.functional as F

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024

def growth():
    torch.set_num_threads(1)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    F.linear(torch.randn(1, 576, dtype=torch.bfloat16), w)
    before = anon()
    with torch.inference_mode():
        for m in range(1, 401):  # a new shape each time, as decode attention's context is
            F.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
    return anon() - before
"""


def _run(code: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_worker_caps_onednn_caches_before_its_first_op(tmp_path):
    worker = f"""
import json, os, sys
import workers.worker as w
assert "torch" not in sys.modules, "importing the worker must not import torch"
code = w.cli(["--die", "cpu:0", "--endpoint", "ipc://{tmp_path}/nobody.sock", "--router-timeout", "0.3"])
assert "torch" in sys.modules  # it ran: the engine imported, the Hello's CPU path probes done
{SHAPES}
print(json.dumps({{"code": code, "env": {{k: os.environ.get(k) for k in {list(CACHE_VARIABLES)!r}}},
                   "growth": growth()}}))
"""
    plain = SHAPES + "\nimport json\nprint(json.dumps({'growth': growth()}))\n"
    capped, uncapped = _run(worker, tmp_path), _run(plain, tmp_path)
    assert capped["env"] == dict.fromkeys(CACHE_VARIABLES, str(CACHE_CAPACITY))
    from pantheon.core import protocol as p

    assert capped["code"] == p.EXIT_ROUTER_SILENT
    mib = 1 << 20
    if uncapped["growth"] < 60 * mib:
        pytest.skip(f"bf16 linears of new shapes grew only {uncapped['growth'] / mib:.0f} MiB here uncapped")
    # uncapped ~280 MiB on an AVX-512 EPYC (400 cached shapes), capped ~65
    assert capped["growth"] < uncapped["growth"] / 2, (capped, uncapped)


def test_cap_caches_keeps_the_operators_value():
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "0"}
    assert cap_caches(env) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
        "LRU_CACHE_CAPACITY": str(CACHE_CAPACITY),
    }
    assert cap_caches({}) == dict.fromkeys(CACHE_VARIABLES, str(CACHE_CAPACITY))


def test_the_trimmer_trims_once_idle_after_work_and_not_too_often():
    t = Trimmer(every_s=5.0, busy_every_s=30.0)
    if t.fn is None:
        pytest.skip("no glibc malloc_trim here")
    assert t.idle(100.0)  # the load's garbage: the first idle turn trims
    assert not t.idle(101.0)  # nothing ran since
    assert not t.worked(101.5)  # busy, and the last trim is recent
    assert not t.idle(102.0)  # too soon after the last
    assert t.idle(105.0) and t.count == 2
    assert not t.idle(300.0)
    # work that never stops: one trim per busy_every_s all the same
    assert [now for now in range(301, 400) if t.worked(float(now))] == [301, 331, 361, 391]
