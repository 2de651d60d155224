"""Hermes' format (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3, the ChatML fallback, and any template
that teaches no other): a JSON call between ``<tool_call>`` markers, reasoning in ``<think>``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json

from ..tools import TOOL_CLOSE, TOOL_OPEN, ParsedToolCall, json_calls_so_far
from .base import Speller, ToolFormat, Tools, call_schema, chosen, json_arguments

__all__ = ["HermesFormat"]


class HermesFormat(ToolFormat):
    name = "json"
    opens = (TOOL_OPEN,)
    close = TOOL_CLOSE

    def detect(self, source: str) -> bool:
        return True  # the default: asked last

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        return json_calls_so_far(body)

    def forced_prefix(self, name: str | None) -> str:
        prefix = TOOL_OPEN + "\n"
        return prefix if name is None else prefix + '{"name": ' + json.dumps(name) + ', "arguments": '

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        if forced is not None:
            return f'start: args "}}" "\\n</tool_call>"\nargs: {json_arguments(chosen(tools, forced)[0])}\n'
        opening = "" if prefix.endswith(TOOL_OPEN + "\n") else '"<tool_call>\\n" '
        return f'start: {opening}call "\\n</tool_call>"\ncall: %json {json.dumps(call_schema(tools))}\n'
