"""Validation against the official OpenAI OpenAPI schemas in ../shared/specs (a test that checks
a body skips when the specs are missing)."""

from __future__ import annotations

import functools
import json

import jsonschema

from helpers.paths import need_specs


def _fix_nullable(node):
    """OpenAPI 3.0 ``nullable: true`` -> a JSON-Schema union with null (see specs/README.md)."""
    if isinstance(node, list):
        return [_fix_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _fix_nullable(v) for k, v in node.items()}
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _schemas() -> dict:
    doc = json.loads((need_specs() / "openai-openapi-chat-subset.json").read_text())
    return _fix_nullable(doc["components"]["schemas"])


@functools.cache
def schema_validator(name: str) -> jsonschema.Draft202012Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": {"schemas": _schemas()}}
    return jsonschema.Draft202012Validator(root)


def check(name: str, obj) -> None:
    errors = sorted(schema_validator(name).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
