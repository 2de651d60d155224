"""``pantheon make-model``: random-weight Hugging Face model folders from presets.

A folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``tokenizer.json`` and ``tokenizer_config.json``, and loads as-is
with transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Weights are seeded per tensor (the seed and the tensor's name), generated in row chunks and
streamed straight into the safetensors file, so the same seed gives byte-identical files and a
1.2 GB model never sits in memory twice. torch is imported only inside the writer: importing this
module keeps the router free of torch.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import struct
import sys
from pathlib import Path

from pantheon.models import tokenizer_train as tt

# ---------------------------------------------------------------------------------------- presets

_TINY_VOCAB = -(-tt.VOCAB_SIZE // 64) * 64  # 4032: the tokenizer's size rounded up to 64
_IDS = dict(
    bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
    eos_token_id=tt.TOKEN_IDS[tt.EOS_TOKEN],
)
_TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=_TINY_VOCAB,
    max_position_embeddings=4096,
)
_COMMON = dict(
    attention_dropout=0.0,
    hidden_act="silu",
    initializer_range=0.02,
    rope_scaling=None,
    torch_dtype="bfloat16",
    use_cache=True,
    **_IDS,
)


def _qwen3(**shapes) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        attention_bias=False,
        max_window_layers=shapes["num_hidden_layers"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **_COMMON,
        **shapes,
    )


PRESETS: dict[str, dict] = {
    # Qwen3 architecture: per-head RMSNorm on q and k, no biases, tied embeddings.
    "tiny": _qwen3(**_TINY_SHAPES),
    # Llama: untied lm_head, no biases.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        mlp_bias=False,
        pretraining_tp=1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **_COMMON,
        **_TINY_SHAPES,
    ),
    # Qwen2: q/k/v biases (always on in Qwen2, so no attention_bias key), tied embeddings.
    "tiny-qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        max_window_layers=_TINY_SHAPES["num_hidden_layers"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **_COMMON,
        **_TINY_SHAPES,
    ),
    # Exactly Qwen3-0.6B's shapes (the tokenizer is ours, so only ids < 4000 are ever produced).
    "qwen3-0.6b": _qwen3(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    ),
}

# Std of the random multiplicative jitter on RMSNorm weights (1 + jitter * N(0, 1)): on for the
# tiny presets so that a wrong norm implementation shows up in tests; plain ones otherwise.
_NORM_JITTER = {"tiny": 0.1, "tiny-llama": 0.1, "tiny-qwen2": 0.1}
_STD = 0.02  # linears, embeddings and biases

_DTYPES = {  # accepted spelling -> (config name, safetensors name, bytes per element)
    "bfloat16": ("bfloat16", "BF16", 2),
    "bf16": ("bfloat16", "BF16", 2),
    "float16": ("float16", "F16", 2),
    "fp16": ("float16", "F16", 2),
    "half": ("float16", "F16", 2),
    "float32": ("float32", "F32", 4),
    "fp32": ("float32", "F32", 4),
    "float": ("float32", "F32", 4),
}

GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)

# --------------------------------------------------------------------------------------- tensors


def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, kind)`` of every tensor a config needs, in file order, HF names.

    ``kind`` is ``"normal"`` (std 0.02: linears, biases), ``"embed"`` (std 0.02 for the tokenizer's
    ids, zero rows for the padding ids past it) or ``"norm"`` (RMSNorm weight).
    """
    arch = config["model_type"]
    h, inner = config["hidden_size"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nq
    qkv_bias = arch == "qwen2" or bool(config.get("attention_bias"))
    o_bias = arch != "qwen2" and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))

    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], h), "embed")
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = [
            ("input_layernorm.weight", (h,), "norm"),
            ("self_attn.q_proj.weight", (nq * hd, h), "normal"),
            ("self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            ("self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            ("self_attn.o_proj.weight", (h, nq * hd), "normal"),
        ]
        if qkv_bias:
            layer += [
                (f"self_attn.{x}_proj.bias", (n * hd,), "normal")
                for x, n in (("q", nq), ("k", nkv), ("v", nkv))
            ]
        if o_bias:
            layer.append(("self_attn.o_proj.bias", (h,), "normal"))
        if arch == "qwen3":
            layer += [("self_attn.q_norm.weight", (hd,), "norm"), ("self_attn.k_norm.weight", (hd,), "norm")]
        layer += [
            ("post_attention_layernorm.weight", (h,), "norm"),
            ("mlp.gate_proj.weight", (inner, h), "normal"),
            ("mlp.up_proj.weight", (inner, h), "normal"),
            ("mlp.down_proj.weight", (h, inner), "normal"),
        ]
        if mlp_bias:
            layer += [
                (f"mlp.{x}_proj.bias", (n,), "normal")
                for x, n in (("gate", inner), ("up", inner), ("down", h))
            ]
        specs += [(p + name, shape, kind) for name, shape, kind in layer]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, tensor name): a tensor's values do not depend on file order."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def _tensor_chunks(name, shape, kind, *, seed, jitter, torch_dtype, chunk_elems=1 << 22):
    """Yield the tensor's bytes (little-endian, row-major) in chunks of whole rows."""
    import torch

    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    rows, row = shape[0], _numel(shape[1:])
    step = max(1, chunk_elems // row)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if kind == "norm":
            x = torch.ones(n * row)
            if jitter:
                x.add_(torch.randn(n * row, generator=gen), alpha=jitter)
        else:
            x = torch.randn(n * row, generator=gen).mul_(_STD)
            if kind == "embed" and start + n > tt.VOCAB_SIZE:
                # Padding rows past the tokenizer are zero, like untrained rows of a real
                # checkpoint: their logits sit at 0, so greedy decoding picks real tokens.
                x.view(n, row)[max(0, tt.VOCAB_SIZE - start) :] = 0
        x = x.to(torch_dtype)
        yield x.view(torch.uint8).numpy()  # raw bytes; numpy has no bfloat16


def _write_safetensors(path: Path, specs, st_dtype: str, itemsize: int, chunks_of) -> int:
    """Write one safetensors file tensor by tensor; return its data size in bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        size = _numel(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            for chunk in chunks_of(*spec):
                f.write(chunk)
    return offset


def _shard(specs, itemsize: int, shard_bytes: int | None) -> list[list]:
    """Split specs greedily into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    if not shard_bytes:
        return [specs]
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = _numel(spec[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_weights(
    out: Path, config: dict, *, seed: int, jitter: float, shard_bytes: int | None = None
) -> list[Path]:
    """Write the random weights for ``config`` into ``out``; return the safetensors paths."""
    import torch

    dtype_name, st_dtype, itemsize = _DTYPES[config["torch_dtype"]]
    torch_dtype = getattr(torch, dtype_name)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    def chunks_of(name, shape, kind):
        return _tensor_chunks(name, shape, kind, seed=seed, jitter=jitter, torch_dtype=torch_dtype)

    shards = _shard(tensor_specs(config), itemsize, shard_bytes)
    if len(shards) == 1:
        path = out / "model.safetensors"
        _write_safetensors(path, shards[0], st_dtype, itemsize, chunks_of)
        return [path]
    paths, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_safetensors(path, shard, st_dtype, itemsize, chunks_of)
        weight_map.update({name: path.name for name, _, _ in shard})
        paths.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)
    return paths


# ------------------------------------------------------------------------------------ the folder


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_model(
    preset: str,
    out: Path | str,
    *,
    seed: int = 0,
    dtype: str | None = None,
    shard_bytes: int | None = None,
    **config_overrides,
) -> Path:
    """Write the preset's folder into `out` (created if missing) and return it (as a Path).

    ``seed`` seeds the weights (same seed, same bytes). ``dtype`` (bfloat16 / float16 / float32)
    replaces the preset's. ``shard_bytes`` splits the weights into ``model-0000i-of-0000n``
    shards of at most that many bytes, with ``model.safetensors.index.json``.
    ``config_overrides`` replace (or add) keys of the preset's HF config, e.g.
    ``num_hidden_layers=3``, ``tie_word_embeddings=False``, ``rope_scaling={...}``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    config = copy.deepcopy(PRESETS[preset])
    config.update(copy.deepcopy(config_overrides))
    if dtype is not None:
        config["torch_dtype"] = dtype
    if config["torch_dtype"] not in _DTYPES:
        raise ValueError(f"unsupported dtype {config['torch_dtype']!r}; use bfloat16, float16 or float32")
    config["torch_dtype"] = _DTYPES[config["torch_dtype"]][0]
    config["dtype"] = config["torch_dtype"]  # transformers 5 spelling; 4.x reads torch_dtype
    if config["vocab_size"] < tt.VOCAB_SIZE:
        raise ValueError(f"vocab_size {config['vocab_size']} < tokenizer size {tt.VOCAB_SIZE}")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", dict(sorted(config.items())))
    endoftext = tt.TOKEN_IDS["<|endoftext|>"]
    generation = dict(
        bos_token_id=config["bos_token_id"],
        eos_token_id=[config["eos_token_id"], endoftext],
        pad_token_id=endoftext,
        **GENERATION_DEFAULTS,
    )
    _write_json(out / "generation_config.json", generation)
    tt.write_tokenizer(out, model_max_length=config["max_position_embeddings"])
    write_weights(out, config, seed=seed, jitter=_NORM_JITTER.get(preset, 0.0), shard_bytes=shard_bytes)
    return out


# ------------------------------------------------------------------------------------------- CLI


def _describe(name: str, config: dict) -> str:
    params = sum(_numel(shape) for _, shape, _ in tensor_specs(config))
    size = params * _DTYPES[config["torch_dtype"]][2]
    return (
        f"{name:<12} {config['architectures'][0]:<18} layers={config['num_hidden_layers']:<3} "
        f"hidden={config['hidden_size']:<5} vocab={config['vocab_size']:<7} "
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
        **dict(args.overrides),
    )
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {args.preset} to {out} ({size / 2**20:.1f} MiB)")
    return 0
