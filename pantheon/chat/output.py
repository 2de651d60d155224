"""The one place that picks the parser of a model's output: its chat template's format.

- gpt-oss's Harmony template (``ChatTemplate.output_format == "harmony"``):
  :class:`pantheon.chat.harmony.HarmonyParser`, whose markers are special tokens the detokenizer
  must keep (``keep_special``);
- Gemma 4's template (``"gemma4"``): :class:`pantheon.chat.gemma4.Gemma4Parser` (``<|channel>``
  thinking, ``<|tool_call>call:NAME{...}`` calls in the template's argument syntax), whose markers
  are special tokens too;
- every other template: :class:`pantheon.chat.emitter.Emitter` (``<think>`` and ``<tool_call>``
  markup, in the JSON or XML tool format), which keeps no special token.

Every route (chat, responses, Ollama) builds its parser here, through ``Generation._emitter``;
both parsers give the same :class:`~pantheon.chat.emitter.Delta` stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from .emitter import Delta, Emitter
from .gemma4 import Gemma4Parser
from .harmony import HarmonyParser
from .tools import GEMMA4_TOOL_FORMAT, HARMONY_TOOL_FORMAT

__all__ = ["GEMMA4", "HARMONY", "TAGGED", "OutputParser", "output_parser"]

HARMONY = "harmony"  # gpt-oss: channels and recipients
GEMMA4 = "gemma4"  # Gemma 4: <|channel>thought ... <channel|>, <|tool_call>call:NAME{...}<tool_call|>
TAGGED = "tagged"  # <think> / <tool_call> markup (Qwen, Llama, SmolLM, the ChatML fallback)


class OutputParser(Protocol):
    """What a route needs of a parser: deltas from text pieces, stop strings, tool calls."""

    keep_special: frozenset[str]
    stopped: bool
    tool_calls: list[dict[str, Any]]

    @property
    def stop_string(self) -> str | None: ...  # read here, set by the parser

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...

    def finish_reason(self, reason: str) -> str: ...


def output_format(tool_format: str) -> str:
    """The output format that goes with a template's tool format (``ChatTemplate.tool_format``,
    the one place that reads the template)."""
    return {HARMONY_TOOL_FORMAT: HARMONY, GEMMA4_TOOL_FORMAT: GEMMA4}.get(tool_format, TAGGED)


def output_parser(
    fmt: str,
    *,
    reasoning: bool,
    stop: Iterable[str] = (),
    tools_enabled: bool = True,
    think_open: bool = False,
    tool_format: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> OutputParser:
    """The parser for output format ``fmt`` (``ChatTemplate.output_format``). ``reasoning``,
    ``think_open``, ``tool_format`` and ``tools`` are the emitter's (Harmony needs none of them:
    its channels say it all; nor Gemma 4's: its markers do)."""
    if fmt == HARMONY:
        return HarmonyParser(stop=stop, tools_enabled=tools_enabled)
    if fmt == GEMMA4:
        return Gemma4Parser(stop=stop, tools_enabled=tools_enabled)
    return Emitter(
        reasoning=reasoning,
        stop=stop,
        tools_enabled=tools_enabled,
        think_open=think_open,
        tool_format=tool_format,
        tools=tools,
    )
