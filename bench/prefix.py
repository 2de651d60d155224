"""Prefix cache: time to first token per turn of a conversation, and a shared system prompt.

    python bench/prefix.py                        # tiny and qwen3-0.6b presets, CPU
    python bench/prefix.py --presets tiny --turns 10

1. A 10-turn conversation whose history reaches ~2,000 tokens (each turn: a new user message,
   then a short assistant reply that is appended to the history). TTFT of every turn with the
   prefix cache and without it (same engine settings otherwise), and their ratio.
2. 32 requests sharing a long system prompt, each with its own question, 8 slots: prefill
   tokens computed and requests per second, with and without the cache.

Both run the engine in-process (no HTTP), so the figures are the engine's own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import default_model  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers.engine import Engine  # noqa: E402


def tokens(seed: int, n: int, vocab: int = 3900) -> list[int]:
    """Deterministic pseudo-text ids inside the tokenizer's range."""
    return [(seed * 7919 + i * 104729) % vocab + 10 for i in range(n)]


def first_token_time(
    eng: Engine, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[int], int]:
    """Submit, step until the first token: (seconds, all generated tokens, cached tokens)."""
    t = time.perf_counter()
    eng.submit(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    ttft, out, cached = None, [], 0
    while eng.has_work():
        for o in eng.step():
            if ttft is None:
                ttft = time.perf_counter() - t
                cached = o.cached_tokens or 0
            out.append(o.token)
    return ttft, out, cached


def engine(path: str, cache: bool) -> Engine:
    """The engine both runs measure: bf16, eager (no background compile), with or without the prefix cache."""
    return Engine(
        path,
        dtype="bfloat16",
        kv_budget_bytes=512 << 20,
        prefix_cache=cache,
        max_model_len=8192,
        compile_decode=False,
    )


def conversation(
    path: str, cache: bool, turns: int, user_len: int, reply: int
) -> list[tuple[int, float, int]]:
    eng = engine(path, cache)
    first_token_time(eng, "warm", tokens(999, 32), 2)
    if cache:
        eng.reset_cache()
    history: list[int] = tokens(0, 64)  # a system prompt
    rows = []
    for t in range(turns):
        history += tokens(t + 1, user_len)
        ttft, out, cached = first_token_time(eng, f"t{t}", list(history), reply)
        rows.append((len(history), ttft, cached))
        history += out
    return rows


def shared_prompt(path: str, cache: bool, n: int, system_len: int, question: int) -> tuple[float, int]:
    eng = engine(path, cache)
    system = tokens(4242, system_len)
    computed = 0
    orig = eng.scheduler.commit

    def counting(plan):
        nonlocal computed
        computed += sum(k for _s, k in plan.prefill)
        orig(plan)

    eng.scheduler.commit = counting
    t = time.perf_counter()
    for i in range(n):
        eng.submit(
            f"q{i}",
            system + tokens(i, question),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
    while eng.has_work():
        eng.step()
    return n / (time.perf_counter() - t), computed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,qwen3-0.6b")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-len", type=int, default=180)
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1024)
    args = ap.parse_args()
    for preset in args.presets.split(","):
        path = str(default_model(preset))
        print(f"\n== {preset} ({path})")
        on = conversation(path, True, args.turns, args.user_len, args.reply)
        off = conversation(path, False, args.turns, args.user_len, args.reply)
        print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'ttft cache':>12}{'ttft none':>11}{'ratio':>8}")
        for i, ((n, t_on, c), (_, t_off, _c)) in enumerate(zip(on, off)):
            print(f"{i + 1:>4}{n:>8}{c:>8}{t_on * 1000:>10.1f}ms{t_off * 1000:>9.1f}ms{t_off / t_on:>7.1f}x")
        rps_on, comp_on = shared_prompt(path, True, args.requests, args.system_len, 48)
        rps_off, comp_off = shared_prompt(path, False, args.requests, args.system_len, 48)
        print(f"shared {args.system_len}-token system prompt, {args.requests} requests, 8 slots:")
        print(
            f"  prefill tokens computed: {comp_on} with cache, {comp_off} without "
            f"({comp_off - comp_on} saved, {1 - comp_on / comp_off:.0%})"
        )
        print(f"  requests/s: {rps_on:.2f} with cache, {rps_off:.2f} without ({rps_on / rps_off:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
