"""Functionary v3.1's format (on Llama 3.1): ``<function=NAME>`` then the arguments' JSON and
``</function>``, or code after ``<|python_tag|>`` for its ``python`` tool::

    <function=get_weather>{"city": "Paris"}</function>
"""

from __future__ import annotations

import json

from ..partial_json import json_so_far, skip_ws
from ..tools import ParsedToolCall
from .base import Speller, ToolFormat, Tools, chosen, json_arguments, name_of
from .llama3 import PYTHON_TAG, code_call

__all__ = ["FunctionaryV31Format"]

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"


class FunctionaryV31Format(ToolFormat):
    name = "functionary_v3.1"
    opens = (FUNCTION_OPEN, PYTHON_TAG)
    close = FUNCTION_CLOSE
    think = None
    keep_special = frozenset({PYTHON_TAG})

    def detect(self, source: str) -> bool:
        return FUNCTION_OPEN in source and FUNCTION_CLOSE in source and "<parameter=" not in source

    def close_of(self, opener: str) -> str | None:
        return None if opener == PYTHON_TAG else FUNCTION_CLOSE

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        if opener == PYTHON_TAG:
            call = code_call(body, tools)
            return None if call is None else [call]
        name, sep, args = body.partition(">")
        if not sep or not name.strip():
            return None
        try:
            value = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        return [ParsedToolCall(name.strip(), json.dumps(value, ensure_ascii=False))]

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        if opener == PYTHON_TAG:
            return self.parse(opener, body, tools) or []
        name, sep, args = body.partition(">")
        return [ParsedToolCall(name.strip(), args.strip())] if sep and name.strip() else []

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        name, sep, args = body.partition(">")
        if opener == PYTHON_TAG or not sep or not name.strip() or not args.startswith("{", skip_ws(args, 0)):
            return []  # (code goes whole)
        return [ParsedToolCall(name.strip(), json_so_far(args)[0])]

    def _lark(self, tools: Tools) -> str:
        rules = [
            f'call{i}: {json.dumps(FUNCTION_OPEN + name_of(t) + ">")} {json_arguments(t)} "{FUNCTION_CLOSE}"'
            for i, t in enumerate(tools)
        ]
        return "start: " + " | ".join(f"call{i}" for i in range(len(tools))) + "\n" + "\n".join(rules) + "\n"

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        return self._lark(chosen(tools, forced))
