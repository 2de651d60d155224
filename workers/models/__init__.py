"""The torch side of each architecture family, one module per family, found by the family's name
(``pantheon.core.archs`` holds the one list of architectures and their descriptions).

A family module provides:

- ``build(desc) -> DecoderLM``: the model on whatever device is current (the loader builds it on
  ``meta``, then gives each parameter storage on its die);
- ``targets(model, desc) -> dict[name, Target]``: which parameter rows each checkpoint tensor
  (by its Hugging Face name, text-model layout) fills: fusions are several names into one matrix;
- ``checkpoint_name(name) -> str | None``: a checkpoint tensor's name in ``targets``' terms (a
  multimodal checkpoint's ``model.language_model.*``), None for tensors the engine leaves out;
- ``gguf_name(name) -> str | None`` and ``from_gguf(name, tensor, desc, arch) -> tensor``: a GGUF
  tensor's Hugging Face name, and the converter's transformations undone (row permutations, ...);
- optionally ``stacked(name) -> bool`` and ``unstack(name, tensor) -> [(name, tensor)]``: a
  checkpoint tensor that stacks several targets along its first dimension (a mixture of experts'
  experts, as transformers 5 fuses them or llama.cpp merges them), and its pieces under
  ``targets``' names (views, no copy). ``unstacked`` and ``is_stacked`` apply them;
- optionally ``joined(name) -> (key, part) | None`` and ``join(key, parts) -> pieces | None``:
  checkpoint tensors that are parts of one weight together (MXFP4's ``*_blocks`` and
  ``*_scales``): the loader holds a key's parts (``{part: tensor}``) until ``join`` gives the
  weight's pieces under ``targets``' names (an iterator, so a large stack is made one piece at a
  time), None while parts are missing. ``joined_part`` and ``joined_pieces`` apply them;
- optionally ``gguf_blocks(type_name) -> bool``: a GGUF block type the family's model holds as it
  is (gpt-oss's MXFP4 experts): such tensors come as their blocks (``[..., rows, blocks, block
  bytes]`` uint8), not dequantized. ``keeps_blocks`` applies it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import NamedTuple, Protocol, cast

import torch

from pantheon.core.description import ModelDescription
from workers.models.base import DecoderLM


class Target(NamedTuple):
    param: torch.Tensor  # the parameter (or buffer) it fills
    offset: int  # first row it fills
    rows: int  # rows it fills
    # called once its rows are filled (a piece converted as it arrives: ``loader._experts_on_arrival``)
    then: Callable[[], None] | None = None


class Family(Protocol):
    def build(self, desc: ModelDescription) -> DecoderLM: ...
    def targets(self, model: DecoderLM, desc: ModelDescription) -> dict[str, Target]: ...
    def checkpoint_name(self, name: str) -> str | None: ...
    def gguf_name(self, name: str) -> str | None: ...
    def from_gguf(
        self, name: str, tensor: torch.Tensor, desc: ModelDescription, arch: str
    ) -> torch.Tensor: ...


def family(desc: ModelDescription) -> Family:
    """The module of ``desc``'s family."""
    mod: ModuleType = importlib.import_module(f"workers.models.{desc.family}")
    return cast(Family, mod)


Unstack = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def is_stacked(fam: Family, name: str) -> bool:
    """Whether checkpoint tensor ``name`` stacks several of the family's targets."""
    f = cast("Callable[[str], bool] | None", getattr(fam, "stacked", None))
    return f is not None and f(name)


def unstacked(fam: Family, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A stacked checkpoint tensor's pieces under ``targets``' names; any other tensor as it is."""
    f = cast("Unstack | None", getattr(fam, "unstack", None))
    return f(name, tensor) if f is not None and is_stacked(fam, name) else [(name, tensor)]


Join = Callable[[str, dict[str, torch.Tensor]], "Iterator[tuple[str, torch.Tensor]] | None"]


def joined_part(fam: Family, name: str) -> tuple[str, str] | None:
    """(the weight's key, which part) when checkpoint tensor ``name`` is a part of one weight."""
    f = cast("Callable[[str], tuple[str, str] | None] | None", getattr(fam, "joined", None))
    return None if f is None else f(name)


def joined_pieces(
    fam: Family, key: str, parts: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The pieces of weight ``key`` once ``parts`` holds all it needs; None before."""
    f = cast("Join | None", getattr(fam, "join", None))
    return None if f is None else f(key, parts)


def keeps_blocks(fam: Family, type_name: str) -> bool:
    """Whether GGUF tensors of block type ``type_name`` reach the family as their blocks."""
    f = cast("Callable[[str], bool] | None", getattr(fam, "gguf_blocks", None))
    return f is not None and f(type_name)
