"""GGUF tensors as torch tensors: the file mapped, Hugging Face names, llama's Q/K row order.

The file is memory-mapped once (copy-on-write, so torch gets writable views and nothing is ever
written back); each tensor's bytes become a uint8 tensor through ``torch.from_numpy`` without a
copy, and the block formats are unpacked into float32 by ``workers/gguf_blocks.py`` (the
formats' layouts are there); the loader casts as it copies into the parameters.
F32/F16/BF16 tensors are views of the map.

Tensor names and the converter's transformations (llama's q/k row order, ...) are the family's
(``workers/models/<family>.py``: ``gguf_name``, ``from_gguf``).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Container, Iterator
from pathlib import Path

import numpy as np
import torch

from pantheon.core.gguf import GGUFFile, GGUFTensor
from workers.errors import LoadError
from workers.gguf_blocks import BLOCKS, FLOATS, LAYOUT, dequantize
from workers.model_config import ModelConfig
from workers.models import family, keeps_blocks


def table_blocks(g: GGUFFile, cfg: ModelConfig, name: str) -> str | None:
    """The block type tensor ``name`` (our name: the token table's) is stored as, when the
    family may take it as its blocks: a quantized block type whose rows are whole blocks, that
    the family's ``from_gguf`` keeps as it is (checked on its first rows); else None."""
    fam = family(cfg)
    t = next((t for t in g.tensors.values() if fam.gguf_name(t.name) == name), None)
    if t is None or t.type_name in FLOATS or t.type_name not in BLOCKS or len(t.shape) != 2:
        return None
    block, nbytes = LAYOUT[t.type_name]
    if t.shape[1] % block:
        return None
    data = open_data(g)
    rows = min(2, t.shape[0])
    sample = dequantize(
        raw_bytes(data, t)[: rows * t.shape[1] // block * nbytes], t.type_name, (rows, t.shape[1])
    )
    kept = fam.from_gguf(name, sample.clone(), cfg, g.arch)
    return t.type_name if kept.shape == sample.shape and torch.equal(kept, sample) else None


# ---------------------------------------------------------------- the file's tensors


def open_data(g: GGUFFile) -> np.memmap:
    """The whole file, memory-mapped copy-on-write (writable for torch, never written back)."""
    return np.memmap(g.path, dtype=np.uint8, mode="c")


def raw_bytes(data: np.ndarray, t: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes as a uint8 torch tensor sharing the map's memory."""
    arr = data[t.offset : t.offset + t.nbytes]
    if t.type_name in FLOATS and t.offset % 4:
        arr = arr.copy()  # a file with a small alignment: views of wider types need aligned data
    return torch.from_numpy(arr)


def iter_tensors(
    g: GGUFFile,
    cfg: ModelConfig,
    wanted: Container[str],
    rename: Callable[[str], str | None] | None = None,
    as_blocks: Container[str] = (),
) -> Iterator[tuple[Path, str, str, torch.Tensor]]:
    """``(file, label, hf_name, tensor)`` for every tensor of the file our model uses
    (``wanted``), dequantized (float32, or the file's own float type; block types the family
    holds as they are as their blocks, ``workers.models.keeps_blocks``), named and laid out as the
    Hugging Face checkpoint has it (the family's ``gguf_name`` and ``from_gguf``); ``label``
    names it for errors. The loader's filling takes these as it takes safetensors', casting as
    it copies them into the parameters.
    A tensor our models do not have is an error (silently dropping it would change the model).
    ``rename``: reading a part of the file (``loader.load_part``): the family's name of each
    tensor renamed so (None: not the part's, skipped), before ``from_gguf``. ``as_blocks``: our
    names of tensors to give as their blocks whatever their type (a token table the model holds
    so: ``table_blocks``, ``workers/layers/block_embedding.py``)."""
    fam = family(cfg)
    data = open_data(g)
    for t in g.tensors.values():
        name = fam.gguf_name(t.name)
        if rename is not None:
            name = None if name is None else rename(name)
            if name is None:
                continue
        if name is None:
            raise LoadError(
                "unsupported", f"{g.path}: tensor {t.name!r} is not part of a {g.arch} model this engine runs"
            )
        if name not in wanted:
            continue
        if keeps_blocks(fam, t.type_name) or name in as_blocks:  # held as it is: no dequantization
            block, nbytes = LAYOUT[t.type_name]
            raw = raw_bytes(data, t).view(*t.shape[:-1], t.shape[-1] // block, nbytes)
            yield g.path, f"{t.name!r} ({t.type_name})", name, raw
        else:
            native = FLOATS.get(t.type_name, torch.float32)
            w = fam.from_gguf(name, dequantize(raw_bytes(data, t), t.type_name, t.shape, native), cfg, g.arch)
            yield g.path, f"{t.name!r} ({t.type_name})", name, w
        release(data, t)


def release(data: np.memmap, t: GGUFTensor) -> None:
    """Drop the map's pages of a tensor the loader has copied into its parameters (it resumes
    this generator only then): a page of a file map read once stays in the worker's resident
    memory until the map goes, which for a whole model's file doubled the load's peak (a 3 GB
    gpt-oss file: 6.2 GiB peak for 3.5 final). Pages read again later come back from the file."""
    mm = getattr(data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
    mm.madvise(mmap.MADV_DONTNEED, start, t.offset + t.nbytes - start)
