"""Tool calling at the text level: reading the model's ``<tool_call>`` blocks, and ``tool_choice``.

Qwen, Hermes and most ChatML models write a call as JSON (the default, :data:`JSON_TOOL_FORMAT`)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`parse_tool_block` reads the JSON between the markers. The other formats (Qwen3.5's XML, Llama 3's,
Mistral's, ...) are :mod:`pantheon.chat.toolformats`'; :func:`tool_call_format` names a
template's. :func:`with_tool_prompt` lists the tools in the system message, in the generic form
below, for a template that takes no ``tools`` (SmolLM2's); :func:`resolve_tool_choice` turns a request's ``tools`` and ``tool_choice`` into what
the template and the emitter are given.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .partial_json import json_so_far, skip_ws

__all__ = [
    "GEMMA4_TOOL_FORMAT",
    "HARMONY_TOOL_FORMAT",
    "JSON_TOOL_FORMAT",
    "XML_TOOL_FORMAT",
    "ParsedToolCall",
    "ToolChoiceError",
    "ToolPolicy",
    "forced_call_prefix",
    "new_call_id",
    "parse_tool_block",
    "parse_unfinished_tool_block",
    "resolve_tool_choice",
    "tool_call_format",
    "generic_tool_prompt",
    "json_calls_so_far",
    "with_tool_prompt",
]

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

_ALPHANUMERIC = string.ascii_letters + string.digits

# What a model writes between the markers: ``{"name": ..., "arguments": {...}}`` ...
JSON_TOOL_FORMAT = "json"
# ... or ``<function=NAME>`` with one ``<parameter=P>`` element per argument (Qwen3.5, Qwen3-Coder).
XML_TOOL_FORMAT = "xml"
# gpt-oss's Harmony messages and Gemma 4's calls (read by their own parsers) and the other
# formats: ``pantheon.chat.toolformats``.
HARMONY_TOOL_FORMAT = "harmony"
GEMMA4_TOOL_FORMAT = "gemma4"


TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def generic_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The generic tool prompt (see the module doc): the tools' definitions, one JSON object a
    line, and the ``<tool_call>`` answer form."""
    listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE + listing + TOOLS_POSTAMBLE


def with_tool_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], prompt: str | None = None
) -> list[dict]:
    """``messages`` with a tool prompt (``prompt``, the model's format's; by default the generic
    one) in the system message: after a leading system message's text (and a blank line), else as
    a new system message first."""
    prompt = generic_tool_prompt(tools) if prompt is None else prompt
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        text = out[0]["content"]
        out[0]["content"] = f"{text}\n\n{prompt}" if text else prompt
        return out
    return [{"role": "system", "content": prompt}, *out]


def tool_call_format(template_source: str | None) -> str:
    """The name of the tool-call format a model writes, read from the chat template that renders
    its tools (:func:`pantheon.chat.toolformats.detect`, the only place that decides it)."""
    from .toolformats import detect

    return detect(template_source).name


def forced_call_prefix(tool_format: str, name: str | None) -> str:
    """The opening of a demanded call that the router writes into the prompt itself, so that the
    model only fills in the rest (the format's ``forced_prefix``)."""
    from .toolformats import get

    return get(tool_format).forced_prefix(name)


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


@dataclass(frozen=True)
class ParsedToolCall:
    """One call read from a tool block: the function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str | None = None  # the id the model wrote (Mistral's), else one is made


def _strip_fence(text: str) -> str:
    # Some models wrap the JSON in a Markdown code fence inside the block.
    if text.startswith("```"):
        first_newline = text.find("\n")
        if first_newline != -1 and text.endswith("```"):
            return text[first_newline + 1 : -3].strip()
    return text


def _one_call(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, Mapping):
        return None
    if isinstance(obj.get("function"), Mapping) and "name" not in obj:
        obj = obj["function"]  # {"type": "function", "function": {...}}, OpenAI's own shape
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    # "arguments" is Qwen's key, "parameters" Llama's.
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        # A model may write the arguments as a JSON string, as OpenAI transmits them.
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, Mapping):
        return None
    call_id = obj.get("id")
    return ParsedToolCall(
        name=name.strip(),
        arguments=json.dumps(args, ensure_ascii=False),
        id=call_id if isinstance(call_id, str) and call_id else None,
    )


def parse_tool_block(text: str) -> list[ParsedToolCall] | None:
    """Parse the inside of one ``<tool_call>`` block; None when it is not a well-formed call.

    Accepts surrounding whitespace, a code fence, ``{"name", "arguments"}`` (Qwen/Hermes) or
    ``{"name", "parameters"}`` (Llama) objects, arguments as an object or as JSON text, and several
    objects in a row or in a JSON list (each becomes a call). Arguments come back as compact-spaced
    JSON text with non-ASCII characters kept as they are.
    """
    body = _strip_fence(text.strip())
    if not body:
        return None
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _one_call(item)
            if call is None:
                return None
            calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n,;":
            pos += 1
    return calls or None


_PARTIAL_JSON_CALL = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*(.*))?', re.DOTALL
)


def parse_unfinished_tool_block(text: str) -> list[ParsedToolCall]:
    """The calls of a JSON ``<tool_call>`` block the output ended inside (``max_tokens``, a stop
    string): the whole calls it holds, and the cut-off last one as what it is, its name and its
    arguments text so far (``{"city": "Pa``, as OpenAI cuts arguments at ``length``). Empty when
    not even a name was finished; such a block is dropped, never shown as markup. (The XML
    format's: ``pantheon.chat.emitter``.)"""
    body = text.strip()
    if body.startswith("```"):
        body = body[3:].removeprefix("json").lstrip()
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            break
        items = [_one_call(item) for item in (obj if isinstance(obj, list) else [obj])]
        calls += [c for c in items if c is not None]
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n,;[":
            pos += 1
    m = _PARTIAL_JSON_CALL.match(body, pos)
    if m is not None:
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return calls
        calls.append(ParsedToolCall(name=name.strip(), arguments=(m.group(2) or "").rstrip()))
    return calls


def json_calls_so_far(body: str, pos: int = 0, *, wants_id: bool = False) -> list[ParsedToolCall]:
    """The calls of an open JSON block (from ``pos``: ``{"name": ..., "arguments": {...}}``
    objects, in a list or one after another, in a code fence or not), for streaming them: each
    call whose name came before its arguments, from its arguments' opening ``{`` on, with the
    arguments' JSON so far (:func:`pantheon.chat.partial_json.json_so_far`: what the block's
    parse will give, growing). Reading stops at anything it cannot stream (arguments written
    as a string, or before the name; the block's parse reads those whole). ``wants_id``: a call
    whose ``"id"`` follows its arguments (Mistral Nemo's) comes once it is whole, with its id."""
    i = skip_ws(body, pos)
    if body.startswith("```", i):
        i = body.find("\n", i)
        if i < 0:
            return []
    elif "```".startswith(body[i : i + 3]) and body[i : i + 1] == "`":
        return []
    calls: list[ParsedToolCall] = []
    decoder = json.JSONDecoder()
    while True:
        while i < len(body) and body[i] in " \t\r\n,;[":
            i += 1
        if i >= len(body) or body[i] != "{":
            return calls
        start, i = i, skip_ws(body, i + 1)
        name: str | None = None
        call_id: str | None = None
        streamed: ParsedToolCall | None = None
        while True:
            try:
                key, i = decoder.raw_decode(body, i) if body[i : i + 1] == '"' else (None, i)
            except ValueError:
                return calls
            i = skip_ws(body, i)
            if key is None or body[i : i + 1] != ":":
                return calls
            i = skip_ws(body, i + 1)
            if key in ("arguments", "parameters") and body[i : i + 1] == "{" and name is not None:
                if wants_id and call_id is None:  # the call comes whole, with its id
                    try:
                        obj, i = decoder.raw_decode(body, start)
                    except ValueError:
                        return calls
                    call = _one_call(obj)
                    if call is None:
                        return calls
                    calls.append(call)
                    break
                args, end = json_so_far(body, i)
                streamed = ParsedToolCall(name=name, arguments=args, id=call_id)
                calls.append(streamed)
                if end is None:
                    return calls
                i = end
            else:
                try:
                    value, i = decoder.raw_decode(body, i)
                except ValueError:
                    return calls
                if key == "name" and isinstance(value, str) and value.strip():
                    name = value.strip()
                elif key == "id" and isinstance(value, str) and value:
                    call_id = value
                elif key in ("name", "arguments", "parameters"):
                    return calls  # (not a call, or arguments it reads whole)
            i = skip_ws(body, i)
            if body[i : i + 1] == ",":
                i = skip_ws(body, i + 1)
                continue
            if body[i : i + 1] == "}":
                i += 1
                if streamed is None:
                    return calls  # a call without arguments: read whole
                break
            return calls


# ------------------------------------------------------------------ tool_choice


class ToolChoiceError(ValueError):
    """``tools`` / ``tool_choice`` are not valid together (a 400 for the client)."""


@dataclass(frozen=True)
class ToolPolicy:
    """What a request's ``tools`` and ``tool_choice`` mean for rendering and parsing.

    ``template_tools``: the tools to hand to the chat template (None: none). ``parse``: whether the
    emitter reads ``<tool_call>`` blocks (``Emitter(tools_enabled=...)``). ``choice``: "none",
    "auto", "required" or "function"; ``function``: the forced function's name for "function".
    Enforcing "required" and a named function is the HTTP layer's decision; they are passed through.
    """

    template_tools: list[dict[str, Any]] | None
    parse: bool
    choice: str
    function: str | None = None

    @property
    def required(self) -> bool:
        """The client demands a call ("required" or a named function)."""
        return self.choice in ("required", "function")


def _tool_names(tools: Sequence[Any]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ToolChoiceError(f"tools[{i}]: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f"tools[{i}]: 'function.name' is required")
        names.append(fn["name"])
    return names


def resolve_tool_choice(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None) -> ToolPolicy:
    """Read ``tools`` and ``tool_choice`` as OpenAI defines them.

    - ``none``: the tools are not passed to the template and tool parsing is off;
    - ``auto`` (the default with tools): tools passed, parsing on;
    - ``required`` and ``{"type": "function", "function": {"name": ...}}``: as ``auto``, with the
      demand recorded for the HTTP layer; the name must be one of the tools.

    Without tools the default is ``none``, and asking for a call is an error. Raises
    :class:`ToolChoiceError` for anything malformed.
    """
    if tools is not None and not isinstance(tools, Sequence):
        raise ToolChoiceError("'tools' must be a list")
    tools = list(tools or [])
    names = _tool_names(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice == "none":
            return ToolPolicy(template_tools=None, parse=False, choice="none")
        if tool_choice not in ("auto", "required"):
            raise ToolChoiceError(f"tool_choice {tool_choice!r} is not one of 'none', 'auto', 'required'")
        if not tools:
            if tool_choice == "auto":
                return ToolPolicy(template_tools=None, parse=False, choice="none")
            raise ToolChoiceError("tool_choice 'required' needs 'tools'")
        return ToolPolicy(template_tools=[dict(t) for t in tools], parse=True, choice=tool_choice)
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if (
            tool_choice.get("type") != "function"
            or not isinstance(fn, Mapping)
            or not isinstance(fn.get("name"), str)
        ):
            raise ToolChoiceError('tool_choice must be {"type": "function", "function": {"name": ...}}')
        if fn["name"] not in names:
            raise ToolChoiceError(f"tool_choice names function {fn['name']!r}, which is not in 'tools'")
        return ToolPolicy(
            template_tools=[dict(t) for t in tools], parse=True, choice="function", function=fn["name"]
        )
    raise ToolChoiceError("tool_choice must be a string or an object")
