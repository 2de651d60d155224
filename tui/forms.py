"""Validation of the load form, before anything is sent to the router."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# A die as the router's --dies takes it: cpu:N, cuda:N, or a bare N (cuda:N).
DIE_RE = re.compile(r"^(?:cpu:\d+|cuda:\d+|\d+)$")

# The KV cache types the form offers, K and V together: "auto" sends no kv_cache_dtype (the
# router's --kv-cache-dtype then applies), q8_0 and q4_0 are sent as the load's option.
KV_CACHE_TYPES = ("auto", "q8_0", "q4_0")


@dataclass
class LoadRequest:
    """A validated load: what ``Source.load`` is called with."""

    path: str
    name: str | None
    dies: list[str] = field(default_factory=list)
    quantize: bool = False
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_TYPES


def parse_dies(text: str) -> list[str]:
    """``"cpu:0, 1"`` -> ``["cpu:0", "1"]``; raises ``ValueError`` naming the bad entry."""
    dies = [d.strip() for d in text.split(",")] if text.strip() else []
    for d in dies:
        if not DIE_RE.match(d):
            raise ValueError(
                f"bad die {d!r}: use cpu:N, cuda:N or N, comma separated"
                if d
                else "empty die in the list (a stray comma?)"
            )
    if len(set(dies)) != len(dies):
        raise ValueError("a die is listed twice")
    return dies


def validate_load(
    path: str, name: str, dies: str, quantize: bool, kv_cache_dtype: str = "auto"
) -> tuple[LoadRequest | None, dict[str, str]]:
    """The request, or ``None`` and an error message per field (``path``, ``name``, ``dies``,
    ``kv_cache_dtype``).

    The path is not checked for existence here: it names a folder on the router's host.
    """
    errors: dict[str, str] = {}
    path = path.strip()
    if not path:
        errors["path"] = "the model folder path is required"
    name = name.strip()
    if name and any(c.isspace() for c in name):
        errors["name"] = "a name cannot contain spaces"
    try:
        die_list = parse_dies(dies)
    except ValueError as e:
        errors["dies"] = str(e)
        die_list = []
    if kv_cache_dtype not in KV_CACHE_TYPES:
        errors["kv_cache_dtype"] = f"KV cache type {kv_cache_dtype!r}: use {', '.join(KV_CACHE_TYPES)}"
    if errors:
        return None, errors
    return LoadRequest(path, name or None, die_list, bool(quantize), kv_cache_dtype), {}
