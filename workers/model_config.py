"""The worker's view of a model's description (``pantheon.core.description``, shared with the
router's sizing: one parser), with its errors as ``LoadError``. No torch here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from pantheon.core.description import ModelDescription, ModelError, RopeConfig, describe, read_description
from pantheon.core.gguf import GGUFError, GGUFFile, hf_config
from pantheon.core.protocol import LoadFailKind
from workers.errors import LoadError

ModelConfig = ModelDescription  # the name the engine's modules use for it
__all__ = ["ModelConfig", "RopeConfig", "config_from_dict", "gguf_config", "gguf_errors", "load_config"]


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


def gguf_config(g: GGUFFile) -> ModelDescription:
    """The description of a parsed GGUF file (its metadata as a ``config.json``, checked as one)."""
    with gguf_errors():
        return describe(hf_config(g), {}, f"{g.path} (GGUF metadata)")


def config_from_dict(raw: dict, gen: dict, where: str) -> ModelDescription:
    """Check a ``config.json`` dict (``gen``: ``generation_config.json``, for EOS ids)."""
    with gguf_errors():
        return describe(raw, gen, where)
