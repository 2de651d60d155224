"""The one place that builds the parser of a model's output: its tool format's
(``ChatTemplate.tool_format``, :mod:`pantheon.chat.toolformats`).

- gpt-oss's Harmony format: :class:`pantheon.chat.harmony.HarmonyParser`, whose markers are
  special tokens the detokenizer must keep (``keep_special``);
- Gemma 4's: :class:`pantheon.chat.gemma4.Gemma4Parser`, whose markers are special tokens too;
- every other format: :class:`pantheon.chat.emitter.Emitter`, reading that format's reasoning
  and call markers (a format's markers that are special tokens are kept too: Llama 3's
  ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``).

Every route (chat, responses, Ollama) builds its parser here, through ``Generation._emitter``;
all parsers give the same :class:`~pantheon.chat.emitter.Delta` stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from .emitter import Delta

__all__ = ["OutputParser", "output_parser"]


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


def output_parser(
    tool_format: str,
    *,
    reasoning: bool,
    stop: Iterable[str] = (),
    tools_enabled: bool = True,
    think_open: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> OutputParser:
    """The parser of format ``tool_format`` (``ChatTemplate.tool_format``). ``reasoning``,
    ``think_open`` and ``tools`` are the emitter's (Harmony's and Gemma 4's parsers need none of
    them: their markers say it all)."""
    from .toolformats import get

    return get(tool_format).parser(
        reasoning=reasoning,
        stop=list(stop or ()),
        tools_enabled=tools_enabled,
        think_open=think_open,
        tools=tools,
    )
