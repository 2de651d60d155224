"""A real ``pantheon serve`` subprocess on a free loopback port (``Server``), the usual message
(``MSG``) and the OpenAI error-body check (``check_error``): the tests of tests/e2e and
tests/tui/test_tui_server.py start their routers with these."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.openapi import check
from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
MSG = [{"role": "user", "content": "Say something."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_args(models: dict[str, tuple[Path, str]], cpu_dies: int, *extra: str) -> list[str]:
    """``pantheon serve`` arguments for ``{name: (folder, die)}`` on ``cpu_dies`` CPU dies, then
    ``extra``: the e2e modules' servers differ only in their models, dies and a few flags."""
    args: list[str] = []
    for name, (folder, die) in models.items():
        args += ["--model", str(folder), "--name", name, "--dies", die]
    return [*args, "--cpu-dies", str(cpu_dies), *extra]


class Server:
    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
        for k in ("PANTHEON_BATCH_SLOTS", "QWEN35_BATCH_SLOTS", "QWEN35_GPU_FULL_LOGITS"):
            if k not in (env or {}):
                env.pop(k, None)
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pantheon", "serve", "--port", str(self.port), *args],
            cwd=ROOT,
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, models: tuple[str, ...] | None = (), timeout: float = 150.0) -> None:
        """Until /health is 200 and every name in ``models`` is listed (None: /health alone,
        for a server whose /v1/models needs a key)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    if models is None:
                        return
                    listed = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
                    loaded = {m["id"] for m in listed if m.get("status", {}).get("value") == "loaded"}
                    if set(models) <= loaded:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return self.proc.returncode

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key="none",
            max_retries=0,
            timeout=60,
            _strict_response_validation=True,
            **kw,
        )

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1",
            api_key="none",
            max_retries=0,
            timeout=60,
            _strict_response_validation=True,
        )


def check_error(r: httpx.Response, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    check("ErrorResponse", body)
    if param is not ...:
        assert body["error"]["param"] == param, body
    if code is not ...:
        assert body["error"]["code"] == code, body
    return body["error"]


def until(cond, timeout: float = 10.0, what: str = "condition"):
    """Poll ``cond()`` until it is truthy (returns it) or fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


# A tiny random model answers it in a loop: its own context drafts (speculation's tests)
LOOP_PROMPT = [5, 17, 300, 41] * 4


def greedy_completion(s: Server, model: str = "t", prompt: list[int] = LOOP_PROMPT, **extra) -> dict:
    """``/v1/completions`` of ``prompt``, greedy, 24 tokens past any EOS, ``extra`` fields on top:
    the response's JSON (a 200 asserted)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()
