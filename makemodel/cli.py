"""``pantheon make-model``: random-weight Hugging Face model folders from presets.

``pantheon make-model --preset NAME --out DIR`` (or ``python -m makemodel``); ``--list`` prints
the presets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from makemodel.build import make_model, tensor_specs
from makemodel.families import PRESETS
from makemodel.family import text_config
from makemodel.writer import DTYPES, numel


def _describe(name: str, config: dict) -> str:
    params = sum(numel(shape) for _, shape, _ in tensor_specs(config))
    size = params * DTYPES[config["torch_dtype"]][2]
    text = text_config(config)
    return (
        f"{name:<17} {config['architectures'][0]:<31} layers={text['num_hidden_layers']:<3} "
        f"hidden={text['hidden_size']:<5} vocab={text['vocab_size']:<7} "
        f"params={params / 1e6:.2f}M  {config['torch_dtype']} ~{size / 2**20:.1f} MiB"
    )


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def cli(argv: list[str]) -> int:
    """``pantheon make-model --preset NAME --out DIR [--seed N] [--dtype D]``; ``--list``."""
    parser = argparse.ArgumentParser(prog="pantheon make-model", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the presets and exit")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="which preset to write")
    parser.add_argument("--out", type=Path, help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="weight dtype")
    parser.add_argument("--shard-bytes", type=int, help="split weights into shards of this size")
    parser.add_argument("--mxfp4", action="store_true", help="gpt-oss: experts as MXFP4 blocks and scales")
    parser.add_argument(
        "--gemma-tokenizer",
        action="store_true",
        help="Gemma 4: Gemma's kind of tokenizer (what llama.cpp's converter takes)",
    )
    parser.add_argument(
        "--vocab",
        type=Path,
        metavar="FILE.gguf",
        help="a GGUF file whose vocabulary replaces the preset's tokenizer (llama.cpp's "
        "models/ggml-vocab-*.gguf, or any model's); vocab_size and the BOS/EOS ids follow it",
    )
    parser.add_argument(
        "--fast-random",
        action="store_true",
        help="weights as windows of one pool of random values: written at the disk's speed "
        "(an 8B folder in seconds), for timing runs only",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        type=_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (JSON value), repeatable",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, config in PRESETS.items():
            print(_describe(name, config))
        return 0
    if not args.preset or not args.out:
        parser.print_usage(sys.stderr)
        print("pantheon make-model: --preset and --out are required (or --list)", file=sys.stderr)
        return 2
    out = make_model(
        args.preset,
        args.out,
        seed=args.seed,
        dtype=args.dtype,
        shard_bytes=args.shard_bytes,
        mxfp4=args.mxfp4,
        gemma_tokenizer=args.gemma_tokenizer,
        fast=args.fast_random,
        vocab=args.vocab,
        **dict(args.overrides),
    )
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {args.preset} to {out} ({size / 2**20:.1f} MiB)")
    return 0
