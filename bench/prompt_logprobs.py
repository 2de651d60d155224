"""What prompt logprobs cost a prefill: the same prompt scored with and without them.

    python bench/prompt_logprobs.py                  # SmolLM2-135M Q4_1 GGUF, 512 and 2048 tokens
    python bench/prompt_logprobs.py --model PATH --lengths 512,2048 --k 5 --reps 3

For each length, random prompts (a new one per run; the prefix cache is off, so no run reuses
another's blocks) are prefilled with ``max_tokens=1``, plainly and with ``prompt_logprobs=K``,
alternating. Printed: the median wall seconds of each and their ratio. The extra work is the LM
head over every prompt row (not only the last) and a log-softmax and top-K per row
(``workers/prompt_logprobs.py``). On a shared host noise only slows a run down: prefer the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pantheon_server import host_line  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers.engine import Engine  # noqa: E402


def score(eng: Engine, prompt: list[int], rid: str, k: int | None) -> float:
    """Seconds to prefill ``prompt`` and give its one token (with its prompt logprobs if ``k``)."""
    t0 = time.perf_counter()
    eng.submit(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), prompt_logprobs=k)
    while eng.has_work():
        for out in eng.step():
            assert (out.prompt_logprobs is not None) == (k is not None)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from pantheon.serve import smollm2_file

        args.model = str(smollm2_file())
    eng = Engine(args.model, prefix_cache=False, kv_budget_bytes=1 << 30, compile_decode=False)
    rng = random.Random(0)
    vocab = eng.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    score(eng, prompt(64), "warm", args.k)
    print(f"host: {host_line()}; model {Path(args.model).name}, vocab {vocab}, K {args.k}")
    for n in (int(x) for x in args.lengths.split(",")):
        plain, asked = [], []
        for r in range(args.reps):
            plain.append(score(eng, prompt(n), f"p{n}-{r}", None))
            asked.append(score(eng, prompt(n), f"a{n}-{r}", args.k))
        a, b = statistics.median(plain), statistics.median(asked)
        print(f"{n:>6} tokens: plain {a:.3f} s, with prompt logprobs {b:.3f} s ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
