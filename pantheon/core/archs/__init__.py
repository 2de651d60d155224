"""The architecture families the engine serves: the one list of architecture names.

Each family is a module here (torch-free: the router sizes models with it) and a module of the
same name in ``workers/models/`` (the torch layers, checkpoint names and cache builders). A
family claims Hugging Face class names (``architectures``) and GGUF ``general.architecture``
names, and turns a ``config.json`` dict into its ``ModelDescription``. Adding an architecture is
one module here, one in ``workers/models/``, their tests, and an entry in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pantheon.core.description import ModelDescription, ModelError

if TYPE_CHECKING:
    from pantheon.core.gguf import GGUFFile


@dataclass(frozen=True)
class Family:
    name: str  # also the module name under workers/models/
    hf_architectures: Mapping[str, str]  # transformers class name -> arch
    model_types: Mapping[str, str]  # config.json model_type -> arch (when no class name is known)
    gguf_architectures: Mapping[str, tuple[str, str]]  # GGUF arch -> (class name, model_type)
    describe: Callable[[dict, dict, str, str], ModelDescription]  # raw, gen, where, arch
    # Those of hf_architectures that name the base model without its head (``Qwen3Model``, as
    # sentence-transformers saves an embedding model): loaded as embedding models
    # (``pantheon.core.embedding``), never asked to generate.
    base_architectures: frozenset[str] = frozenset()
    # Fields of the family's own that a GGUF file's metadata holds, added to the config.json dict
    # that pantheon.core.gguf.hf_config builds from the fields every family has.
    gguf_config: Callable[[GGUFFile, dict], None] | None = None
    # What that function reads itself, which hf_config would otherwise refuse: per-layer arrays of
    # these metadata keys (without the "ARCH." prefix; hf_config then takes their first value), and
    # these tensors (``rope_freqs.weight``).
    gguf_own: frozenset[str] = frozenset()


def _families() -> tuple[Family, ...]:
    from pantheon.core.archs import bert, gemma3, gemma4, gpt_oss, llama, qwen3_5, qwen3_5_moe, qwen3_moe

    return (
        llama.FAMILY,
        qwen3_5.FAMILY,
        gemma3.FAMILY,
        gemma4.FAMILY,
        qwen3_moe.FAMILY,
        qwen3_5_moe.FAMILY,
        gpt_oss.FAMILY,
        bert.FAMILY,
    )


FAMILIES: tuple[Family, ...] = _families()


def supported() -> list[str]:
    return [a for f in FAMILIES for a in f.hf_architectures]


def family_of(raw: dict, where: str) -> tuple[Family, str]:
    """The family and arch a ``config.json`` dict names (its ``architectures``, else its
    ``model_type``); an ``unsupported`` error otherwise."""
    archs = raw.get("architectures") or []
    if isinstance(archs, list):
        for a in archs:
            for f in FAMILIES:
                if isinstance(a, str) and a in f.hf_architectures:
                    return f, f.hf_architectures[a]
    if not archs:
        mt = raw.get("model_type")
        for f in FAMILIES:
            if isinstance(mt, str) and mt in f.model_types:
                return f, f.model_types[mt]
    raise ModelError(
        "unsupported",
        f"{where}: field 'architectures' is {archs!r}: architecture not supported "
        f"(supported: {', '.join(supported())})",
    )


def names_base_model(raw: dict, family: Family) -> bool:
    """Whether a ``config.json`` dict's ``architectures`` name ``family``'s base model."""
    archs = raw.get("architectures") or []
    return isinstance(archs, list) and any(
        a in family.base_architectures for a in archs if isinstance(a, str)
    )


def gguf_family(arch: str) -> Family | None:
    return next((f for f in FAMILIES if arch in f.gguf_architectures), None)


def gguf_architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.gguf_architectures]
