"""The families ``make_model`` writes: one module each here (named as in ``pantheon/core/archs/``),
one line each in ``FAMILIES``. Adding a family is its module, its line, and its tests."""

from __future__ import annotations

from makemodel.families import bert, gemma3, gemma4, gpt_oss, llama, qwen3_5, qwen3_5_moe, qwen3_moe
from makemodel.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen3_5.FAMILY,
    gemma3.FAMILY,
    gemma4.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5_moe.FAMILY,
    gpt_oss.FAMILY,
    bert.FAMILY,
)


def _presets() -> dict[str, dict]:
    presets: dict[str, dict] = {}
    for f in FAMILIES:
        if clash := presets.keys() & f.presets.keys():
            raise RuntimeError(f"presets {sorted(clash)} are named by two families")
        presets.update(f.presets)
    return presets


PRESETS: dict[str, dict] = _presets()  # every family's presets: name -> HF config.json contents


def family_of(config: dict) -> Family:
    """The family that writes a config (by its top-level ``model_type``)."""
    model_type = config.get("model_type")
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"make-model writes no model_type {model_type!r}; known: {', '.join(known)}")
