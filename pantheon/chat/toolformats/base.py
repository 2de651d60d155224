"""The protocol every tool-call format follows, and what the formats share.

A model writes its tool calls (and its reasoning) in the format it was trained on, which its chat
template teaches it. One :class:`ToolFormat` per format says everything Pantheon needs of it:

- ``detect(source)``: whether a chat template's source is this format's (``pantheon.chat.
  toolformats.detect`` asks each format in turn);
- ``adapt(...)``: what the template needs changed in a request to render it (ids of the length
  the template demands, a description it reads, a thinking switch);
- ``tool_prompt(tools)``: the system text listing the tools for a template that takes none;
- ``keep_special``: the special tokens whose text the parser reads (the detokenizer keeps them);
- ``opens`` / ``close`` / ``lead`` / ``parse`` / ``parse_unfinished``: how the emitter finds and
  reads calls in the output (``parser`` builds the output parser; Harmony and Gemma 4 have their
  own); ``stream``: a call's name and its arguments as they are written, before its block ends;
- ``forced_prefix`` / ``call_lark``: what a demanded call's prompt ends with, and the Lark grammar
  of the rest (``pantheon.api.structured.tool_grammar`` compiles it);
- ``grammar_start``: where a grammar starts on a reasoning model (after its reasoning).

Adding a format is one module in this package and one line in its ``FORMATS``.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pantheon.core.json_numbers import bound_numbers

from ..tools import ParsedToolCall, generic_tool_prompt, parse_tool_block, parse_unfinished_tool_block

if TYPE_CHECKING:
    from ..output import OutputParser

__all__ = [
    "JSON_STYLE",
    "Lead",
    "Speller",
    "ToolFormat",
    "Vocabulary",
    "args_schema",
    "call_schema",
    "json_arguments",
    "parameters",
]

Tools = Sequence[Mapping[str, Any]]
Messages = list[dict[str, Any]]

# How JSON in a grammar is spelled: as ``json.dumps`` writes it (and models were trained on).
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ALPHANUMERIC = string.ascii_letters + string.digits


def parameters(tool: Mapping[str, Any]) -> dict:
    """A tool's parameter schema (an object of anything when it gives none)."""
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def bounded_parameters(tool: Mapping[str, Any]) -> dict:
    """A tool's parameter schema with its numbers bounded in length (``json_numbers``: a JSON
    number grammar has no end of its own), as a grammar nests it in a call (``root=False``)."""
    return bound_numbers(parameters(tool), root=False)


def args_schema(tool: Mapping[str, Any]) -> dict:
    """A tool's parameter schema in :data:`JSON_STYLE`, for a grammar's ``%json``."""
    return dict(bounded_parameters(tool), **{"x-guidance": JSON_STYLE})


def json_arguments(tool: Mapping[str, Any]) -> str:
    """The Lark element of a tool's arguments as JSON."""
    return "%json " + json.dumps(args_schema(tool))


def call_schema(tools: Tools, *, lenient: bool = False, args_key: str = "arguments") -> dict:
    """One call of any of ``tools``: ``{"name": NAME, ARGS_KEY: {...}}``, the arguments of that
    function's parameter schema (``lenient``: keywords llguidance lacks are ignored)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, args_key: bounded_parameters(t)},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
            for t in tools
        ],
        "x-guidance": dict(JSON_STYLE, lenient=True) if lenient else JSON_STYLE,
    }


class Speller(Protocol):
    """How a grammar spells one of the format's markers: as the special token the model's
    vocabulary has for it (llguidance matches no special token against text), else as text."""

    def __call__(self, marker: str) -> str: ...


def text_speller(marker: str) -> str:
    """A marker as text (a vocabulary without it as a special token)."""
    return json.dumps(marker)


class Vocabulary(Protocol):
    """What ``grammar_start`` needs of a model's tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def token_id(self, text: str) -> int | None: ...


@dataclass(frozen=True)
class Lead:
    """How the start of a model's answer reads (``ToolFormat.lead``): ``skip`` characters that
    are the format's and not the answer's, then content, or (``call``) a call block that runs to
    the end of the output, opened by ``opener`` (text the model did not write, or wrote)."""

    skip: int = 0
    call: bool = False
    opener: str = ""


CONTENT_LEAD = Lead()


class ToolFormat:
    """One tool-call format (see the module doc). The defaults are the ``<tool_call>`` JSON
    format's reading rules without its markers; each format overrides what differs."""

    name: str = ""
    # the markers that open a call in the content, and the one that ends its block (None: the
    # block runs to the end of the output)
    opens: tuple[str, ...] = ()
    close: str | None = None
    # the reasoning block's markers (None: the format has none)
    think: tuple[str, str] | None = ("<think>", "</think>")
    keep_special: frozenset[str] = frozenset()
    # the model always reasons (Harmony's analysis channel, Gemma 4's thought channel), whatever
    # its template's text says
    always_reasons: bool = False
    # markers that end the model's answer, whatever its config's end tokens
    ends: tuple[str, ...] = ()
    # the call openers that end the reasoning, ``</think>`` or not (Qwen3.5 calls from a
    # thinking block its prompt opened)
    ends_thinking: tuple[str, ...] = ()

    def detect(self, source: str) -> bool:
        """Whether a chat template's source teaches this format."""
        return False

    # -------------------------------------------------------------- the prompt

    def adapt(
        self, messages: Messages, tools: list[Mapping[str, Any]] | None, template_kwargs: dict[str, Any]
    ) -> tuple[Messages, list[Mapping[str, Any]] | None, dict[str, Any]]:
        """``messages``, ``tools`` and the template's keyword arguments made renderable by the
        format's template (only where it would refuse them). By default unchanged."""
        return messages, tools, template_kwargs

    def tool_prompt(self, tools: Tools) -> str:
        """The system text that lists ``tools`` for a template that takes none, in this format."""
        return generic_tool_prompt(tools)

    def thinks(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the model may open a reasoning block itself, given the request's
        ``chat_template_kwargs`` (``enable_thinking`` off says no)."""
        return template_kwargs.get("enable_thinking", True) is not False

    # -------------------------------------------------------------- the output

    def close_of(self, opener: str) -> str | None:
        """The marker that ends a block ``opener`` opened (None: the end of the output)."""
        return self.close

    def lead(self, text: str, final: bool) -> Lead | None:
        """How the answer's first characters read (formats whose call needs no marker, or
        whose answer opens with a recipient); None while ``text`` cannot tell yet."""
        return CONTENT_LEAD

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        """The calls of one block (its opener, and what followed up to the close); None when
        it is not a well-formed call (it is then content, as written)."""
        return parse_tool_block(body)

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        """The calls of a block the output ended inside (``max_tokens``, a stop string): the
        whole ones and the cut-off last one, as it is (see ``pantheon.chat.emitter``)."""
        return parse_unfinished_tool_block(body)

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        """The calls of an open block so far, for streaming them before it closes: each one
        whose name is whole, with its arguments' JSON so far, which must only grow and end as
        ``parse`` gives them (``pantheon.chat.partial_json``). A call it gives is a call,
        whatever follows. By default none: the calls go out whole when the block ends."""
        return []

    def new_id(self) -> str:
        """A call id for a call the model gave none: OpenAI's ``call_`` and 24 letters and
        digits."""
        return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))

    def parser(
        self,
        *,
        reasoning: bool,
        stop: Sequence[str],
        tools_enabled: bool,
        think_open: bool,
        tools: Tools | None,
    ) -> OutputParser:
        """The output parser of this format: the emitter, reading this format's blocks."""
        from ..emitter import Emitter

        return Emitter(
            reasoning=reasoning,
            stop=stop,
            tools_enabled=tools_enabled,
            think_open=think_open,
            tool_format=self,
            tools=tools,
        )

    # -------------------------------------------------------------- constraining a call

    def forced_prefix(self, name: str | None) -> str:
        """What a demanded call's prompt ends with, so that the model only fills in the rest
        (the emitter reads it as if the model wrote it). By default nothing: the grammar
        spells the whole call."""
        return ""

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        """The Lark grammar of one demanded call of ``tools`` after ``prefix`` (already in the
        prompt); ``forced`` names the function when one is."""
        raise NotImplementedError(f"{self.name}: no call grammar")

    def grammar_start(self, vocab: Vocabulary, *, think_open: bool, thinks: bool) -> tuple[list[int], int]:
        """Where a grammar starts on a reasoning model: the ids it starts after, and the id of
        the token that opens the model's reasoning when the model may write one itself (else
        -1). By default after ``</think>``: at once when the prompt opened the block, after the
        model's own ``<think>`` when it is one token and thinking is on."""
        if self.think is None:
            return [], -1
        open_marker, close_marker = self.think
        close = vocab.encode(close_marker)
        if think_open:
            return close, -1
        opening = vocab.encode(open_marker)
        if len(opening) == 1 and thinks:
            return close, opening[0]
        return [], -1


def lark_alternatives(items: Sequence[str]) -> str:
    """``(a | b | ...)``."""
    return "(" + " | ".join(items) + ")"


def chosen(tools: Tools, forced: str | None) -> list[Mapping[str, Any]]:
    """The tools a demanded call may be of."""
    return [t for t in tools if forced is None or t["function"]["name"] == forced]


def name_of(tool: Mapping[str, Any]) -> str:
    return tool["function"]["name"]


SpellerFactory = Callable[[Mapping[str, int]], Speller]
