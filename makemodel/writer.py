"""Random weights streamed into safetensors files, and the folder's JSON files.

Weights are seeded per tensor (the seed and the tensor's name), generated in row chunks and
streamed straight into the file, so the same seed gives byte-identical files and a 1.2 GB model
never sits in memory twice. torch is imported only inside the functions that draw.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from makemodel.family import TensorSpec

STD = 0.02  # linears, embeddings and biases

# A tensor's random values as consecutive byte chunks: ``chunks_of(name, shape, kind)``
ChunksOf = Callable[[str, tuple[int, ...], str], "Iterator[np.ndarray]"]

DTYPES = {  # accepted spelling -> (config name, safetensors name, bytes per element)
    "bfloat16": ("bfloat16", "BF16", 2),
    "bf16": ("bfloat16", "BF16", 2),
    "float16": ("float16", "F16", 2),
    "fp16": ("float16", "F16", 2),
    "half": ("float16", "F16", 2),
    "float32": ("float32", "F32", 4),
    "fp32": ("float32", "F32", 4),
    "float": ("float32", "F32", 4),
}


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, tensor name): a tensor's values do not depend on file order.

    A VLM's text tensors are seeded under their text-only names (``model.language_model.X`` as
    ``model.X``): tiny-qwen3.5 and tiny-qwen3.5-text hold the same text model.
    """
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@functools.cache
def _fast_pool(torch_dtype: torch.dtype, elems: int) -> torch.Tensor:
    """``elems`` normal values (times ``STD``) in ``torch_dtype``, drawn once: the windows of
    ``fast`` weights (``_tensor_chunks``)."""
    import torch

    gen = torch.Generator().manual_seed(0x5EED)
    return torch.randn(elems, generator=gen).mul_(STD).to(torch_dtype)


def _tensor_chunks(
    name: str,
    shape: tuple[int, ...],
    kind: str,
    *,
    seed: int,
    jitter: float,
    torch_dtype: torch.dtype,
    real_vocab: int,
    chunk_elems: int = 1 << 22,
    fast: bool = False,
) -> Iterator[np.ndarray]:
    """Yield the tensor's bytes (little-endian, row-major) in chunks of whole rows.

    ``fast``: a weight chunk is a window, at a seeded random offset, of one pool of normal values
    drawn once (``_fast_pool``) instead of fresh draws: the same distribution per element, not
    independent across chunks, and written at the disk's speed rather than the generator's (an
    8B-parameter folder in seconds, for timing runs; the reference tests use the default).
    """
    import torch

    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    rows, row = shape[0], numel(shape[1:])
    step = max(1, chunk_elems // row)
    pool = _fast_pool(torch_dtype, 2 * chunk_elems) if fast else None
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if kind in ("norm", "norm0"):  # centred on 1 (x * w) or on 0 (x * (1 + w), biases)
            x = torch.ones(n * row) if kind == "norm" else torch.zeros(n * row)
            if jitter:
                x.add_(torch.randn(n * row, generator=gen), alpha=jitter)
        elif kind == "A_log":
            x = torch.empty(n * row).uniform_(0.01, 16.0, generator=gen).log_()
        elif pool is not None and n * row <= pool.numel() // 2:
            at = int(torch.randint(0, pool.numel() - n * row + 1, (1,), generator=gen))
            x = pool[at : at + n * row]
            if kind == "embed" and start + n > real_vocab:
                x = x.clone()
                x.view(n, row)[max(0, real_vocab - start) :] = 0
            yield x.view(torch.uint8).numpy()
            continue
        else:
            x = torch.randn(n * row, generator=gen).mul_(STD)
            if kind == "embed" and start + n > real_vocab:
                # Padding rows past the tokenizer are zero, like untrained rows of a real
                # checkpoint: their logits sit at 0, so greedy decoding picks real tokens.
                x.view(n, row)[max(0, real_vocab - start) :] = 0
        x = x.to(torch_dtype)
        yield x.view(torch.uint8).numpy()  # raw bytes; numpy has no bfloat16


def _write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    st_dtype: str,
    itemsize: int,
    chunks_of: Callable[[str, tuple[int, ...], str], Iterator[np.ndarray]],
) -> int:
    """Write one safetensors file tensor by tensor; return its data size in bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        size = numel(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            for chunk in chunks_of(*spec):
                f.write(chunk.data)  # the raw bytes, uncopied
    return offset


def _shard(specs: list[TensorSpec], itemsize: int, shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Split specs greedily into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    if not shard_bytes:
        return [specs]
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = numel(spec[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_weights(
    out: Path,
    specs: list[TensorSpec],
    dtype: str,
    *,
    seed: int,
    jitter: float,
    real_vocab: int,
    shard_bytes: int | None = None,
    fast: bool = False,
    whole: Callable[[ChunksOf], None] | None = None,
) -> list[Path]:
    """Write random weights for ``specs`` in ``dtype`` (a ``DTYPES`` key) into ``out``; return
    the safetensors paths. ``whole``: writes the one ``model.safetensors`` itself from the
    tensors' chunks (a family's own storage: gpt-oss's MXFP4 experts, ``Family.mxfp4``).

    Embedding (and lm_head) rows from ``real_vocab`` on, the ids the tokenizer never produces, are
    zero. ``fast``: windows of one pool of random values (``_tensor_chunks``), for timing runs.
    """
    import torch

    dtype_name, st_dtype, itemsize = DTYPES[dtype]
    torch_dtype = getattr(torch, dtype_name)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    def chunks_of(name: str, shape: tuple[int, ...], kind: str) -> Iterator[np.ndarray]:
        return _tensor_chunks(
            name,
            shape,
            kind,
            seed=seed,
            jitter=jitter,
            torch_dtype=torch_dtype,
            real_vocab=real_vocab,
            fast=fast,
        )

    if whole is not None:
        whole(chunks_of)
        return [out / "model.safetensors"]
    shards = _shard(specs, itemsize, shard_bytes)
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
    write_json(out / "model.safetensors.index.json", index)
    return paths
