"""The DeepSeek-R1 distills' format (and DeepSeek V3's): reasoning in ``<think>`` (their
templates open it in the prompt), calls between full-width markers, each call's arguments in a
JSON code fence::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The distills' own templates take no tools: :meth:`DeepSeekR1Format.tool_prompt` lists them and
teaches this format in the system message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from ..partial_json import json_so_far
from ..tools import ParsedToolCall
from .base import Speller, ToolFormat, Tools, chosen, json_arguments, name_of

__all__ = ["DeepSeekR1Format"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_CALL = re.compile(
    re.escape(CALL_BEGIN)
    + r"\s*(?:function)?\s*"
    + re.escape(SEP)
    + r"\s*([^\n`]+?)\s*\n\s*```(?:json)?\s*\n?(.*?)```\s*"
    + re.escape(CALL_END),
    re.DOTALL,
)
_OPEN_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"\s*(?:function)?\s*" + re.escape(SEP) + r"\s*([^\n`]+?)\s*\n", re.DOTALL
)

_FENCE = re.compile(r"\s*```(?:json)?\s*")


def _arguments(text: str) -> str | None:
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, Mapping) else None


class DeepSeekR1Format(ToolFormat):
    name = "deepseek_r1"
    opens = (CALLS_BEGIN,)
    close = CALLS_END
    keep_special = frozenset({CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP})

    def detect(self, source: str) -> bool:
        return "tool▁calls▁begin" in source

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        calls, pos = [], 0
        for m in _CALL.finditer(body):
            if body[pos : m.start()].strip():
                return None
            args = _arguments(m.group(2))
            if args is None:
                return None
            calls.append(ParsedToolCall(m.group(1), args))
            pos = m.end()
        return calls if calls and not body[pos:].strip() else None

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        calls, pos = [], 0
        for m in _CALL.finditer(body):
            args = _arguments(m.group(2))
            if args is not None:
                calls.append(ParsedToolCall(m.group(1), args))
            pos = m.end()
        cut = _OPEN_CALL.search(body, pos)
        if cut is not None:
            rest = body[cut.end() :].lstrip().removeprefix("```json").removeprefix("```").lstrip()
            calls.append(ParsedToolCall(cut.group(1), rest.rstrip()))
        return calls

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        calls, pos = [], 0
        while (head := _OPEN_CALL.search(body, pos)) is not None:
            fence = _FENCE.match(body, head.end())
            if fence is None or not body.startswith("{", fence.end()):
                break
            args, end = json_so_far(body, fence.end())
            calls.append(ParsedToolCall(head.group(1), args))
            whole = _CALL.match(body, head.start()) if end is not None else None
            if whole is None:
                break
            pos = whole.end()
        return calls

    def _lark(self, tools: Tools, spell: Speller) -> str:
        rules = [
            f'call{i}: {spell(CALL_BEGIN)} "function" {spell(SEP)} {json.dumps(name_of(t) + chr(10) + "```json" + chr(10))} '
            f'{json_arguments(t)} "\\n```" {spell(CALL_END)}'
            for i, t in enumerate(tools)
        ]
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        return f"start: {spell(CALLS_BEGIN)} ({calls}) {spell(CALLS_END)}\n" + "\n".join(rules) + "\n"

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        return self._lark(chosen(tools, forced), spell)

    def tool_prompt(self, tools: Tools) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call functions to answer. The functions:\n" + listing + "\n\nTo call one, write\n"
            f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}FUNCTION_NAME\n```json\n{{ARGUMENTS}}\n```{CALL_END}{CALLS_END}"
        )
