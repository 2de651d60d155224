"""Llama 3.1 / 3.2 / 3.3's format: a call is the whole answer, one JSON object (or several,
separated by ``;``), with ``parameters`` where Hermes writes ``arguments``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

or, for the built-in tools and the code interpreter, after ``<|python_tag|>`` (a special
token): JSON again, ``brave_search.call(query="...")``, or code for a ``python`` /
``ipython`` / ``code_interpreter`` tool. The model does not reason.
"""

from __future__ import annotations

import ast
import json
import re

from ..tools import ParsedToolCall, json_calls_so_far, parse_tool_block, parse_unfinished_tool_block
from .base import CONTENT_LEAD, Lead, Speller, ToolFormat, Tools, call_schema, chosen

__all__ = ["Llama3Format", "PYTHON_TAG", "code_call"]

PYTHON_TAG = "<|python_tag|>"
_CODE_TOOLS = ("python", "ipython", "code_interpreter")
_BUILTIN = re.compile(r"\s*([A-Za-z_]\w*)\.call\((.*)\)\s*$", re.DOTALL)
_JSON_OPENINGS = ('"name"', '"type"')
# a whole answer that is a call, as llama.cpp reads one: a name, then its parameters (a JSON
# answer that merely has a "name" field is content)
_ANSWER_CALL = re.compile(
    r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"[^"]+"\s*,\s*"(?:parameters|arguments)"\s*:'
)


def _builtin_call(body: str) -> ParsedToolCall | None:
    """``brave_search.call(query="...")``: keyword arguments of Python literals."""
    m = _BUILTIN.match(body)
    if m is None:
        return None
    try:
        call = ast.parse(f"f({m.group(2)})", mode="eval").body
        assert isinstance(call, ast.Call) and not call.args
        args = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
    except (SyntaxError, ValueError, AssertionError):
        return None
    return ParsedToolCall(name=m.group(1), arguments=json.dumps(args, ensure_ascii=False))


def code_call(body: str, tools: Tools) -> ParsedToolCall | None:
    """Code after ``<|python_tag|>``: a call of the request's code tool, if it has one."""
    names = {t.get("function", {}).get("name") for t in tools}
    name = next((n for n in _CODE_TOOLS if n in names), None)
    if name is None or not body.strip():
        return None
    return ParsedToolCall(name=name, arguments=json.dumps({"code": body.strip()}, ensure_ascii=False))


class Llama3Format(ToolFormat):
    name = "llama3"
    opens = (PYTHON_TAG,)
    close = None
    think = None
    keep_special = frozenset({PYTHON_TAG})

    def detect(self, source: str) -> bool:
        return "<|start_header_id|>" in source and (PYTHON_TAG in source or '"parameters"' in source)

    def lead(self, text: str, final: bool) -> Lead | None:
        body = text.lstrip()
        if not body.startswith("{"):
            return None if not body and not final else CONTENT_LEAD
        key = body[1:].lstrip()
        if key.startswith(_JSON_OPENINGS):
            return Lead(call=True)
        if not final and any(o.startswith(key) for o in _JSON_OPENINGS):
            return None
        return CONTENT_LEAD

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        if opener != PYTHON_TAG and not _ANSWER_CALL.match(body):
            return None
        calls = parse_tool_block(body)
        if calls is not None or opener != PYTHON_TAG:
            return calls
        call = _builtin_call(body) or code_call(body, tools)
        return None if call is None else [call]

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        if opener != PYTHON_TAG and not _ANSWER_CALL.match(body):
            return []
        return parse_unfinished_tool_block(body)

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        # (built-in calls and code go whole)
        return json_calls_so_far(body) if opener == PYTHON_TAG or _ANSWER_CALL.match(body) else []

    def _call(self, tools: Tools) -> str:
        return "%json " + json.dumps(call_schema(tools, args_key="parameters"))

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        return f"start: call\ncall: {self._call(chosen(tools, forced))}\n"

    def tool_prompt(self, tools: Tools) -> str:
        listing = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}. Do not use variables.\n\n" + listing
        )
