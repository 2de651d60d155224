"""JSON numbers of bounded length: a JSON Schema rewritten so every number it admits ends.

llguidance writes a number as a regex with unbounded digit runs (``[0-9]*``, ``(\\.[0-9]+)?``),
so a small model that starts ``88.888`` may go on to ``max_tokens`` and the output never parses
(issue 39 §4). llama.cpp's json-schema-to-grammar bounds them: an integral part of at most 16
digits (``[1-9] [0-9]{0,15}``) and a fraction of at most 16. llguidance has no option for that,
so the schema says it in keywords it already enforces, added where the schema leaves them out:

- an integer lies in ``[-(2^53 - 1), 2^53 - 1]`` (``minimum`` / ``maximum``): 16 digits at most,
  the integers every JSON parser reads exactly (llguidance reads bounds as f64, which has no
  ``10^16 - 1``);
- a number in ``(-10^16, 10^16)`` (``exclusiveMinimum`` / ``exclusiveMaximum``), and is a
  ``multipleOf`` ``10^-FRACTION_DIGITS``: at most that many fraction digits, no trailing zeros
  past them. 10, not llama.cpp's 16: llguidance reads ``multipleOf`` through an f64 loop that
  turns ``1e-11`` and finer into a coefficient it refuses. A schema's own ``multipleOf`` (a
  decimal, so it bounds the fraction too) is kept.

A bound the schema gives is kept (``maximum: 1e300`` allows its 301 digits: what it asked for),
and so are ``const`` / ``enum`` schemas. Exponents are not written: llguidance's bounded
number regexes have none.

Values of any type (``{}``, ``true``, an object's absent ``additionalProperties``, an array's
absent ``items``) hold numbers too: in a schema compiled as the root they become a reference to
one recursive definition, ``#/$defs/{ANY}``: any JSON value whose numbers are so bounded. A
schema nested into a larger one (a tool's parameters inside a call's schema) cannot reach the
root's ``$defs``, so there (``root=False``) only the numbers the schema names are bounded.
"""

from __future__ import annotations

from typing import Any

INTEGRAL_DIGITS = 16  # as llama.cpp's integral-part
FRACTION_DIGITS = 10  # llguidance's multipleOf holds 10^-10 at the finest
ANY = "pantheon_json_value"  # the root definition of a bounded any-value

_MAX_INT = 2**53 - 1  # 16 digits
_I64 = 2**63 - 1
_FRACTION = float(f"1e-{FRACTION_DIGITS}")

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_COMPOSED = ("$ref", "anyOf", "oneOf", "allOf", "not", "const", "enum")


def bound_numbers(schema: Any, *, root: bool = True) -> Any:
    """``schema`` (a JSON Schema: a dict or a bool) with every number it admits bounded in
    length; ``root``: it is compiled as the root (any-values then bounded too). The input is
    not changed."""
    walk = _Walk(any_ref={"$ref": f"#/$defs/{ANY}"} if root else None)
    out = walk.schema(schema)
    if walk.used_any and isinstance(out, dict):
        ref = walk.any_ref
        value: dict[str, Any] = {"items": ref, "additionalProperties": ref}
        _add_bounds(value, integer=False)
        out = dict(out, **{"$defs": dict(out.get("$defs") or {}, **{ANY: value})})
    return out


class _Walk:
    def __init__(self, any_ref: dict[str, str] | None) -> None:
        self.any_ref = any_ref
        self.used_any = False

    def _any(self, schema: Any) -> Any:
        if self.any_ref is None:
            return schema
        self.used_any = True
        return self.any_ref

    def schema(self, s: Any) -> Any:
        if s is True or s == {}:
            return self._any(s)
        if not isinstance(s, dict):
            return s
        out = dict(s)
        for key in _SCHEMA_LISTS:
            if isinstance(s.get(key), list):
                out[key] = [self.schema(v) for v in s[key]]
        for key in _SCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                out[key] = {k: self.schema(v) for k, v in s[key].items()}
        items = s.get("items")
        out["items"] = [self.schema(v) for v in items] if isinstance(items, list) else self.schema(items)
        out["additionalProperties"] = self.schema(s.get("additionalProperties"))
        if items is None:
            del out["items"]
        if s.get("additionalProperties") is None:
            del out["additionalProperties"]

        types = s.get("type")
        kinds = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else None
        typeless = kinds is None and not any(k in s for k in _COMPOSED)
        if typeless or (
            kinds is not None and kinds & {"number", "integer"} and "const" not in s and "enum" not in s
        ):
            exact = kinds is not None and "number" not in kinds  # integers only
            _add_bounds(out, integer=exact)
        if self.any_ref is not None and (typeless or (kinds is not None and "object" in kinds)):
            out.setdefault("additionalProperties", self._any(True))
        if self.any_ref is not None and (typeless or (kinds is not None and "array" in kinds)):
            out.setdefault("items", self._any(True))
        return out


def _add_bounds(out: dict[str, Any], *, integer: bool) -> None:
    """Adds the bounds ``out`` lacks (see the module's docstring). An added bound lies beyond
    the schema's own other one (``minimum: 1e20`` gets ``maximum`` 1e21): never unsatisfiable."""
    lower = _bound(out, "minimum", "exclusiveMinimum")
    upper = _bound(out, "maximum", "exclusiveMaximum")
    limit = _MAX_INT if integer else float(10**INTEGRAL_DIGITS)
    if lower is None:
        far = -limit if upper is None or upper > -limit else 10 * upper
        out["minimum" if integer else "exclusiveMinimum"] = _clamp(far, integer)
    if upper is None:
        far = limit if lower is None or lower < limit else 10 * lower
        out["maximum" if integer else "exclusiveMaximum"] = _clamp(far, integer)
    if not integer and "multipleOf" not in out:
        out["multipleOf"] = _FRACTION


def _clamp(value: float, integer: bool) -> float | int:
    """An integer bound within llguidance's i64 (past it, its range regex saturates)."""
    return max(-_I64, min(_I64, int(value))) if integer else value


def _bound(s: dict[str, Any], inclusive: str, exclusive: str) -> float | None:
    """The schema's own bound on that side (draft 4's boolean ``exclusive*`` go with theirs)."""
    for key in (inclusive, exclusive):
        v = s.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None
