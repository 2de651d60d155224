"""gpt-oss's MXFP4 experts on a bf16 CPU path: kept 4-bit (int4 groups, their grid fitted to
each block's FP4 levels, or min/max), int8 rows from the dequantized values, or bf16 (the
dequantized values, exact): the logits' distance to the bf16 experts' and decode speed.

    python bench/mxfp4_experts.py [--layers 2] [--hidden 1024] [--tokens 16] [--json OUT]

The model: the ``gpt-oss-20b`` preset (its shapes, random weights, experts written as MXFP4 as
the Hub ships them) cut to ``--layers`` layers (the folder ``bench/decode.py --moe`` writes; ``--hidden`` shrinks
the hidden and expert sizes, for a quicker load),
loaded on the ``bf16-packed`` path (its attention and head prepacked bf16) with each way of
holding the experts (``sizing.MXFP4_EXPERTS``, set here). The reference is the bf16 experts: the
dequantized MXFP4 values are exact in bf16. Prompts: 4 of 16 tokens, their last positions'
logits compared (relative L2 error, cosine, top-1 agreement); then decode tok/s at 1 stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import bench_engine, prompts  # noqa: E402
from bench.pantheon_server import cpu_info  # noqa: E402
from pantheon.core import sizing  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers import cpu_paths  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.mxfp4 import int4_from_fp4  # noqa: E402
from workers.quant import int4_groups  # noqa: E402

VARIANTS = ("bf16", "int4-fitted", "int4-minmax", "int8")


def folder(layers: int, hidden: int | None) -> Path:
    from makemodel import make_model

    cache = Path(os.environ.get("PANTHEON_CACHE", Path.home() / ".cache" / "pantheon")) / "models"
    out = cache / f"gpt-oss-20b-{layers}l{f'-h{hidden}' if hidden else ''}"
    if not (out / "model.safetensors").exists():
        print(f"writing the gpt-oss-20b preset cut to {layers} layers to {out} ...", flush=True)
        if hidden:
            make_model(
                "gpt-oss-20b",
                out,
                num_hidden_layers=layers,
                mxfp4=True,
                hidden_size=hidden,
                intermediate_size=hidden,
            )
        else:
            make_model("gpt-oss-20b", out, num_hidden_layers=layers, mxfp4=True)
    return out


def load(path: Path, variant: str) -> Engine:
    sizing.MXFP4_EXPERTS = variant.split("-")[0]
    cpu_paths.int4_from_fp4 = int4_groups if variant == "int4-minmax" else int4_from_fp4  # pyright: ignore[reportAttributeAccessIssue]
    return Engine(
        str(path), cpu_path="bf16-packed", num_slots=4, kv_budget_bytes=64 << 20, compile_decode=False
    )


def last_logits(eng: Engine) -> torch.Tensor:
    rows: dict[str, torch.Tensor] = {}

    def keep(seqs, logits) -> None:
        for i, s in enumerate(seqs):
            rows.setdefault(s.request_id, logits[i].clone())

    eng.on_logits = keep
    for b, p in enumerate(prompts(4)):
        eng.submit(f"p{b}", p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_work():
        eng.step()
    eng.on_logits = None
    return torch.stack([rows[f"p{b}"] for b in range(4)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--hidden",
        type=int,
        help="hidden and expert sizes (default gpt-oss-20b's 2880; smaller loads faster)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = folder(args.layers, args.hidden)
    cpu = cpu_info()
    print(f"{path}; CPU {cpu['model_name']}, {args.threads} threads", flush=True)
    out: dict = {"model": str(path), "cpu": cpu, "rows": {}}
    ref: torch.Tensor | None = None
    for v in VARIANTS:
        t = time.perf_counter()
        eng = load(path, v)
        load_s = time.perf_counter() - t
        logits = last_logits(eng)
        if ref is None:
            ref = logits
        err = float((logits - ref).norm() / ref.norm())
        cos = float(torch.nn.functional.cosine_similarity(logits, ref, dim=-1).min())
        top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        bench_engine(eng, 1, 4, "cpu")
        tok_s = max(bench_engine(eng, 1, args.tokens, "cpu") for _ in range(2))
        row = {
            "load_s": load_s,
            "logits_rel_err": err,
            "min_cos": cos,
            "top1_agree": top1,
            "tok_s_1": tok_s,
            "step_read_MB": eng.step_read_bytes / 1e6,
        }
        out["rows"][v] = row
        print(
            f"  {v:<12} load {load_s:6.1f} s  logits rel err {err:.4f}  min cos {cos:.5f}  top-1 {top1:.2f}  "
            f"{tok_s:6.2f} tok/s  {row['step_read_MB']:.0f} MB read/step",
            flush=True,
        )
        eng.close()
        del eng
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
