"""The dashboard stays a light client: importing ``tui`` (all of it) pulls in neither torch, zmq,
the worker package nor the router's web stack."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
FORBIDDEN = ("torch", "zmq", "workers", "quart", "hypercorn")

PROBE = f"""
import json, sys
import tui.app, tui.client, tui.screens, tui.source
tui.app.build_parser()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})))
"""


def test_tui_imports_neither_torch_zmq_nor_workers():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_cli_help_runs_without_a_router():
    out = subprocess.run(
        [sys.executable, "-m", "pantheon", "tui", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--url", "--admin-key", "--readonly", "--interval"):
        assert flag in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pantheon", "tui", "--url", "router:8000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "http://" in bad.stderr
