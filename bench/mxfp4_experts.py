"""gpt-oss's MXFP4 experts on the CPU: held as they ship and run by our MXFP4 kernel (the
default), against the former holding (int4 groups whose grid is fitted to each block's FP4
levels, torch's int4 kernel) and bf16 (the dequantized values, exact, oneDNN-prepacked), in one
run: the experts' matrix products alone, then a model's logits and decode speed.

    python bench/mxfp4_experts.py [--layers 2] [--hidden 1024] [--tokens 16] [--experts 8]
                                  [--skip-model] [--json OUT]

1. Kernels: one expert's gate_up ``[2I, H]`` and down ``[H, I]`` at gpt-oss-20b's shapes (2880),
   random MXFP4 codes, ``--experts`` of them cycled (more bytes than the caches hold, as a decode
   step's experts), x at 1 and 8 rows in bf16 (what the bf16 paths pass): ms per expert (both
   matrices) for each holding, rounds interleaved (the best of each), ratios to the kernel's.
2. Model: the ``gpt-oss-20b`` preset (random weights, experts written as MXFP4 as the Hub ships
   them) cut to ``--layers`` layers (``--hidden`` shrinks the hidden and expert sizes, for a
   quicker load), on the ``bf16-packed`` path, with each holding; the reference is bf16 (exact).
   Prompts: 4 of 16 tokens, their last positions' logits compared (relative L2 error, cosine,
   top-1 agreement); then decode tok/s at 1 stream (``--rounds`` interleaved, the best of each)
   and the experts' bytes a step reads.
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
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers import cpu_paths  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.kernels import qlinear  # noqa: E402
from workers.layers.moe import MoE  # noqa: E402
from workers.mxfp4 import MxExperts, int4_from_fp4  # noqa: E402
from workers.quant import QuantExperts  # noqa: E402

VARIANTS = ("bf16", "mxfp4", "int4-fitted")  # the first is the reference


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


def moes(eng: Engine) -> list[MoE]:
    assert eng.model is not None
    return [m for m in eng.model.modules() if isinstance(m, MoE)]


def hold(eng: Engine, variant: str) -> None:
    """The engine's MXFP4 experts (as loaded) held as ``variant`` says."""
    spec = cpu_paths.PATHS["bf16-packed"]
    for m in moes(eng):
        if variant == "mxfp4":
            continue
        m.unpack_mxfp4(torch.bfloat16)
        if variant == "bf16":
            m.lay_out(lambda w: cpu_paths.make_linear(spec, w, None))
        else:
            m.quantize("int4", int4_from_fp4)


def expert_bytes(eng: Engine) -> int:
    """Bytes of the routed experts one decode step reads (each layer's top k)."""
    return sum(m.top_k * m.per_expert_bytes() for m in moes(eng))


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


def kernels(experts: int, rounds: int = 7) -> dict:
    """ms per expert (gate_up and down) for each holding at 1 and 8 rows, gpt-oss-20b's shapes."""
    hidden = inter = 2880
    g = torch.Generator().manual_seed(0)
    held = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        mx = MxExperts(experts, n, k)
        mx.qs.copy_(torch.randint(0, 256, mx.qs.shape, generator=g).to(torch.uint8))
        mx.e.copy_(torch.randint(118, 124, mx.e.shape, generator=g).to(torch.uint8))  # weights ~2^-5
        w = mx.dequantized(torch.bfloat16)
        spec = cpu_paths.PATHS["bf16-packed"]
        held.append(
            {
                "mxfp4": mx,
                "int4-fitted": QuantExperts(w, "int4", int4_from_fp4),
                "bf16": [cpu_paths.make_linear(spec, w[i], None) for i in range(experts)],
            }
        )
    out: dict = {}
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, hidden, generator=g).bfloat16()
            best = {v: float("inf") for v in VARIANTS}
            for _ in range(rounds):
                for v in VARIANTS:
                    gu, dn = held[0][v], held[1][v]
                    t = time.perf_counter()
                    for e in range(experts):
                        y = gu[e](x)
                        dn[e](y[:, :inter].contiguous())
                    best[v] = min(best[v], (time.perf_counter() - t) / experts * 1e3)
            out[rows] = best
            ratios = "  ".join(f"{v} {best[v]:.2f} ms ({best[v] / best['mxfp4']:.2f}x)" for v in VARIANTS)
            print(f"  experts at {rows} row(s): {ratios}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="decode timings of each variant, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8, help="experts cycled in the kernel timing")
    ap.add_argument("--skip-model", action="store_true", help="the kernel timing only")
    ap.add_argument(
        "--hidden",
        type=int,
        help="hidden and expert sizes of the model (default gpt-oss-20b's 2880; smaller loads faster)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(f"CPU {cpu['model_name']}, {args.threads} threads; MXFP4 kernel: {qlinear.describe()}", flush=True)
    out: dict = {"cpu": cpu, "kernels_ms": kernels(args.experts), "rows": {}}
    if args.skip_model:
        print(json.dumps(out["kernels_ms"]))
        return 0
    path = folder(args.layers, args.hidden)
    out["model"] = str(path)
    print(path, flush=True)
    ref: torch.Tensor | None = None
    engines: dict[str, Engine] = {}
    for v in VARIANTS:  # all loaded at once: the decode timings below interleave them
        t = time.perf_counter()
        eng = Engine(
            str(path), cpu_path="bf16-packed", num_slots=4, kv_budget_bytes=64 << 20, compile_decode=False
        )
        hold(eng, v)
        load_s = time.perf_counter() - t
        logits = last_logits(eng)
        if ref is None:
            ref = logits
        out["rows"][v] = {
            "load_s": load_s,
            "logits_rel_err": float((logits - ref).norm() / ref.norm()),
            "min_cos": float(torch.nn.functional.cosine_similarity(logits, ref, dim=-1).min()),
            "top1_agree": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
            "experts_read_MB": expert_bytes(eng) / 1e6,
            "tok_s_1": 0.0,
        }
        bench_engine(eng, 1, 4, "cpu")  # warm
        engines[v] = eng
    for _ in range(args.rounds):  # rounds interleaved, the best of each: a busy host's bursts hit all
        for v, eng in engines.items():
            row = out["rows"][v]
            row["tok_s_1"] = max(row["tok_s_1"], bench_engine(eng, 1, args.tokens, "cpu"))
    for v, eng in engines.items():
        row = out["rows"][v]
        print(
            f"  {v:<12} load {row['load_s']:6.1f} s  logits rel err {row['logits_rel_err']:.4f}  min cos "
            f"{row['min_cos']:.5f}  top-1 {row['top1_agree']:.2f}  {row['tok_s_1']:6.2f} tok/s "
            f"({row['tok_s_1'] / out['rows']['mxfp4']['tok_s_1']:.2f}x)  experts {row['experts_read_MB']:.0f} MB read/step",
            flush=True,
        )
        eng.close()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
