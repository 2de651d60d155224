"""Generation defaults on the built-in model: how often SmolLM2-135M-Instruct names Paris.

    python bench/defaults.py                       # both arms, 20 questions each
    python bench/defaults.py --params none         # the old behaviour only
    python bench/defaults.py --model DIR_OR_GGUF --questions 50

Starts ``pantheon serve`` as the README's first command does (no ``--model``: the built-in
SmolLM2-135M-Instruct, with its authors' sampling settings as its params) on a free port and asks
"What is the capital of France? Answer in one sentence." ``--questions`` times in each arm:

- ``defaults``: no sampling field at all, so the model's defaults apply (``/v1/models`` shows
  them: temperature 0.2, top_p 0.9 for SmolLM2);
- ``none``: ``temperature: 1.0`` given, which a default never replaces: the server's behaviour
  before defaults existed (OpenAI's temperature 1, nothing else).

Both arms send ``max_tokens`` (``--max-tokens``, 48: a sentence, and a bound on a rambling
sampled answer's time) and the same seeds (question i: seed i), so a run is reproducible and the
arms differ only in the defaults. Printed: answers naming Paris per arm, side by side, and a few
of the answers that do not.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."
ARMS = {"defaults": {}, "none": {"temperature": 1.0}}


def host() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Server:
    """``pantheon serve [--model PATH]`` on a free loopback port."""

    def __init__(self, model: str | None, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pantheon", "serve", "--port", str(self.port)]
        if model:
            cmd += ["--model", model]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited {self.proc.returncode}; see {log}")
            try:
                models = httpx.get(self.url + "/v1/models", timeout=2).json().get("data") or []
                if models:
                    self.model = models[0]
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        raise SystemExit(f"server not ready; see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def ask(url: str, model: str, fields: dict, seed: int, max_tokens: int) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "seed": seed,
        **fields,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"] or ""


def run_arm(srv: Server, fields: dict, n: int, max_tokens: int) -> list[str]:
    with cf.ThreadPoolExecutor(8) as pool:  # the server's slots: one batch at a time
        return list(pool.map(lambda i: ask(srv.url, srv.model["id"], fields, i, max_tokens), range(n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=("both", "defaults", "none"), default="both")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="a model to serve instead of the built-in one")
    args = ap.parse_args()

    arms = list(ARMS) if args.params == "both" else [args.params]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-defaults-serve.log"
    srv = Server(args.model, log)
    try:
        print(f"host: {host()}")
        print(f"model: {srv.model['id']}  defaults in force: {srv.model.get('defaults')}")
        print(f"question: {QUESTION!r} x {args.questions}, max_tokens {args.max_tokens}, seeds 0..")
        results = {}
        for arm in arms:
            t0 = time.perf_counter()
            answers = run_arm(srv, ARMS[arm], args.questions, args.max_tokens)
            results[arm] = (answers, time.perf_counter() - t0)
    finally:
        srv.stop()
    print(f"\n{'arm':<10} {'sent':<22} {'naming Paris':>12} {'wall s':>8}")
    for arm, (answers, wall) in results.items():
        paris = sum("paris" in a.lower() for a in answers)
        sent = ", ".join(f"{k}: {v}" for k, v in ARMS[arm].items()) or "(no sampling field)"
        print(f"{arm:<10} {sent:<22} {f'{paris}/{len(answers)}':>12} {wall:>8.1f}")
    for arm, (answers, _) in results.items():
        wrong = [a for a in answers if "paris" not in a.lower()]
        for a in wrong[:3]:
            print(f"  {arm}, not naming Paris: {' '.join(a.split())[:100]!r}")


if __name__ == "__main__":
    main()
