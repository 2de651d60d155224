"""gpt-oss's Harmony format: channels and recipients, read by
:class:`pantheon.chat.harmony.HarmonyParser`. A call is a message to ``functions.NAME`` whose
body is the arguments' JSON::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A demanded call's prompt holds the message's header up to ``functions.`` (the model names the
function), or whole, up to ``<|message|>``, for a forced one (the model writes the arguments);
its grammar ends the header in the special tokens gpt-oss writes (a matcher over the model's own
vocabulary checks it, ``check_for_model``). A grammar on gpt-oss starts in the final message,
after its analysis (as vLLM starts it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..harmony import CALL, CHANNEL, CONSTRAIN, FINAL_OPENING, HARMONY_MARKERS, MESSAGE, RETURN, HarmonyParser
from .base import Messages, Speller, ToolFormat, Tools, Vocabulary, chosen, json_arguments, name_of

if TYPE_CHECKING:
    from ..output import OutputParser

__all__ = ["HarmonyFormat"]

CALL_OPEN = CHANNEL + "commentary to=functions."
CALL_BODY = " " + CONSTRAIN + "json" + MESSAGE


class HarmonyFormat(ToolFormat):
    name = "harmony"
    think = None
    keep_special = HARMONY_MARKERS
    always_reasons = True
    ends = (RETURN, CALL)  # an answer ends at <|return|>, a call at <|call|>

    def detect(self, source: str) -> bool:
        return CHANNEL in source and MESSAGE in source

    def adapt(
        self, messages: Messages, tools: list[Mapping[str, Any]] | None, template_kwargs: dict[str, Any]
    ) -> tuple[Messages, list[Mapping[str, Any]] | None, dict[str, Any]]:
        """What gpt-oss's template fails on, and OpenAI clients send, made renderable (only where
        the template would raise: everything else renders as transformers renders it):

        - a tool without a ``description`` (the template adds ``"// " + tool.description``): an
          empty one;
        - an assistant message with tool calls and both text and reasoning (the template renders
          one analysis message, from either, and refuses both): the reasoning, which is the
          analysis the model wrote; the text was its preamble to the user.
        """
        if tools:
            fixed: list[Mapping[str, Any]] = []
            for t in tools:
                fn = t.get("function")
                if isinstance(fn, Mapping) and fn.get("description") is None:
                    t = {**t, "function": {**fn, "description": ""}}
                fixed.append(t)
            tools = fixed
        out = []
        for m in messages:
            if (
                m.get("role") == "assistant"
                and m.get("tool_calls")
                and m.get("content")
                and m.get("thinking")
            ):
                m = {**m, "content": ""}
            out.append(m)
        return out, tools, template_kwargs

    def parser(
        self,
        *,
        reasoning: bool,
        stop: Sequence[str],
        tools_enabled: bool,
        think_open: bool,
        tools: Tools | None,
    ) -> OutputParser:
        return HarmonyParser(stop=stop, tools_enabled=tools_enabled)

    def forced_prefix(self, name: str | None) -> str:
        return CALL_OPEN + ("" if name is None else name + CALL_BODY)

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        if forced is not None:
            return f"start: {json_arguments(chosen(tools, forced)[0])}\n"
        # after the prompt's ``to=functions.``: a name, then the rest of the header as gpt-oss
        # writes it (`` <|constrain|>json<|message|>``), then its arguments
        rules = [
            f'call{i}: {json.dumps(name_of(t))} " " {spell(CONSTRAIN)} "json" {spell(MESSAGE)} {json_arguments(t)}'
            for i, t in enumerate(tools)
        ]
        return "start: " + " | ".join(f"call{i}" for i in range(len(tools))) + "\n" + "\n".join(rules) + "\n"

    def grammar_start(self, vocab: Vocabulary, *, think_open: bool, thinks: bool) -> tuple[list[int], int]:
        # in the final message, when the model writes its markers as the special tokens they are
        # (a vocabulary without them starts the grammar at once)
        marked = vocab.token_id(MESSAGE) is not None
        return (vocab.encode(FINAL_OPENING) if marked else []), -1
