"""Decode speed: our engine against transformers' ``generate``, in one process, same folder.

    python bench/decode.py                      # qwen3-0.6b preset, bf16, CPU, batch 1 and 8
    python bench/decode.py --model DIR --batches 1,4,8 --tokens 64 --device cuda:0

Prints tokens/s for each batch size (aggregate over the batch, decode only: prefill is
timed apart and left out), transformers' figure, their ratio, and the fraction of the
memory-bandwidth limit: weight bytes read per step over a bandwidth this script measures
(a large tensor copy, read + write bytes over time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pantheon.protocol import SamplingParams  # noqa: E402
from workers.engine import Engine  # noqa: E402


def default_model(preset: str) -> Path:
    from pantheon.makemodel import make_model

    out = Path(os.environ.get("PANTHEON_CACHE", Path.home() / ".cache" / "pantheon")) / "models" / preset
    if not (out / "model.safetensors").exists():
        print(f"writing the {preset} preset to {out} ...", flush=True)
        make_model(preset, out)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large copy, counting the bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def prompts(batch: int, length: int = 16) -> list[list[int]]:
    return [[(17 * b + 31 * i) % 1000 + 10 for i in range(length)] for b in range(batch)]


def bench_engine(eng: Engine, batch: int, tokens: int, device: str) -> float:
    """Aggregate decode tokens/s at ``batch`` concurrent sequences."""
    for b, p in enumerate(prompts(batch)):
        eng.submit(f"r{b}", p, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    while any(s.num_output == 0 for s in eng.scheduler.running()) or eng.scheduler.waiting:
        eng.step()  # prefill every sequence first
    sync(device)
    t = time.perf_counter()
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    sync(device)
    return batch * steps / (time.perf_counter() - t)


def bench_hf(model, batch: int, tokens: int, device: str) -> float:
    """Aggregate decode tokens/s of ``generate``: (time for N tokens - time for 1) per token."""
    import transformers

    ids = torch.tensor(prompts(batch), device=device)

    def run(n: int) -> float:
        gen = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        sync(device)
        return time.perf_counter() - t

    run(2)  # warm up
    return batch * tokens / (run(tokens + 1) - run(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the --preset, written on first use)")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--quantize", action="store_true", help="also run int8 weight-only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model(args.preset)
    batches = [int(b) for b in args.batches.split(",")]

    bw = measure_bandwidth(args.device)
    print(f"model {path}  device {args.device}  dtype {args.dtype}  threads {torch.get_num_threads()}")
    print(f"measured copy bandwidth: {bw / 1e9:.1f} GB/s (read + write)")

    variants = [("bf16" if args.dtype == "bfloat16" else args.dtype, False)]
    if args.quantize:
        variants.append(("int8", True))
    ours: dict[tuple[str, int], float] = {}
    weight_bytes: dict[str, int] = {}
    for label, quant in variants:
        eng = Engine(str(path), devices=[args.device], dtype=args.dtype, kv_budget_bytes=256 << 20, quantize=quant)
        weight_bytes[label] = eng.step_read_bytes
        bench_engine(eng, 1, 4, args.device)  # warm up
        for b in batches:
            ours[(label, b)] = bench_engine(eng, b, args.tokens, args.device)
        del eng

    hf: dict[int, float] = {}
    if not args.no_hf:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, args.dtype)
        ).to(args.device).eval()
        for b in batches:
            hf[b] = bench_hf(model, b, args.tokens, args.device)
        del model

    print()
    print(f"{'variant':<8}{'batch':>6}{'ours tok/s':>12}{'hf tok/s':>10}{'ratio':>8}{'ms/step':>9}{'of bw limit':>13}")
    for (label, b), tps in ours.items():
        step_s = b / tps
        limit_step_s = weight_bytes[label] / bw  # every streamed weight byte read once per step
        h = hf.get(b) if label in ("bf16", args.dtype) else None
        ratio = f"{tps / h:.2f}x" if h else "-"
        h_s = f"{h:.1f}" if h else "-"
        print(f"{label:<8}{b:>6}{tps:>12.1f}{h_s:>10}{ratio:>8}{step_s * 1000:>9.1f}{limit_step_s / step_s:>12.0%}")
    print(f"\nweights read per step: {weight_bytes[variants[0][0]] / 1e9:.2f} GB; "
          f"bandwidth limit at batch 1: {bw / weight_bytes[variants[0][0]]:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
