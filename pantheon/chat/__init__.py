"""The router's text layer: chat templates, incremental detokenization, the output emitter.

Pure Python (jinja2 and tokenizers); nothing here imports torch, transformers or quart. One request
goes through it like this::

    template = ChatTemplate.from_model_dir(model_dir)          # once per model
    policy = resolve_tool_choice(body.get("tools"), body.get("tool_choice"))
    prompt = template.render(messages, tools=policy.template_tools, **chat_template_kwargs)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids

    emitter = output_parser(template.tool_format,              # the model's own format (toolformats)
                            reasoning=template.reasoning, stop=stop, tools_enabled=policy.parse,
                            think_open=think_open(prompt), tools=policy.template_tools)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, keep_special=emitter.keep_special)
    for token_id in generated:                                 # from the worker's StepOutputs
        send(emitter.feed(detok.push(token_id)))
        if emitter.stopped:                                    # a stop string: Abort the worker
            break
    send(emitter.feed(detok.flush()) + emitter.finish())
    finish = emitter.finish_reason("length" if out_of_tokens else "stop")
"""

from .detokenize import IncrementalDetokenizer
from .emitter import MAX_STOP, Delta, Emitter, finish_reason, join_deltas
from .gemma4 import Gemma4Parser
from .harmony import HarmonyParser
from .output import OutputParser, output_parser
from .template import ChatTemplate, TemplateError, normalize_messages, render_chatml, think_open
from .tools import (
    JSON_TOOL_FORMAT,
    XML_TOOL_FORMAT,
    ParsedToolCall,
    ToolChoiceError,
    ToolPolicy,
    forced_call_prefix,
    new_call_id,
    parse_tool_block,
    resolve_tool_choice,
    tool_call_format,
)
from .xml_tools import parse_xml_tool_block

__all__ = [
    "JSON_TOOL_FORMAT",
    "XML_TOOL_FORMAT",
    "ChatTemplate",
    "Delta",
    "Emitter",
    "Gemma4Parser",
    "HarmonyParser",
    "IncrementalDetokenizer",
    "MAX_STOP",
    "OutputParser",
    "ParsedToolCall",
    "TemplateError",
    "ToolChoiceError",
    "ToolPolicy",
    "finish_reason",
    "forced_call_prefix",
    "join_deltas",
    "new_call_id",
    "normalize_messages",
    "output_parser",
    "parse_tool_block",
    "parse_xml_tool_block",
    "render_chatml",
    "resolve_tool_choice",
    "think_open",
    "tool_call_format",
]
