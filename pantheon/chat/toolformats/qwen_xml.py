"""Qwen3-Coder's and Qwen3.5's format: ``<tool_call>`` blocks holding XML, one
``<parameter=P>`` element per argument, reasoning in ``<think>``::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The values are typed by the request's tool schemas (:mod:`pantheon.chat.xml_tools`). The
grammar spells the markup exactly as the chat template renders a past call, so a forced call
looks to the model like the calls it was trained on. Parameters come in the schema's order, the
required ones always, each at most once; parameter names come from the schema only, except for a
function that declares no properties, which may take any.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..tools import TOOL_CLOSE, TOOL_OPEN, ParsedToolCall
from ..xml_tools import parameter_schemas, parse_xml_tool_block, writes_as_text
from .base import JSON_STYLE, Speller, ToolFormat, Tools, chosen

__all__ = ["QwenXmlFormat"]

_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>")

# A raw-text value: anything up to the first ``</parameter>`` (lazy: the value cannot contain it,
# which is also where the parser ends it).
_XML_TEXT_RULES = "xml_text[lazy]: /(?s:.*)<\\/parameter>/\nXML_NAME: /[^<>\\n]+/\n"


def _xml_value(schema: Any) -> str:
    """The Lark expression of one parameter's value, up to and including ``</parameter>``."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if writes_as_text(schema):
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            alts = " | ".join(json.dumps(v) for v in dict.fromkeys(enum))
            return f'({alts}) "\\n</parameter>"'
        return "xml_text"
    # Typed values are written as JSON (the template's ``tojson`` for objects and lists), compactly.
    return f"%json {json.dumps(dict(schema, **{'x-guidance': JSON_STYLE}))} " + '"\\n</parameter>"'


def _xml_parameters(rule: str, tool: Mapping[str, Any]) -> tuple[str, list[str]]:
    """``tool``'s parameter elements: the Lark expression of their sequence, and the rules it uses
    (named ``rule`` and a number)."""
    fn = tool["function"]
    schemas = parameter_schemas([tool], fn["name"])
    params = fn.get("parameters")
    required = set(params.get("required") or []) if isinstance(params, dict) else set()
    if not schemas:  # no properties declared: any parameter, as raw text
        return f"{rule}*", [f'{rule}: "<parameter=" XML_NAME ">\\n" xml_text "\\n"']
    rules, sequence = [], []
    for i, (name, schema) in enumerate(schemas.items()):
        if schema is False:  # a property that may not be given
            continue
        head = json.dumps(f"<parameter={name}>\n")
        rules.append(f'{rule}_{i}: {head} {_xml_value(schema)} "\\n"')
        sequence.append(f"{rule}_{i}" + ("" if name in required else "?"))
    return " ".join(sequence), rules


FUNCTION_OPEN = "<function="


def _whole(opener: str, body: str) -> str:
    """A block's inside from its ``<function=``, when that opened it."""
    return opener + body if opener == FUNCTION_OPEN else body


class QwenXmlFormat(ToolFormat):
    name = "xml"
    # Qwen3-Coder may leave out the first call's ``<tool_call>`` and open with ``<function=``
    # (llama.cpp reads it so); the block's body then starts at the function's name
    opens = (TOOL_OPEN, FUNCTION_OPEN)
    close = TOOL_CLOSE
    ends_thinking = (TOOL_OPEN,)

    def detect(self, source: str) -> bool:
        # all three markers: some templates mention ``<function=`` alone for a different
        # syntax (Llama 3.1's custom tools, Functionary v3.1)
        return all(marker in source for marker in (TOOL_OPEN, "<function=", "<parameter="))

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        return parse_xml_tool_block(_whole(opener, body), tools)

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        """The cut-off call keeps the parameters it finished (its arguments are then whole
        JSON)."""
        body = _whole(opener, body)
        head = _XML_FUNCTION.search(body)
        if head is None:
            return []
        end = "</parameter>"
        done = body[: body.rfind(end) + len(end)] if end in body else body[: head.end()]
        calls = parse_xml_tool_block(done + "\n</function>", tools)
        return calls if calls else [ParsedToolCall(name=head.group(1), arguments="{}")]

    def forced_prefix(self, name: str | None) -> str:
        prefix = TOOL_OPEN + "\n"
        return prefix if name is None else prefix + f"<function={name}>\n"

    def _calls(self, tools: Tools) -> tuple[list[tuple[str, str]], list[str]]:
        rules, calls = [], []
        for i, tool in enumerate(tools):
            sequence, param_rules = _xml_parameters(f"param{i}", tool)
            head = json.dumps(f"<function={tool['function']['name']}>\n")
            calls.append((head, f'{sequence} "</function>"'))
            rules += param_rules
        return calls, rules

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        """The prompt may already hold ``<tool_call>`` and even the forced ``<function=NAME>``
        line."""
        calls, rules = self._calls(chosen(tools, forced))
        if forced is not None and prefix.endswith(f"<function={forced}>\n"):
            start = calls[0][1]  # the call is open in the prompt: only its parameters remain
        else:
            start = "(" + " | ".join(f"{head} {rest}" for head, rest in calls) + ")"
            if not prefix.endswith(TOOL_OPEN + "\n"):
                start = '"<tool_call>\\n" ' + start
        return "\n".join([f'start: {start} "\\n</tool_call>"', *rules, _XML_TEXT_RULES])
