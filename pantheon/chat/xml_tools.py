"""The XML tool-call format of Qwen3.5 and Qwen3-Coder: reading it, typing its values.

Inside the ``<tool_call>`` markers these models write one element per argument, as their chat
template teaches them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is raw text, not JSON: ``Paris`` is a string, and ``3`` only becomes a number because the
tool's JSON schema says ``days`` is one. :func:`convert_value` applies that schema the way vLLM's
``qwen3_coder`` parser does (a value that does not parse as its declared type stays a string), and
:func:`parse_xml_tool_block` turns the inside of one block into OpenAI calls with JSON arguments.
The grammar that forces this format (``tool_choice`` "required" or a named function) is built from
the same schema reading (:func:`parameter_schemas`, :func:`writes_as_text`), in
``pantheon.api.structured``.

Pure Python, like the rest of ``pantheon.chat``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .tools import ParsedToolCall

__all__ = ["convert_value", "parameter_schemas", "parse_xml_tool_block", "value_types", "writes_as_text"]

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# ``<function=NAME>`` / ``<parameter=NAME>``: a name is anything up to ``>`` on one line.
_FUNCTION_TAG = re.compile(r"\s*<function=([^<>\n]*)>")
_PARAMETER_TAG = re.compile(r"<parameter=([^<>\n]*)>")

_JSON_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_MAX_REF_DEPTH = 8  # a schema's $refs may loop; past this depth its type is "not said"


# ------------------------------------------------------------------ the tools' schemas


def parameter_schemas(tools: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    """``name``'s parameter schemas by parameter name (its ``properties``); {} for a function that
    is not in ``tools`` or declares no properties (its values then all stay strings).

    A property that refers to the root's ``$defs`` / ``definitions`` gets them copied in, so that
    each schema stands alone (the grammar compiles each one by itself)."""
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or fn.get("name") != name:
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if not isinstance(params, Mapping) or not isinstance(props, Mapping):
            return {}
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        return {str(k): ({**defs, **v} if defs and isinstance(v, Mapping) else v) for k, v in props.items()}
    return {}


def value_types(schema: Any, root: Any = None, depth: int = 0) -> frozenset[str]:
    """The JSON types a parameter schema allows: its ``type`` (a name or a list), else what its
    ``enum`` / ``const`` values are, else the union of its ``anyOf`` / ``oneOf`` branches, a local
    ``$ref`` followed (``root`` holds the ``$defs``). Empty when the schema does not say, or one
    branch does not (then: any, and the value is read as a string)."""
    if not isinstance(schema, Mapping) or depth > _MAX_REF_DEPTH:
        return frozenset()
    root = schema if root is None else root
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset([declared]) & frozenset(_JSON_TYPES)
    if isinstance(declared, list):
        return frozenset(t for t in declared if t in _JSON_TYPES)
    values = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values:
        return frozenset(_type_of(v) for v in values)
    if isinstance(schema.get("$ref"), str):
        return value_types(_resolve(root, schema["$ref"]), root, depth + 1)
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list) and branches:
        each = [value_types(b, root, depth + 1) for b in branches]
        return frozenset().union(*each) if all(each) else frozenset()
    return frozenset()


def _resolve(root: Any, ref: str) -> Any:
    """A local ``#/$defs/NAME`` (or ``#/definitions/NAME``) reference; None for any other."""
    parts = ref.split("/")
    if len(parts) == 3 and parts[0] == "#" and parts[1] in ("$defs", "definitions"):
        defs = root.get(parts[1]) if isinstance(root, Mapping) else None
        return defs.get(parts[2]) if isinstance(defs, Mapping) else None
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def writes_as_text(schema: Any) -> bool:
    """Whether the model writes this parameter's value as raw text (a string may be, or the schema
    does not say) rather than as JSON (numbers, booleans, null, objects, arrays)."""
    types = value_types(schema)
    return not types or "string" in types


# ------------------------------------------------------------------ values


_INVALID = object()  # "not a value of the wanted type" (None is a real value: null)


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which are not JSON and could not be sent back as it.
    raise ValueError(name)


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return _INVALID


def _as_type(value: Any, types: frozenset[str]) -> Any:
    """``value`` (parsed JSON) if it is of one of ``types``, else ``_INVALID``."""
    kind = _type_of(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)  # 3.0 is an integer to JSON Schema
    return _INVALID


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema asks for.

    As vLLM's ``qwen3_coder`` parser: a parameter the schema allows a string for (or says nothing
    about) keeps its text, except ``null`` when null is allowed too and JSON of another type it
    allows (a union: llama.cpp's reading); otherwise the text is read as
    JSON and kept if it is of a declared type (``true`` / ``false`` in any case for booleans, since
    models trained on Python write ``True``). Text that does not parse as its type stays a string,
    so a call is never lost over a badly typed value.
    """
    types = value_types(schema)
    if not types or "string" in types:
        if text.strip() == "null" and "null" in types:
            return None
        # a union with a string (``["string", "integer"]``): text that is JSON of one of the other
        # types is that value, anything else the string (as llama.cpp reads it)
        others = types - {"string", "null"}
        parsed = _loads(text) if others else _INVALID
        typed = _INVALID if parsed is _INVALID else _as_type(parsed, frozenset(others))
        return text if typed is _INVALID else typed
    if "boolean" in types and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    parsed = _loads(text)
    typed = _INVALID if parsed is _INVALID else _as_type(parsed, types)
    return text if typed is _INVALID else typed


# ------------------------------------------------------------------ the markup


def _trim_value(value: str) -> str:
    """The template writes ``<parameter=P>\\nVALUE\\n</parameter>``: drop those two newlines only,
    so a value's own leading or trailing blank lines survive (as vLLM does)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parse_parameters(body: str) -> dict[str, str] | None:
    """The ``<parameter=P>value</parameter>`` elements of one function, by name; None when there is
    anything else than whitespace between them. A missing ``</parameter>`` ends the value at the
    next ``<parameter=`` or at the end of the function (models do drop it; vLLM accepts it too)."""
    params: dict[str, str] = {}
    pos = 0
    while True:
        tag = _PARAMETER_TAG.search(body, pos)
        if tag is None:
            return params if not body[pos:].strip() else None
        name = tag.group(1).strip()
        if body[pos : tag.start()].strip() or not name:
            return None
        following = _PARAMETER_TAG.search(body, tag.end())
        end = following.start() if following is not None else len(body)
        close = body.find(PARAMETER_CLOSE, tag.end(), end)  # only up to the next element: linear
        if close >= 0:
            value, pos = body[tag.end() : close], close + len(PARAMETER_CLOSE)
        else:
            value, pos = body[tag.end() : end], end
        params[name] = _trim_value(value)


def parse_xml_tool_block(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> list[ParsedToolCall] | None:
    """Parse the inside of one ``<tool_call>`` block in the XML format; None when it is not one.

    Each ``<function=NAME>...</function>`` is a call (several in one block are several calls); the
    last one may lack its ``</function>``. Values are typed by ``tools``' schemas
    (:func:`convert_value`); arguments come back as JSON text with non-ASCII characters as they
    are, like :func:`pantheon.chat.tools.parse_tool_block`. Anything else in the block (stray text,
    an empty name, JSON) makes it not a call, so the emitter returns it as the content it was.
    """
    calls: list[ParsedToolCall] = []
    pos = 0
    while text[pos:].strip():
        tag = _FUNCTION_TAG.match(text, pos)
        name = tag.group(1).strip() if tag is not None else ""
        if tag is None or not name:
            return None
        close = text.find(FUNCTION_CLOSE, tag.end())
        end = close if close >= 0 else len(text)
        params = _parse_parameters(text[tag.end() : end])
        if params is None:
            return None
        schemas = parameter_schemas(tools, name)
        args = {k: convert_value(v, schemas.get(k)) for k, v in params.items()}
        calls.append(ParsedToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))
        pos = close + len(FUNCTION_CLOSE) if close >= 0 else len(text)
    return calls or None
