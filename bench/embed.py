"""Embeddings: texts/s of ``POST /v1/embeddings`` at batch 1 (one text per request, one after
the other), 32 and 64 (that many texts per request), against sentence-transformers' ``encode``
with the same ``batch_size`` on the same model, in one run on the same host.

    python bench/embed.py                     # all-MiniLM-L6 shapes (tiny-bert, random weights)
    python bench/embed.py --model ST_FOLDER   # any sentence-transformers folder we serve

Both sides run in fp32 on the same cores (the server's worker with torch's default threads,
sentence-transformers in this process while the server idles); ours includes HTTP and JSON. On
a host shared with other jobs the load drifts within a run, so the two sides alternate,
``--rounds`` times per batch size, and each side's best round is reported.
The default model is ``tiny-bert`` written at all-MiniLM-L6-v2's shapes (hidden 384, 6 layers,
12 heads, intermediate 1536), since nothing is downloaded here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pantheon_server import cpu_info, serve  # noqa: E402

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
WORDS = (
    "retrieval vectors index query document passage search answer model server river bridge city "
    "language token sentence meaning close far similar different quick brown fox jumps over lazy dog"
).split()


def texts(n: int) -> list[str]:
    """``n`` sentences of 8 to 40 words (deterministic)."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + (i * 13) % 33)) for i in range(n)]


def ours(url: str, data: list[str], batch: int) -> float:
    with httpx.Client(timeout=600) as c:
        t0 = time.perf_counter()
        for i in range(0, len(data), batch):
            r = c.post(url + "/v1/embeddings", json={"model": "m", "input": data[i : i + batch]})
            r.raise_for_status()
        return len(data) / (time.perf_counter() - t0)


def theirs(st, data: list[str], batch: int) -> float:
    t0 = time.perf_counter()
    st.encode(data, batch_size=batch)
    return len(data) / (time.perf_counter() - t0)


def sentence_transformer(path: str):
    import torch
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="a sentence-transformers folder (default: tiny-bert, MiniLM shapes)"
    )
    ap.add_argument("--texts", type=int, default=256, help="texts per measurement")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64], help="texts per request")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size (best kept)")
    args = ap.parse_args()
    batches: list[int] = args.batches
    data = texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from makemodel import make_model

            path = str(make_model("tiny-bert", Path(tmp) / "minilm", **MINILM))
        cmd = ["--model", path, "--name", "m", "--dtype", "float32", "--cpu-path", "fp32"]
        st = sentence_transformer(path)
        ours_rates: dict[int, float] = {}
        theirs_rates: dict[int, float] = {}
        with serve(cmd, Path(tmp) / "serve.log") as url:
            for b in batches:
                ours(url, data[:b], b)  # warm
                theirs(st, data[:b], b)
                for _ in range(args.rounds):
                    ours_rates[b] = max(ours_rates.get(b, 0.0), ours(url, data, b))
                    theirs_rates[b] = max(theirs_rates.get(b, 0.0), theirs(st, data, b))
    cpu = cpu_info()
    print(f"host: {cpu['model_name']}, {cpu['cpus']} CPUs, avx512f {cpu['avx512']}; threads {os.cpu_count()}")
    print(
        f"model: {args.model or 'tiny-bert at all-MiniLM-L6 shapes (random weights)'}, fp32, {len(data)} texts, "
        f"best of {args.rounds} alternating rounds"
    )
    print(f"{'batch':>5} {'pantheon texts/s':>17} {'sentence-transformers':>22} {'ratio':>6}")
    for b in batches:
        print(
            f"{b:>5} {ours_rates[b]:>17.1f} {theirs_rates[b]:>22.1f} {ours_rates[b] / theirs_rates[b]:>5.2f}x"
        )


if __name__ == "__main__":
    main()
