"""The model's own multi-token-prediction head as its draft (``draft = "mtp"``, workers/mtp.py)
on Qwen3.5 at one stream: what a speculative step costs, and what it buys at a given acceptance.

    python bench/mtp.py [--layers 24] [--tokens 64] [--rounds 2] [--k 1,2,3]

No Qwen3.5 weights are on these machines, so the model is ``make-model``'s Qwen3.5-0.8B shapes
with random weights (``--layers`` cuts it), in process (``Engine``), greedy, one request at a
time (best of ``--rounds`` after a warm-up). Its random head's drafts are (almost) never
accepted, so each ``mtp k`` row is a speculative step that buys nothing: the model's k + 1
verify rows (its recurrent layers run them one after another, keeping each row's state) plus
the head's k passes. Against ``off`` (no speculation) that gives the cost ratio ``c`` = tok/s
of ``mtp k`` / tok/s of ``off``, and the speedup a real head would bring at acceptance ``a``
per draft: ``c * (1 - a^(k+1)) / (1 - a)`` tokens per step's time (vLLM reports ~0.8 for one
draft of Qwen3-Next's head). Also checked: the greedy tokens are the ones without speculation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pantheon_server import host_line  # noqa: E402
from makemodel import make_model  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers.engine import Engine  # noqa: E402

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3


def run(eng: Engine, spec: int, tokens: int, rounds: int) -> tuple[float, list[int]]:
    """Best decode tok/s of ``rounds`` answers (after a warm-up) and the answer's tokens."""
    best, out = 0.0, []
    for r in range(rounds + 1):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, speculative=spec)
        eng.submit(f"r{r}", PROMPT, params)
        got: list[int] = []
        first = 0.0
        while eng.has_work():
            for o in eng.step():
                if not got:
                    first = time.perf_counter()
                got.append(o.token)
        took = time.perf_counter() - first
        if r:  # round 0 warms up
            best = max(best, (len(got) - 1) / took)
        out = got
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", default="1,2,3", help="drafts per step to try")
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    torch.set_num_threads(2)
    print(host_line())
    with tempfile.TemporaryDirectory() as d:
        path = make_model("qwen3.5-0.8b", Path(d), num_hidden_layers=args.layers)
        print(f"model: qwen3.5-0.8b shapes, random weights, {args.layers} layers; {args.tokens} tokens")
        base = Engine(str(path), kv_budget_bytes=64 << 20)
        print(f"cpu path: {base.cpu_path}")
        off, want = run(base, 0, args.tokens, args.rounds)
        base.close()
        eng = Engine(str(path), kv_budget_bytes=64 << 20, draft="mtp")
        rows = [measure(eng, k, args, want) for k in ks]
        eng.close()
    print(
        f"{'':7} {'tok/s':>7} {'cost c':>7} {'accepted':>9} {'same':>5} {'x at a=0.6':>11} {'x at a=0.8':>11}"
    )
    print(f"{'off':7} {off:7.1f}")
    for k, tps, acc, same in rows:
        c = tps / off
        gain = [c * (1 - a ** (k + 1)) / (1 - a) for a in (0.6, 0.8)]
        a = f"{acc:.2f}" if acc is not None else "-"
        print(
            f"{'mtp ' + str(k):7} {tps:7.1f} {c:7.2f} {a:>9} {'yes' if same else 'NO':>5} "
            f"{gain[0]:11.2f} {gain[1]:11.2f}"
        )


def measure(eng: Engine, k: int, args, want: list[int]) -> tuple[int, float, float | None, bool]:
    d0, a0 = eng.spec.drafted, eng.spec.accepted
    tps, got = run(eng, k, args.tokens, args.rounds)
    d, a = eng.spec.drafted - d0, eng.spec.accepted - a0
    return k, tps, a / d if d else None, got == want


if __name__ == "__main__":
    main()
