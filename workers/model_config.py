"""The worker's view of a model's description (``pantheon.core.description``, shared with the
router's sizing: one parser), with its errors as ``LoadError``. No torch here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from pantheon.core.description import (
    ModelDescription,
    ModelError,
    RopeConfig,
    describe,
    gguf_description,
    read_description,
)
from pantheon.core.gguf import GGUFError, GGUFFile, find_gguf, read_gguf
from pantheon.core.protocol import LoadFailKind
from workers.errors import LoadError

ModelConfig = ModelDescription  # the name the engine's modules use for it
__all__ = [
    "ModelConfig",
    "RopeConfig",
    "config_from_dict",
    "gguf_config",
    "gguf_errors",
    "load_config",
    "read_model",
]


@contextmanager
def gguf_errors() -> Iterator[None]:
    """``GGUFError`` and ``ModelError`` raised inside become the same ``LoadError``."""
    try:
        yield
    except (GGUFError, ModelError) as e:
        raise LoadError(cast(LoadFailKind, e.kind), e.reason) from None  # a subset of the kinds


def load_config(model_path: str | Path) -> ModelDescription:
    """Read and check a model's description (a Hugging Face folder or a GGUF file)."""
    with gguf_errors():
        return read_description(model_path)


def read_model(model_path: str | Path) -> tuple[ModelDescription, GGUFFile | None]:
    """``load_config``, and the GGUF file's parsed header when the model is one: a load reads
    its tensors' places from it (``loader.load_model``'s ``gguf``) instead of parsing the header
    a second time (0.2 s for Qwen3.5's 248k-token vocabulary)."""
    with gguf_errors():
        found = find_gguf(model_path)
        if found is None:
            return read_description(model_path), None
        g = read_gguf(found)
        return gguf_description(g), g


def gguf_config(g: GGUFFile) -> ModelDescription:
    """The description of a parsed GGUF file (its metadata as a ``config.json``, checked as one:
    ``load_config``'s of the file)."""
    with gguf_errors():
        return gguf_description(g)


def config_from_dict(raw: dict, gen: dict, where: str) -> ModelDescription:
    """Check a ``config.json`` dict (``gen``: ``generation_config.json``, for EOS ids)."""
    with gguf_errors():
        return describe(raw, gen, where)
