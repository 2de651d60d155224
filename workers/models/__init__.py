"""The torch side of each architecture family, one module per family, found by the family's name
(``pantheon.models.archs`` holds the one list of architectures and their descriptions).

A family module provides:

- ``build(desc) -> DecoderLM``: the model on whatever device is current (the loader builds it on
  ``meta``, then gives each parameter storage on its die);
- ``targets(model, desc) -> dict[name, Target]``: which parameter rows each checkpoint tensor
  (by its Hugging Face name, text-model layout) fills: fusions are several names into one matrix;
- ``checkpoint_name(name) -> str | None``: a checkpoint tensor's name in ``targets``' terms (a
  multimodal checkpoint's ``model.language_model.*``), None for tensors the engine leaves out;
- ``gguf_name(name) -> str | None`` and ``from_gguf(name, tensor, desc, arch) -> tensor``: a GGUF
  tensor's Hugging Face name, and the converter's transformations undone (row permutations, ...).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple, Protocol, cast

import torch

from pantheon.models.description import ModelDescription
from workers.models.base import DecoderLM


class Target(NamedTuple):
    param: torch.Tensor  # the parameter (or buffer) it fills
    offset: int  # first row it fills
    rows: int  # rows it fills


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
