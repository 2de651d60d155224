"""Gemma 4's format, read by :class:`pantheon.chat.gemma4.Gemma4Parser`: thinking in
``<|channel>thought ... <channel|>``, calls as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``
in the template's own argument syntax. A demanded call's prompt holds ``<|tool_call>call:`` and,
for a forced function, ``NAME{``. Thinking is on when the template's ``enable_thinking`` is; a
request's ``reasoning_effort`` turns it on, ``"none"`` off, unless the client's
``chat_template_kwargs`` set ``enable_thinking`` themselves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..gemma4 import (
    CALL_CLOSE,
    CALL_OPEN,
    CHANNEL_CLOSE,
    CHANNEL_OPEN,
    GEMMA4_MARKERS,
    QUOTE,
    RESPONSE_OPEN,
    TURN_CLOSE,
    Gemma4Parser,
)
from .base import Messages, Speller, ToolFormat, Tools, parameters

if TYPE_CHECKING:
    from ..output import OutputParser

__all__ = ["Gemma4Format", "gemma4_kwargs", "gemma4_thinks"]

CALL_HEAD = CALL_OPEN + "call:"


def gemma4_kwargs(template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The template's keyword arguments with ``reasoning_effort`` read as ``enable_thinking``
    (see the module doc)."""
    template_kwargs = dict(template_kwargs)
    effort = template_kwargs.get("reasoning_effort")
    if effort is None or "enable_thinking" in template_kwargs:
        return template_kwargs
    return {**template_kwargs, "enable_thinking": effort != "none"}


def gemma4_thinks(template_kwargs: Mapping[str, Any]) -> bool:
    """Whether Gemma 4's template, given a request's ``chat_template_kwargs``, turns thinking on
    (else its generation prompt closes an empty thought channel)."""
    return bool(gemma4_kwargs(template_kwargs).get("enable_thinking"))


# ---------------------------------------------------------------- tool calls in Gemma 4's syntax
#
# The grammar spells a call as Gemma 4's template renders a past one (``format_argument``, keys in
# sorted order, as its ``dictsort`` writes them): ``NAME{key:value,...}``, strings between
# ``<|"|>`` markers, numbers, ``true`` / ``false``, nested ``{...}`` and ``[...]``. The prompt
# holds ``<|tool_call>call:`` and, for a forced function, ``NAME{``; the grammar ends at the
# call's ``}`` (the request ends there, and the parser reads the call whole). A vocabulary that
# has ``<|"|>`` as a token (Gemma 4's: a special one) gets it as a token reference (``quote_token``;
# llguidance matches no special token against text, so the text literal would be refused there);
# one without it, as text.

_GEMMA4_RULES = r"""
g_any: g_str | G_NUM | "true" | "false" | "None" | g_obj | g_arr
g_obj: "{" (G_KEY ":" g_any ("," G_KEY ":" g_any)*)? "}"
g_arr: "[" (g_any ("," g_any)*)? "]"
g_text[lazy]: /(?s:.*)<\|"\|>/
G_TEXT: /(?s:.+)/
G_KEY: /[A-Za-z_][A-Za-z0-9_]*/
G_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
G_INT: /-?(0|[1-9][0-9]*)/
"""

_GEMMA4_QUOTE = '"<|\\"|>"'  # ``<|"|>`` as a Lark string literal
_GEMMA4_QUOTE_TOKEN = '<|"|>'  # ... and as a reference to the token


class _Gemma4Lark:
    """The Lark rules of values of JSON schemas in Gemma 4's argument syntax."""

    def __init__(self, quote_token: bool) -> None:
        self.quote = q = _GEMMA4_QUOTE_TOKEN if quote_token else _GEMMA4_QUOTE
        # a string: as text, a lazy match up to the first closing marker; as a token, any text
        # between two of them (no text is that token)
        self.rules: list[str] = [f"g_str: {q} G_TEXT? {q}" if quote_token else f"g_str: {q} g_text"]

    def _rule(self, body: str) -> str:
        name = f"g{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "g_any"
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, (str, bool, int, float)) for v in enum):
            return "(" + " | ".join(self._literal(v) for v in dict.fromkeys(enum)) + ")"
        kind = schema.get("type")
        if kind == "string":
            return "g_str"
        if kind == "integer":
            return "G_INT"
        if kind == "number":
            return "G_NUM"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(schema.get("items"))
            return self._rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
            return self._rule('"{" ' + self.members(schema) + ' "}"')
        return "g_any"

    def _literal(self, v: str | bool | float) -> str:
        if isinstance(v, str):
            return f"{self.quote} {json.dumps(v)} {self.quote}" if v else f"{self.quote} {self.quote}"
        return json.dumps("true" if v is True else "false" if v is False else str(v))

    def members(self, schema: dict) -> str:
        """An object's members, in sorted key order, the required ones always, each optional one
        at most once: ``s_i`` (none written yet from key i on) and ``r_i`` (one was: each next is
        preceded by a comma)."""
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return '(G_KEY ":" g_any ("," G_KEY ":" g_any)*)?'
        required = set(schema.get("required") or [])
        keys = [k for k in sorted(props) if props[k] is not False]
        s_next, r_next = "", ""
        for k in reversed(keys):
            member = f"{json.dumps(k + ':')} {self.value(props[k])}"
            if k in required:
                s_body, r_body = f"{member} {r_next}", f'"," {member} {r_next}'
            else:
                s_body = f"{member} {r_next} | {s_next}" if s_next else f"({member} {r_next})?"
                r_body = f'("," {member})? {r_next}'
            s_next, r_next = self._rule(s_body.strip()), self._rule(r_body.strip())
        return s_next or ""


def _gemma4_call_lark(tools: Tools, forced: str | None, *, quote_token: bool = False) -> str:
    """The Lark grammar of one demanded call in Gemma 4's syntax, after the prompt's
    ``<|tool_call>call:`` (and ``NAME{`` for a forced function)."""
    g = _Gemma4Lark(quote_token)
    if forced is not None:
        tool = next(t for t in tools if t["function"]["name"] == forced)
        start = g.members(parameters(tool)) + ' "}"'
    else:
        start = " | ".join(
            f'{json.dumps(t["function"]["name"] + "{")} {g.members(parameters(t))} "}}"' for t in tools
        )
    return "\n".join([f"start: {start}", *g.rules, _GEMMA4_RULES])


class Gemma4Format(ToolFormat):
    name = "gemma4"
    think = (CHANNEL_OPEN, CHANNEL_CLOSE)
    keep_special = GEMMA4_MARKERS
    always_reasons = True
    # a turn ends at <turn|>; after its calls, <|tool_response> waits for their results
    ends = (TURN_CLOSE, RESPONSE_OPEN)

    def detect(self, source: str) -> bool:
        return CALL_HEAD in source and CALL_CLOSE in source

    def adapt(
        self, messages: Messages, tools: list[Mapping[str, Any]] | None, template_kwargs: dict[str, Any]
    ) -> tuple[Messages, list[Mapping[str, Any]] | None, dict[str, Any]]:
        return messages, tools, gemma4_kwargs(template_kwargs)

    def thinks(self, template_kwargs: Mapping[str, Any]) -> bool:
        return gemma4_thinks(template_kwargs)

    def parser(
        self,
        *,
        reasoning: bool,
        stop: Sequence[str],
        tools_enabled: bool,
        think_open: bool,
        tools: Tools | None,
    ) -> OutputParser:
        return Gemma4Parser(stop=stop, tools_enabled=tools_enabled)

    def forced_prefix(self, name: str | None) -> str:
        return CALL_HEAD + ("" if name is None else name + "{")

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        # a vocabulary with <|"|> as a (special) token gets it as a token reference
        return _gemma4_call_lark(tools, forced, quote_token=spell(QUOTE) != json.dumps(QUOTE))
