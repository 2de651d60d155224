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
from workers.gguf_blocks import BLOCKS, FLOATS, LAYOUT, Unpacked, dequantize
from workers.model_config import ModelConfig
from workers.models import Family, family, is_stacked, joined_part, keeps_blocks, unstacked


def table_blocks(g: GGUFFile, cfg: ModelConfig, name: str) -> str | None:
    """The block type tensor ``name`` (our name: the token table's, an untied head's) is stored
    as, when the family may take it as its blocks: a quantized block type whose rows are whole
    blocks, that the family's ``from_gguf`` keeps as it is (``_kept``); else None."""
    fam = family(cfg)
    t = next((t for t in g.tensors.values() if fam.gguf_name(t.name) == name), None)
    if t is None or t.type_name not in BLOCKS or len(t.shape) != 2:
        return None
    block, _ = LAYOUT[t.type_name]
    return t.type_name if t.shape[1] % block == 0 and _kept(fam, name, t, cfg, g.arch) else None


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
    lazy: bool = False,
) -> Iterator[tuple[Path, str, str, torch.Tensor | Unpacked]]:
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
    so: ``table_blocks``, ``workers/layers/block_embedding.py``). ``lazy``: a quantized tensor the
    family takes as it is comes as ``Unpacked`` (the loader unpacks it straight into its
    parameter); else every tensor comes as a tensor."""
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
        elif (pieces := _stack_pieces(fam, name, t, cfg, g.arch)) is not None:
            # a quantized stack (a mixture of experts' experts) unpacked a piece at a time: the
            # stack is never held whole in fp32 (0.8 GB a Qwen3-30B-A3B layer's gate, up, down)
            raw = raw_bytes(data, t)
            for piece, (start, stop, shape) in pieces:
                part = Unpacked(raw[start:stop], t.type_name, shape)
                yield g.path, f"{t.name!r} ({piece})", piece, part if lazy else part.tensor()
        elif (
            lazy and t.type_name in BLOCKS and _kept(fam, name, t, cfg, g.arch) and not joined_part(fam, name)
        ):
            yield (
                g.path,
                f"{t.name!r} ({t.type_name})",
                name,
                Unpacked(raw_bytes(data, t), t.type_name, t.shape),
            )
        else:
            native = FLOATS.get(t.type_name, torch.float32)
            w = fam.from_gguf(name, dequantize(raw_bytes(data, t), t.type_name, t.shape, native), cfg, g.arch)
            yield g.path, f"{t.name!r} ({t.type_name})", name, w
        release(data, t)


def _kept(fam: Family, name: str, t: GGUFTensor, cfg: ModelConfig, arch: str) -> bool:
    """Whether the family takes tensor ``name`` as the file holds it (its ``from_gguf`` returns
    the tensor itself: asked of one value viewed as its shape, stride 0). Not of a meta tensor:
    the meta device's ops (a ``torch.cat``) import ``torch._dynamo`` on their first call, 1.4 s
    of a Qwen3.5 load; a family's transform of this view costs what it costs on the tensor."""
    shaped = torch.zeros((), dtype=torch.float32).expand(t.shape)
    return fam.from_gguf(name, shaped, cfg, arch) is shaped


def _stack_pieces(
    fam: Family, name: str, t: GGUFTensor, cfg: ModelConfig, arch: str
) -> list[tuple[str, tuple[int, int, tuple[int, ...]]]] | None:
    """A quantized stacked tensor's pieces (``workers.models.unstacked``'s names) as byte ranges
    of its blocks: ``(piece, (first byte, last byte, shape))``, each piece a run of whole rows;
    None where the family transforms the stack on load (``from_gguf`` not the identity) or a
    piece is no such run (then the stack is unpacked whole, as any tensor)."""
    if t.type_name not in BLOCKS or not is_stacked(fam, name) or not _kept(fam, name, t, cfg, arch):
        return None
    shaped = torch.empty(t.shape, device="meta")  # where each piece lies, without its data
    block, nbytes = LAYOUT[t.type_name]
    out = []
    for piece, view in unstacked(fam, name, shaped):
        off, n = int(view.storage_offset()), int(view.numel())
        if not view.is_contiguous() or off % block or n % block or view.shape[-1] % block:
            return None
        out.append((piece, (off // block * nbytes, (off + n) // block * nbytes, tuple(view.shape))))
    return out


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
