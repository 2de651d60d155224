"""llama.cpp's ``tests/test-chat.cpp`` parse cases, ported: a real chat template from its
``models/templates/`` (read from the llama.cpp tree at test time), a real model's output text,
and the content, reasoning and tool calls llama.cpp expects from it. Each case runs through the
format Pantheon detects from that template, whole and streamed one character at a time.

Cases marked ``ours`` are not in test-chat.cpp (its Llama 3.x cases only check content): they
follow the format the template itself teaches.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from pantheon.chat.emitter import join_deltas
from pantheon.chat.output import OutputParser, output_parser
from pantheon.chat.template import ChatTemplate, TemplateError, think_open
from pantheon.chat.toolformats import detect

from helpers.llama_convert import converter_dir

SPECIAL_FUNCTION = {
    "type": "function",
    "function": {
        "name": "special_function",
        "description": "I'm special",
        "parameters": {
            "type": "object",
            "properties": {"arg1": {"type": "integer", "description": "The arg."}},
            "required": ["arg1"],
        },
    },
}
WITH_OPT = {
    "type": "function",
    "function": {
        "name": "special_function_with_opt",
        "description": "I'm special but have optional stuff",
        "parameters": {
            "type": "object",
            "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}},
            "required": ["arg1"],
        },
    },
}
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "an ipython interpreter",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

HELLO = "Hello, world!\nWhat's up?"
CALL = ("special_function", {"arg1": 1}, None)

# (template, expected format, output text, tools, content, reasoning, calls (name, args, id))
CASES = [
    # mistralai-Mistral-Nemo-Instruct-2407
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", HELLO, [], HELLO, "", []),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        "mistral",
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
        [SPECIAL_FUNCTION],
        "",
        "",
        [("special_function", {"arg1": 1}, "123456789")],
    ),
    # meetkai-functionary-medium-v3.1
    ("meetkai-functionary-medium-v3.1", "functionary_v3.1", HELLO, [], HELLO, "", []),
    (
        "meetkai-functionary-medium-v3.1",
        "functionary_v3.1",
        '<function=special_function>{"arg1": 1}</function>',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    # meetkai-functionary-medium-v3.2
    ("meetkai-functionary-medium-v3.2", "functionary_v3.2", "all\n" + HELLO, [], HELLO, "", []),
    (
        "meetkai-functionary-medium-v3.2",
        "functionary_v3.2",
        'special_function\n{"arg1": 1}',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    # DeepSeek R1 distills and llama.cpp's R1 template (thinking forced open by the prompt)
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek_r1", "</think>" + HELLO, [], HELLO, "", []),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
        "deepseek_r1",
        "I'm\nthinking</think>" + HELLO,
        [],
        HELLO,
        "I'm\nthinking",
        [],
    ),
    ("llama-cpp-deepseek-r1", "deepseek_r1", "</think>" + HELLO, [], HELLO, "", []),
    ("llama-cpp-deepseek-r1", "deepseek_r1", "I'm\nthinking</think>" + HELLO, [], HELLO, "I'm\nthinking", []),
    (
        "llama-cpp-deepseek-r1",
        "deepseek_r1",
        "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
        '```json\n{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_r1", "</think>" + HELLO, [], HELLO, "", []),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "deepseek_r1",
        "I'm\nthinking</think>" + HELLO,
        [],
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "deepseek_r1",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
        '```json\n{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
        False,  # enable_thinking: the prompt closes the block
    ),
    # MiMo-VL / Hermes 3 / Qwen 2.5 (<tool_call> JSON)
    *[
        case
        for name in ("MiMo-VL", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "Qwen-Qwen2.5-7B-Instruct")
        for case in (
            (name, "json", HELLO, [], HELLO, "", []),
            (
                name,
                "json",
                '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
                [SPECIAL_FUNCTION],
                "",
                "",
                [CALL],
            ),
        )
    ],
    # NousResearch-Hermes-2-Pro
    (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
        "json",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
        "json",
        HELLO + '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
        [SPECIAL_FUNCTION],
        HELLO,
        "",
        [CALL],
    ),
    # Qwen QwQ (thinking forced open)
    (
        "Qwen-QwQ-32B",
        "json",
        "Let me think about this...\n</think>\nThe answer is 42.",
        [],
        "The answer is 42.",
        "Let me think about this...",
        [],
    ),
    ("Qwen-QwQ-32B", "json", "</think>Hello, world!", [], "Hello, world!", "", []),
    # Mistral Small 3.2: [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral_args", HELLO, [], HELLO, "", []),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        "mistral_args",
        '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}',
        [SPECIAL_FUNCTION],
        "",
        "",
        [("special_function", {"arg1": 1}, "123456789")],
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        "mistral_args",
        '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
        '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}',
        [SPECIAL_FUNCTION, WITH_OPT],
        "",
        "",
        [
            ("special_function", {"arg1": 1}, "000000001"),
            ("special_function_with_opt", {"arg1": 1, "arg2": 2}, "000000002"),
        ],
    ),
    # Devstral
    ("unsloth-mistral-Devstral-Small-2507", "mistral_args", HELLO, [], HELLO, "", []),
    (
        "unsloth-mistral-Devstral-Small-2507",
        "mistral_args",
        '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    (
        "unsloth-mistral-Devstral-Small-2507",
        "mistral_args",
        HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
        [SPECIAL_FUNCTION],
        HELLO,
        "",
        [CALL],
    ),
    # Ministral 3 Reasoning: [THINK] ... [/THINK]
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral_args", HELLO, [], HELLO, "", []),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "mistral_args",
        "[THINK]I'm\nthinking[/THINK]" + HELLO,
        [],
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "mistral_args",
        '[TOOL_CALLS]special_function[ARGS]{"arg1":1}',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "mistral_args",
        "[THINK]I'm\nthinking[/THINK]" + '[TOOL_CALLS]special_function[ARGS]{"arg1":1}',
        [SPECIAL_FUNCTION],
        "",
        "I'm\nthinking",
        [CALL],
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "mistral_args",
        '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
        '[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}',
        [SPECIAL_FUNCTION, WITH_OPT],
        "",
        "",
        [CALL, ("special_function_with_opt", {"arg1": 1, "arg2": 2}, None)],
    ),
    # Llama 3.1 / 3.2 / 3.3: content with tools (test-chat.cpp), calls (ours)
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3", HELLO, [SPECIAL_FUNCTION], HELLO, "", []),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3", HELLO, [SPECIAL_FUNCTION], HELLO, "", []),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama3", HELLO, [PYTHON], HELLO, "", []),
    *[
        (
            name,
            "llama3",
            '{"name": "special_function", "parameters": {"arg1": 1}}',
            [SPECIAL_FUNCTION],
            "",
            "",
            [CALL],
        )
        for name in (
            "meta-llama-Llama-3.1-8B-Instruct",
            "meta-llama-Llama-3.2-3B-Instruct",
            "meta-llama-Llama-3.3-70B-Instruct",
        )
    ],
    (
        "meta-llama-Llama-3.1-8B-Instruct",
        "llama3",
        '<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}}',
        [SPECIAL_FUNCTION],
        "",
        "",
        [CALL],
    ),
    (
        "meta-llama-Llama-3.3-70B-Instruct",
        "llama3",
        "<|python_tag|>print('hey')",
        [PYTHON],
        "",
        "",
        [("python", {"code": "print('hey')"}, None)],
    ),
    (
        "meta-llama-Llama-3.1-8B-Instruct",
        "llama3",
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        [SPECIAL_FUNCTION],
        "",
        "",
        [("brave_search", {"query": "weather in Paris"}, None)],
    ),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3", '{"a": 1}', [SPECIAL_FUNCTION], '{"a": 1}', "", []),
    (  # a JSON answer with a "name" field is no call
        "meta-llama-Llama-3.1-8B-Instruct",
        "llama3",
        '{"name": "Ada", "age": 36}',
        [SPECIAL_FUNCTION],
        '{"name": "Ada", "age": 36}',
        "",
        [],
    ),
]


def _tool(name: str, required: list[str] | None = None, /, **props: str | list | dict) -> dict:
    """A test-chat.cpp tool: ``props`` maps each parameter to its JSON type (or its schema);
    ``required``: those required (by default all)."""
    properties = {k: t if isinstance(t, dict) else {"type": t} for k, t in props.items()}
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(props) if required is None else required,
    }
    return {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}


EDIT = _tool("edit", filename="string", oldString="string", newString="string")
RUN = _tool("run_in_terminal", command="string")
EMPTY = _tool("empty_args")
GET_TIME = _tool("get_time", city="string")
GET_WEATHER = _tool("get_weather", city="string")
TOGGLE = _tool("toggle", enabled="boolean")
AMOUNT = _tool("amount", orig="number")
TODO = _tool("todo_list", todos="array")
CONFIG = _tool("set_config", config="object")
HTML = _tool("html", markup="string")
TODOS = [{"item": "Check stuff", "selected": False}, {"item": "Prepare stuff", "selected": True}]
OPT = {"opt1": "string", "opt2": "integer", "opt3": "string", "opt4": "integer"}
TOOL_2REQ_4OPT = _tool("tool_2req_4opt", ["req1", "req2"], req1="string", req2="integer", **OPT)
TOOL_2REQ_5OPT = _tool(
    "tool_2req_5opt", ["req1", "req2"], req1="string", req2="integer", **OPT, opt5="string"
)
NULLABLE_STR = _tool("set_nullable_str", name=["string", "null"])
NULLABLE_STR_NF = _tool("set_nullable_str_nf", name=["null", "string"])
NULLABLE_INT = _tool("set_nullable_int", count=["integer", "null"])
UNION = _tool("set_union", value=["string", "object"], amount=["string", "integer"])
ENUM = _tool("set_unit", unit={"enum": ["celsius", "fahrenheit"]})
HARMONY_EDIT = _tool("edit", oldString="string", newString="string", replaceAll="boolean")


def _xml_call(name: str, *params: tuple[str, str]) -> str:
    """A call in Qwen's XML format, as Qwen3-Coder and Qwen3.5 write it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XML_CALL = _xml_call("special_function", ("arg1", "1"))
XML_TWO = XML_CALL + "\n" + _xml_call("special_function_with_opt", ("arg1", "1"), ("arg2", "2"))
TWO = [CALL, ("special_function_with_opt", {"arg1": 1, "arg2": 2}, None)]
EDIT_ARGS = {"filename": "foo.c", "oldString": "#iclunde", "newString": "#include"}
CODE = 'def hello():\n    print("Hello, world!")\n\nhello()'

# test-chat.cpp's blocks for Qwen3.5, Qwen3-Coder, gpt-oss and Gemma 4
CASES += [
    # Qwen3.5-4B (thinking forced open unless enable_thinking is off)
    ("Qwen3.5-4B", "xml", "I'm\nthinking\n</think>\n\n" + HELLO, [], HELLO, "I'm\nthinking", []),
    ("Qwen3.5-4B", "xml", XML_CALL, [SPECIAL_FUNCTION], "", "", [CALL], False),
    (
        "Qwen3.5-4B",
        "xml",
        "I'm\nthinking\n</think>\n\n" + XML_CALL,
        [SPECIAL_FUNCTION],
        "",
        "I'm\nthinking",
        [CALL],
    ),
    ("Qwen3.5-4B", "xml", XML_TWO, [SPECIAL_FUNCTION, WITH_OPT], "", "", TWO, False),
    (
        "Qwen3.5-4B",
        "xml",
        _xml_call("python", ("code", CODE)),
        [PYTHON],
        "",
        "",
        [("python", {"code": CODE}, None)],
        False,
    ),
    (
        "Qwen3.5-4B",
        "xml",
        _xml_call("edit", *EDIT_ARGS.items()),
        [EDIT],
        "",
        "",
        [("edit", EDIT_ARGS, None)],
        False,
    ),
    (  # a value that ends in a newline keeps it
        "Qwen3.5-4B",
        "xml",
        _xml_call("edit", ("filename", "foo.c"), ("oldString", "#iclunde"), ("newString", "#include\n")),
        [EDIT],
        "",
        "",
        [("edit", dict(EDIT_ARGS, newString="#include\n"), None)],
        False,
    ),
    (  # code that starts with an indent
        "Qwen3.5-4B",
        "xml",
        _xml_call("python", ("code", '    print("Hello, world!")')),
        [PYTHON],
        "",
        "",
        [("python", {"code": '    print("Hello, world!")'}, None)],
        False,
    ),
    (  # a call ends the prompt's open thinking block, with or without </think>
        "Qwen3.5-4B",
        "xml",
        _xml_call("run_in_terminal", ("command", "pwd")),
        [RUN],
        "",
        "",
        [("run_in_terminal", {"command": "pwd"}, None)],
    ),
    (
        "Qwen3.5-4B",
        "xml",
        "Need to inspect the current directory.\n" + _xml_call("run_in_terminal", ("command", "pwd")),
        [RUN],
        "",
        "Need to inspect the current directory.",
        [("run_in_terminal", {"command": "pwd"}, None)],
    ),
    ("Qwen3.5-4B", "xml", _xml_call("empty_args"), [EMPTY], "", "", [("empty_args", {}, None)], False),
    ("Qwen3.5-4B", "xml", "</think>\n\n" + XML_CALL, [SPECIAL_FUNCTION], "", "", [CALL]),
    (  # (llama.cpp's reasoning is "<think>\n\n": we trim whitespace at a channel's edges)
        "Qwen3.5-4B",
        "xml",
        "<think>\n\n</think>\n\n" + XML_CALL,
        [SPECIAL_FUNCTION],
        "",
        "<think>",
        [CALL],
    ),
    *[
        (  # (llama.cpp keeps the content's last newline; we trim it at the call, as Qwen3's)
            "Qwen3.5-4B",
            "xml",
            thought + "</think>\n\n" + said + "\n" + _xml_call("run_in_terminal", ("command", "pwd")),
            [RUN],
            said,
            thought.strip(),
            [("run_in_terminal", {"command": "pwd"}, None)],
        )
        for thought, said in (
            ("", "Let me inspect the current directory."),
            ("I should inspect the directory.\n", "Let me inspect it now."),
        )
    ],
    (
        "Qwen3.5-4B",
        "xml",
        'I need to output the invoice details in JSON\n</think>\n\n{"amount": 123.45, "date": "2025-12-03"}',
        [],
        '{"amount": 123.45, "date": "2025-12-03"}',
        "I need to output the invoice details in JSON",
        [],
    ),
    # Qwen3-Coder
    ("Qwen3-Coder", "xml", HELLO, [], HELLO, "", []),
    ("Qwen3-Coder", "xml", XML_CALL, [SPECIAL_FUNCTION], "", "", [CALL]),
    # (some models skip the opening <tool_call>, only on the first call)
    ("Qwen3-Coder", "xml", XML_CALL.removeprefix("<tool_call>\n"), [SPECIAL_FUNCTION], "", "", [CALL]),
    (
        "Qwen3-Coder",
        "xml",
        "Let me call it.\n" + XML_CALL.removeprefix("<tool_call>\n"),
        [SPECIAL_FUNCTION],
        "Let me call it.",  # (llama.cpp keeps the newline; we trim it at the call, as Qwen3's)
        "",
        [CALL],
    ),
    ("Qwen3-Coder", "xml", XML_TWO.removeprefix("<tool_call>\n"), [SPECIAL_FUNCTION, WITH_OPT], "", "", TWO),
    ("Qwen3-Coder", "xml", XML_TWO, [SPECIAL_FUNCTION, WITH_OPT], "", "", TWO),
    *[
        ("Qwen3-Coder", "xml", _xml_call(name, *params), [tool], "", "", [(name, dict(params), None)])
        for name, params, tool in (
            ("python", [("code", CODE)], PYTHON),
            ("python", [("code", "格")], PYTHON),
            ("html", [("markup", "<html>\n <head>\n  <title>Hello!</title>\n </head>\n</html>")], HTML),
            ("edit", [("newString", "#include"), ("filename", "foo.c"), ("oldString", "#iclunde")], EDIT),
        )
    ],
    *[  # parameters in any order, typed by their schemas (nullable, unions, enums)
        (
            "Qwen3-Coder",
            "xml",
            _xml_call(tool["function"]["name"], *params),
            [tool],
            "",
            "",
            [(tool["function"]["name"], args, None)],
        )
        for tool, params, args in (
            (
                TOOL_2REQ_4OPT,
                [("req2", "42"), ("req1", "hello"), ("opt2", "200")],
                {"req2": 42, "req1": "hello", "opt2": 200},
            ),
            (
                TOOL_2REQ_4OPT,
                [("req1", "hello"), ("req2", "42"), ("opt4", "100"), ("opt2", "200")],
                {"req1": "hello", "req2": 42, "opt4": 100, "opt2": 200},
            ),
            (
                TOOL_2REQ_5OPT,
                [("req1", "world"), ("req2", "7"), ("opt5", "last"), ("opt3", "middle"), ("opt1", "first")],
                {"req1": "world", "req2": 7, "opt5": "last", "opt3": "middle", "opt1": "first"},
            ),
            (
                TOOL_2REQ_5OPT,
                [
                    ("req1", "test"),
                    ("req2", "99"),
                    ("opt3", "c"),
                    ("opt1", "a"),
                    ("opt5", "e"),
                    ("opt4", "4"),
                    ("opt2", "2"),
                ],
                {"req1": "test", "req2": 99, "opt3": "c", "opt1": "a", "opt5": "e", "opt4": 4, "opt2": 2},
            ),
            (NULLABLE_STR, [("name", "hello world")], {"name": "hello world"}),
            (NULLABLE_STR_NF, [("name", "hello world")], {"name": "hello world"}),
            (NULLABLE_INT, [("count", "42")], {"count": 42}),
            (NULLABLE_STR, [("name", "null")], {"name": None}),
            (
                UNION,
                [("value", '{"a": 1}'), ("amount", "2 dollars")],
                {"value": {"a": 1}, "amount": "2 dollars"},
            ),
            (
                UNION,
                [("value", "{not valid json"), ("amount", "42")],
                {"value": "{not valid json", "amount": 42},
            ),
            (ENUM, [("unit", "celsius")], {"unit": "celsius"}),
        )
    ],
    (  # (an array of objects, typed by its schema)
        "Qwen3-Coder",
        "xml",
        _xml_call("todo_list", ("todos", json.dumps(TODOS))),
        [TODO],
        "",
        "",
        [("todo_list", {"todos": TODOS}, None)],
    ),
    # gpt-oss (Harmony; the prompt ends in ``<|start|>assistant``)
    ("openai-gpt-oss-120b", "harmony", "<|channel|>final<|message|>" + HELLO, [], HELLO, "", []),
    ("openai-gpt-oss-120b", "harmony", "<|channel|>commentary<|message|>" + HELLO, [], HELLO, "", []),
    (
        "openai-gpt-oss-120b",
        "harmony",
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>"
        + HELLO,
        [],
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "openai-gpt-oss-120b",
        "harmony",
        "<|channel|>analysis<|message|>I'm\nthinking",
        [],
        "",
        "I'm\nthinking",
        [],
    ),
    *[
        ("openai-gpt-oss-120b", "harmony", text + '{"arg1": 1}', [SPECIAL_FUNCTION], "", "", [CALL])
        for text in (
            " to=functions.special_function<|channel|>analysis<|message|>",
            "<|channel|>analysis to=functions.special_function<|message|>",
            " to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>",
            "<|channel|>commentary to=functions.special_function<|message|>",
        )
    ],
    (
        "openai-gpt-oss-120b",
        "harmony",
        "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
        [SPECIAL_FUNCTION],
        "",
        "I'm\nthinking",
        [CALL],
    ),
    (
        "openai-gpt-oss-120b",
        "harmony",
        "<|channel|>analysis<|message|>Thinking about edit...<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.edit <|constrain|>json<|message|>"
        '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}',
        [HARMONY_EDIT],
        "",
        "Thinking about edit...",
        [
            (
                "edit",
                {
                    "oldString": "if (part < railCount - 1) {",
                    "newString": "if (part < 4) {",
                    "replaceAll": False,
                },
                None,
            )
        ],
    ),
    (  # structured output in the final message
        "openai-gpt-oss-120b",
        "harmony",
        "<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
        '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
        [],
        '{"amount": 123.45, "date": "2025-12-03"}',
        "I need to output the invoice details in JSON",
        [],
    ),
    *[  # an unsolicited built-in call (no tools): no content
        (
            "openai-gpt-oss-120b",
            "harmony",
            "<|channel|>analysis<|message|>I will execute python to say hello<|end|>" + call,
            [],
            "",
            "I will execute python to say hello",
            [],
        )
        for call in (
            "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
            '<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
        )
    ],
    *[  # a message to the assistant itself is no call
        ("openai-gpt-oss-120b", "harmony", text, [], HELLO, "I'm\nthinking", [])
        for text in (
            "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|>"
            "<|start|>assistant<|channel|>final<|message|>" + HELLO,
            "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>commentary "
            "to=assistant<|channel|>final<|message|>" + HELLO,
        )
    ],
    # Gemma 4
    ("google-gemma-4-31B-it", "gemma4", "Hello, world!", [], "Hello, world!", "", []),
    (
        "google-gemma-4-31B-it",
        "gemma4",
        "<|channel>thought\nI'm\nthinking<channel|>" + HELLO,
        [],
        HELLO,
        "I'm\nthinking",
        [],
    ),
    ("google-gemma-4-31B-it", "gemma4", "<|channel>thought<channel|>" + HELLO, [], HELLO, "", []),
    *[
        (
            "google-gemma-4-31B-it",
            "gemma4",
            f"<|tool_call>call:{call}<tool_call|>",
            [tool],
            "",
            "",
            [(tool["function"]["name"], args, None)],
        )
        for call, tool, args in (
            ('get_time{city:<|"|>London<|"|>}', GET_TIME, {"city": "London"}),
            ('get_time{city:<|"|>San Francisco<|"|>}', GET_TIME, {"city": "San Francisco"}),
            ("empty_args{}", EMPTY, {}),
            ("special_function{arg1:42}", SPECIAL_FUNCTION, {"arg1": 42}),
            ("special_function{arg1:-7}", SPECIAL_FUNCTION, {"arg1": -7}),
            ("amount{orig:3.14}", AMOUNT, {"orig": 3.14}),
            ("toggle{enabled:true}", TOGGLE, {"enabled": True}),
            ("toggle{enabled:false}", TOGGLE, {"enabled": False}),
            (
                'todo_list{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>]}',
                TODO,
                {"todos": ["buy milk", "walk dog"]},
            ),
            (
                'set_config{config:{theme:<|"|>dark<|"|>,count:3}}',
                CONFIG,
                {"config": {"theme": "dark", "count": 3}},
            ),
            ("todo_list{todos:[]}", TODO, {"todos": []}),
            ("set_config{config:{}}", CONFIG, {"config": {}}),
            ("set_nullable{value:null}", _tool("set_nullable", value="null"), {"value": None}),
            ("amount{orig:1.5e10}", AMOUNT, {"orig": 1.5e10}),
        )
    ],
    *[  # stray channel markers around the answer
        ("google-gemma-4-31B-it", "gemma4", text, [], HELLO, "", [])
        for text in (
            "<|channel>thought\n<channel|>" + HELLO + "<channel|>",
            "<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|>",
            "<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|><channel|>",
            "<|channel><|channel>thought\n<channel|>" + HELLO,
        )
    ],
    (
        "google-gemma-4-31B-it",
        "gemma4",
        HELLO + '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>',
        [GET_TIME],
        HELLO,
        "",
        [("get_time", {"city": "Paris"}, None)],
    ),
    (
        "google-gemma-4-31B-it",
        "gemma4",
        '<|channel>thought\nI\'m\nthinking<channel|><|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>',
        [GET_TIME],
        "",
        "I'm\nthinking",
        [("get_time", {"city": "Paris"}, None)],
    ),
    (
        "google-gemma-4-31B-it",
        "gemma4",
        '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>'
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        [GET_TIME, GET_WEATHER],
        "",
        "",
        [("get_time", {"city": "London"}, None), ("get_weather", {"city": "Paris"}, None)],
    ),
]


@cache
def _source(name: str) -> str:
    path = Path(converter_dir()) / "models" / "templates" / f"{name}.jinja"
    return path.read_text(encoding="utf-8")


def _parse(name: str, tools: list, pieces: list[str], enable_thinking: bool) -> dict:
    """``pieces`` as the model's answer to a prompt of the template (``enable_thinking`` as
    test-chat.cpp sets it), through the detected format."""
    parser = _parser(name, tools, enable_thinking)
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    return join_deltas(deltas)


def _parser(name: str, tools: list, enable_thinking: bool) -> OutputParser:
    """The detected format's parser of the model's answer to a prompt of the template."""
    src = _source(name)
    fmt = detect(src)
    reasoning = fmt.think is not None and fmt.think[0] in src
    template = ChatTemplate(
        src, special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, reasoning=reasoning
    )
    # where the prompt leaves the answer (rendering with tools is the render tests' part; some of
    # these templates refuse no tools, some refuse these)
    user = [{"role": "user", "content": "Hey"}]
    try:
        prompt = template.render(user, tools=[SPECIAL_FUNCTION], enable_thinking=enable_thinking)
    except TemplateError:
        prompt = template.render(user, enable_thinking=enable_thinking)
    return output_parser(
        fmt.name, reasoning=reasoning, think_open=reasoning and think_open(prompt), tools=tools
    )


@pytest.mark.parametrize(
    "name,fmt,text,tools,content,reasoning,calls,enable_thinking",
    [c if len(c) == 8 else (*c, True) for c in CASES],
    ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)],
)
def test_llama_cpp_case(name, fmt, text, tools, content, reasoning, calls, enable_thinking):
    assert detect(_source(name)).name == fmt
    for pieces in ([text], list(text)):  # whole, then streamed one character at a time
        got = _parse(name, tools, pieces, enable_thinking)
        assert got["content"] == content
        assert got["reasoning"] == reasoning
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]
        ] == [(n, a) for n, a, _ in calls]
        for c, (_, _, call_id) in zip(got["tool_calls"], calls, strict=True):
            if call_id is not None:
                assert c["id"] == call_id
            elif fmt.startswith("mistral"):
                assert len(c["id"]) == 9 and c["id"].isalnum()  # Mistral's own ids


def test_every_served_template_gets_its_format():
    """The formats the issue names, each detected from its real template."""
    expected = {
        "openai-gpt-oss-120b": "harmony",
        "google-gemma-4-31B-it": "gemma4",
        "Qwen3-Coder": "xml",
        "Qwen3.5-4B": "xml",
        "Qwen-Qwen3-0.6B": "json",
        "HuggingFaceTB-SmolLM3-3B": "json",
    }
    for name, fmt in expected.items():
        assert detect(_source(name)).name == fmt, name


def test_mistral_history_ids_are_made_the_templates_nine_characters():
    """Mistral's templates refuse a past call id that is not 9 letters and digits: OpenAI's
    ``call_...`` ids are renamed, the same way in the call and its result."""
    src = _source("mistralai-Mistral-Nemo-Instruct-2407")
    template = ChatTemplate(src, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    call = {"id": "call_abcdefghijklmnopqrstuvwx", "type": "function"}
    call["function"] = {"name": "special_function", "arguments": '{"arg1": 1}'}
    messages = [
        {"role": "user", "content": "Hey"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    prompt = template.render(messages, tools=[SPECIAL_FUNCTION])
    ids = [s.split('"')[0] for s in prompt.split('"id": "')[1:]] + [
        s.split('"')[0] for s in prompt.split('"call_id": "')[1:]
    ]
    assert ids and all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 1


# A demanded call in each format: the grammar takes the call as the family writes it (after the
# format's forced prefix, which is in the prompt), and the format's parser reads it back.
WRITTEN = {
    "json": '{"arg1": 1}}\n</tool_call>',
    "llama3": '{"name": "special_function", "parameters": {"arg1": 1}}',
    "mistral": '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "a1B2c3D4e"}]',
    "mistral_args": '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
    '```json\n{"arg1": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "functionary_v3.1": '<function=special_function>{"arg1": 1}</function>',
    "functionary_v3.2": 'special_function\n{"arg1": 1}',
}


@pytest.mark.parametrize("fmt", WRITTEN)
def test_a_demanded_call_in_the_formats_grammar_reads_back(fmt):
    from unit.test_structured_router import accepts

    from pantheon.api import structured
    from pantheon.chat.toolformats import get

    prefix = get(fmt).forced_prefix("special_function")
    grammar = structured.tool_grammar([SPECIAL_FUNCTION], "special_function", prefix, fmt)
    assert accepts(grammar, WRITTEN[fmt])
    assert not accepts(grammar, WRITTEN[fmt].replace('"arg1": 1', '"arg1": "one"'))  # an integer
    parser = output_parser(fmt, reasoning=False, tools=[SPECIAL_FUNCTION])
    got = join_deltas(parser.feed(prefix + WRITTEN[fmt]) + parser.finish())
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == [
        ("special_function", {"arg1": 1})
    ]
    assert got["content"] == ""


# ---------------------------------------------------------------- streamed argument deltas

# the formats whose calls' arguments stream as the model writes them (Qwen's XML goes whole:
# its values are typed by the schema only once each parameter is whole)
STREAMING = {
    "json",
    "llama3",
    "mistral",
    "mistral_args",
    "deepseek_r1",
    "functionary_v3.1",
    "functionary_v3.2",
    "harmony",
    "gemma4",
}
ARGS_TEXT = (
    '{"code":"print(\\"hi\\\\n\\")  # \\u00e9\\ud83d\\ude00","n":[1,2.5e3,-0,{"x":null,"y":true}],"e":{}}'
)
ARGS_VALUE = json.loads(ARGS_TEXT)
KITCHEN = _tool("python", code="string", n="array", e="object")
# (ours) arguments in the model's own spacing, with escapes, a surrogate pair, nested values
STREAM_CASES = [
    (
        "Qwen-Qwen2.5-7B-Instruct",
        '<tool_call>\n{"name": "python", "arguments": ' + ARGS_TEXT + "}\n</tool_call>",
    ),
    ("meta-llama-Llama-3.1-8B-Instruct", '{"name": "python", "parameters": ' + ARGS_TEXT + "}"),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "python", "id": "a1B2c3D4e", "arguments": ' + ARGS_TEXT + "}]",
    ),
    ("Mistral-Small-3.2-24B-Instruct-2506", "[TOOL_CALLS]python[ARGS]" + ARGS_TEXT),
    (
        "llama-cpp-deepseek-r1",
        "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n```json\n"
        + ARGS_TEXT
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    ("meetkai-functionary-medium-v3.1", "<function=python>" + ARGS_TEXT + "</function>"),
    ("meetkai-functionary-medium-v3.2", "python\n" + ARGS_TEXT),
]


def _streamed_cases():
    for name, fmt, text, tools, _, _, calls, *thinking in CASES:
        code = "<|python_tag|>" in text and not text.split("<|python_tag|>")[1].startswith("{")
        if fmt in STREAMING and calls and not code:
            arguments = [json.dumps(a, ensure_ascii=False) for _, a, _ in calls]
            yield name, text, tools, arguments, thinking[0] if thinking else True
    for name, text in STREAM_CASES:
        yield name, text, [KITCHEN], [json.dumps(ARGS_VALUE, ensure_ascii=False)], True


@pytest.mark.parametrize("name,text,tools,arguments,enable_thinking", list(_streamed_cases()))
def test_a_calls_arguments_stream_as_written(name, text, tools, arguments, enable_thinking):
    """Streamed one character at a time, a call's name goes out before its block ends and its
    arguments in fragments as they grow, which join to exactly the arguments answered whole."""
    whole = _parse(name, tools, [text], enable_thinking)
    assert [c["function"]["arguments"] for c in whole["tool_calls"]] == arguments
    parser = _parser(name, tools, enable_thinking)
    feeds = [parser.feed(ch) for ch in text] + [parser.finish()]
    for k, expected in enumerate(arguments):
        named = [i for i, f in enumerate(feeds) for d in f if d.index == k and d.name is not None]
        grown = [i for i, f in enumerate(feeds) for d in f if d.index == k and d.arguments]
        fragments = [d.arguments for f in feeds for d in f if d.index == k and d.arguments]
        assert len(named) == 1 and named[0] < len(text) - 1  # before the block's last character
        if '"id"' not in text or text.index('"id"') < text.index('"arguments"'):
            assert named[0] < grown[-1]  # the arguments went on growing after the name
        assert "".join(fragments) == expected


@pytest.mark.parametrize(
    "body,arguments",
    [
        # arguments as a JSON string (as OpenAI transmits them): read whole when the block closes
        ('{"name": "special_function", "arguments": "{\\"arg1\\": 1}"}', '{"arg1": 1}'),
        # a call that streamed is a call, whatever follows it in its block
        ('{"name": "special_function", "arguments": {"arg1": 1}} and more', '{"arg1": 1}'),
        # ... and a repeated key stays as the stream wrote it
        ('{"name": "special_function", "arguments": {"arg1": 1, "arg1": 2}}', '{"arg1": 1, "arg1": 2}'),
    ],
)
def test_a_json_block_reads_the_same_whole_and_streamed(body, arguments):
    text = "<tool_call>\n" + body + "\n</tool_call>"
    for pieces in ([text], list(text)):
        got = _parse("Qwen-Qwen2.5-7B-Instruct", [SPECIAL_FUNCTION], pieces, True)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]] == [
            ("special_function", arguments)
        ]
        assert got["content"] == ""
