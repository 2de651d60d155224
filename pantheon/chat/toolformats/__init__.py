"""Each model's own tool-call and reasoning format, one module per format behind one protocol
(:class:`~pantheon.chat.toolformats.base.ToolFormat`, whose module doc says what a format
provides). :func:`detect` picks a chat template's format, asking each in :data:`FORMATS` in
turn (the most specific first; Hermes' ``<tool_call>`` JSON last, the default); :func:`get`
returns a format by its name (``ChatTemplate.tool_format``).

Adding a format: a module here with its :class:`ToolFormat` subclass, and a line in
:data:`FORMATS`.
"""

from __future__ import annotations

from .base import (
    JSON_STYLE,
    Lead,
    Speller,
    ToolFormat,
    Vocabulary,
    args_schema,
    call_schema,
    parameters,
    text_speller,
)
from .deepseek_r1 import DeepSeekR1Format
from .functionary_v31 import FunctionaryV31Format
from .functionary_v32 import FunctionaryV32Format
from .gemma4 import Gemma4Format
from .harmony import HarmonyFormat
from .hermes import HermesFormat
from .llama3 import Llama3Format
from .mistral import MistralArgsFormat, MistralFormat
from .qwen_xml import QwenXmlFormat

__all__ = [
    "FORMATS",
    "JSON_STYLE",
    "Lead",
    "Speller",
    "ToolFormat",
    "Vocabulary",
    "args_schema",
    "call_schema",
    "detect",
    "get",
    "parameters",
    "text_speller",
]

# In detection order: a template is the first format's whose ``detect`` says so.
FORMATS: tuple[ToolFormat, ...] = (
    HarmonyFormat(),
    Gemma4Format(),
    QwenXmlFormat(),
    FunctionaryV32Format(),
    FunctionaryV31Format(),
    MistralArgsFormat(),
    MistralFormat(),
    DeepSeekR1Format(),
    Llama3Format(),
    HermesFormat(),
)

_BY_NAME = {f.name: f for f in FORMATS}


def detect(template_source: str | None) -> ToolFormat:
    """The format a chat template teaches its model (Hermes' for None, the ChatML fallback)."""
    src = template_source or ""
    return next(f for f in FORMATS if f.detect(src))


def get(name: str) -> ToolFormat:
    """The format named ``name``; ValueError for an unknown one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tool call format {name!r}") from None
