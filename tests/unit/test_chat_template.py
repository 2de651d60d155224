"""Chat template rendering must equal transformers' own ``apply_chat_template(tokenize=False)``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pantheon.chat.template import ChatTemplate, TemplateError, normalize_messages, render_chatml, think_open

from helpers.chat_template import hf_render
from helpers.paths import SPECS, need_specs

QWEN3 = SPECS / "qwen3-0.6B.chat_template.jinja"
LLAMA33 = SPECS / "llama-3.3-70B-Instruct.chat_template.jinja"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville <b>&</b> — 天气",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    },
]


def openai_tool_turn(args_json: str, content=None, call_id="call_1", name="get_weather"):
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args_json}}
        ],
    }


def hf_tool_turn(args: dict, content="", call_id="call_1", name="get_weather"):
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}],
    }


BASIC = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Bonjour ! Ça va ? 你好 🙂"},
    {"role": "assistant", "content": "Très bien, merci."},
    {"role": "user", "content": 'Tell me a joke about <tags> & "quotes".'},
]

THINKING_HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "Another sum."},
    {"role": "user", "content": "Thanks"},
]


# ------------------------------------------------------------------------------ Qwen3


@pytest.fixture(scope="module")
def qwen3() -> ChatTemplate:
    need_specs()
    return ChatTemplate(QWEN3.read_text(encoding="utf-8"), eos_token="<|im_end|>", reasoning=True)


@pytest.mark.parametrize("agp", [True, False])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
@pytest.mark.parametrize(
    "messages", [BASIC, THINKING_HISTORY, BASIC[1:2]], ids=["basic", "thinking", "single"]
)
def test_qwen3_plain_matches_transformers(qwen3, messages, agp, kwargs):
    got = qwen3.render(messages, add_generation_prompt=agp, **kwargs)
    want = hf_render(
        QWEN3.read_text(), messages, add_generation_prompt=agp, bos=None, eos="<|im_end|>", **kwargs
    )
    assert got == want


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_qwen3_tools_and_tool_calls_match_transformers(qwen3, kwargs):
    args = {"city": "Zürich", "unit": "c"}
    ours = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich and news?"},
        openai_tool_turn(json.dumps(args)),  # content null, arguments as a JSON string: OpenAI style
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
        {
            "role": "assistant",
            "content": "Let me search too.",
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "news"}'},
                },
                {
                    "id": "c3",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "météo"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "nothing new"},
        {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "sunny"}]},
    ]
    theirs = [
        ours[0],
        ours[1],
        hf_tool_turn(args),
        ours[3],
        {
            "role": "assistant",
            "content": "Let me search too.",
            "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {"q": "news"}}},
                {"id": "c3", "type": "function", "function": {"name": "search", "arguments": {"q": "météo"}}},
            ],
        },
        ours[5],
        {"role": "tool", "tool_call_id": "c3", "content": "sunny"},
    ]
    got = qwen3.render(ours, tools=TOOLS, **kwargs)
    want = hf_render(QWEN3.read_text(), theirs, tools=TOOLS, bos=None, eos="<|im_end|>", **kwargs)
    assert got == want
    # tojson as transformers has it: key order kept, no HTML escaping, no \u escapes.
    assert (
        '{"type": "function", "function": {"name": "get_weather", "description": "Météo d\'une ville <b>&</b> — 天气"'
        in got
    )
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>'
        in got
    )
    # The Qwen3 template would crash on content None; ours was normalised to "".
    assert "None" not in got


def test_qwen3_tools_without_system(qwen3):
    msgs = [{"role": "user", "content": "hi"}]
    assert qwen3.render(msgs, tools=TOOLS) == hf_render(QWEN3.read_text(), msgs, tools=TOOLS, bos=None)


def test_qwen3_content_parts_are_joined(qwen3):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    assert qwen3.render(parts) == hf_render(QWEN3.read_text(), joined, bos=None)


def test_qwen3_raw_transformers_crashes_on_null_content_but_we_do_not(qwen3):
    msgs = [{"role": "user", "content": "x"}, openai_tool_turn('{"city": "Paris"}')]
    # transformers drops the None content and the template then fails on it.
    with pytest.raises(Exception):  # noqa: B017 - whatever jinja raises there
        hf_render(QWEN3.read_text(), msgs, bos=None)
    out = qwen3.render(msgs, add_generation_prompt=False)
    assert out.endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )


def test_think_open_detection(qwen3):
    msgs = [{"role": "user", "content": "hi"}]
    assert not think_open(qwen3.render(msgs))
    assert not think_open(qwen3.render(msgs, enable_thinking=False))
    assert think_open("<|im_start|>assistant\n<think>\n")


# ------------------------------------------------------------------------------ Llama 3.3


@pytest.fixture(scope="module")
def llama() -> ChatTemplate:
    need_specs()
    return ChatTemplate(
        LLAMA33.read_text(encoding="utf-8"), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )


def llama_hf(messages, **kw):
    return hf_render(LLAMA33.read_text(), messages, bos="<|begin_of_text|>", eos="<|eot_id|>", **kw)


@pytest.mark.parametrize("agp", [True, False])
@pytest.mark.parametrize("messages", [BASIC, BASIC[1:]], ids=["with-system", "no-system"])
def test_llama_plain_matches_transformers(llama, messages, agp):
    assert llama.render(messages, add_generation_prompt=agp) == llama_hf(messages, add_generation_prompt=agp)


@pytest.mark.parametrize("kwargs", [{}, {"tools_in_user_message": False}, {"date_string": "01 Jan 2030"}])
def test_llama_tools_match_transformers(llama, kwargs):
    args = {"city": "Kraków"}
    ours = [
        {"role": "system", "content": "  Use tools.  "},
        {"role": "user", "content": "Weather in Kraków?"},
        openai_tool_turn(json.dumps(args), content=None),
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "It is 3 °C."},
        {"role": "user", "content": "Thanks"},
    ]
    theirs = [ours[0], ours[1], hf_tool_turn(args, content=""), ours[3], ours[4], ours[5]]
    got = llama.render(ours, tools=TOOLS, **kwargs)
    assert got == llama_hf(theirs, tools=TOOLS, **kwargs)
    assert got.startswith("<|begin_of_text|>")
    assert '"description": "Météo d\'une ville <b>&</b> — 天气"' in got  # tojson(indent=4), unescaped


def test_llama_raise_exception_becomes_template_error(llama):
    two_calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "search", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "search", "arguments": "{}"}},
        ],
    }
    with pytest.raises(TemplateError, match="only supports single tool-calls"):
        llama.render([{"role": "user", "content": "x"}, two_calls])
    with pytest.raises(TemplateError, match="no first user message"):
        llama.render([{"role": "system", "content": "s"}], tools=TOOLS)


def test_llama_empty_tool_calls_list_is_dropped(llama):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": []}]
    assert llama.render(msgs) == llama_hf([msgs[0], {"role": "assistant", "content": "y"}])


# ------------------------------------------------------------------------------ environment details


def test_globals_and_filters_match_transformers():
    src = (
        "{{ bos_token }}|{{ eos_token }}|{{ {'b': 1, 'a': '<é>'} | tojson }}|"
        "{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}|"
        "{{ [1, 2] | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y') | length }}|"
        "{% set ns = namespace(n=0) %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}|{{ dict(x=1) | tojson }}|"
        "{% generation %}gen{% endgeneration %}|{{ add_generation_prompt }}|{{ tools }}|{{ documents }}|{{ custom }}"
    )
    msgs = [{"role": "user", "content": "x"}]
    ours = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(msgs, custom="v")
    assert ours == hf_render(src, msgs, custom="v")
    assert ours.startswith('<s>|</s>|{"b": 1, "a": "<é>"}|')


def test_trim_and_lstrip_blocks():
    src = "A\n  {% if true %}\n  B\n  {% endif %}\nC"
    msgs = [{"role": "user", "content": "x"}]
    assert ChatTemplate(src).render(msgs) == hf_render(src, msgs)


def test_undefined_and_type_errors_become_template_errors():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0].nope.deeper }}").render(msgs)
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 'a' + messages[0].missing }}").render(msgs)
    with pytest.raises(TemplateError):
        ChatTemplate("{{ raise_exception('boom') }}").render(msgs)
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% if %}")


def test_sandbox_refuses_escapes():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(msgs)
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace(__x=1) %}").render(msgs)
    with pytest.raises(TemplateError):
        ChatTemplate("{% set x = messages.append(1) %}").render(msgs)


def test_reserved_kwargs_and_bad_messages():
    t = ChatTemplate("{{ messages | length }}")
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "x"}], messages=[])
    with pytest.raises(TemplateError):
        t.render([])
    with pytest.raises(TemplateError):
        t.render([{"content": "no role"}])
    with pytest.raises(TemplateError, match="image_url"):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_normalize_messages_does_not_touch_input():
    msgs = [openai_tool_turn('{"city": "Oslo"}'), {"role": "user", "content": "x", "name": None}]
    before = json.dumps(msgs)
    out = normalize_messages(msgs)
    assert json.dumps(msgs) == before
    assert out[0]["content"] == ""
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert "name" not in out[1]
    # Arguments that are not JSON stay text; reasoning is aliased like transformers does.
    out = normalize_messages(
        [
            {
                "role": "assistant",
                "content": "a",
                "reasoning": "r",
                "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}],
            }
        ]
    )
    assert out[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert out[0]["reasoning_content"] == out[0]["thinking"] == "r"


# ------------------------------------------------------------------------------ loading from a folder


def _write_config(folder: Path, **config):
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def test_from_model_dir_string_template(tmp_path):
    _write_config(
        tmp_path,
        chat_template="{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        bos_token={"__type": "AddedToken", "content": "<s>", "special": True},
        eos_token="</s>",
        pad_token="<pad>",
    )
    t = ChatTemplate.from_model_dir(tmp_path)
    assert (t.bos_token, t.eos_token, t.special_tokens["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert t.render([{"role": "user", "content": "hé"}]) == "<s>hé</s>"
    assert not t.is_fallback


def test_from_model_dir_named_templates(tmp_path):
    _write_config(
        tmp_path,
        chat_template=[{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
    )
    t = ChatTemplate.from_model_dir(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    assert t.render(msgs) == "D"
    assert t.render(msgs, tools=TOOLS) == "T"


def test_from_model_dir_jinja_file_wins(tmp_path):
    _write_config(tmp_path, chat_template="from config")
    (tmp_path / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "from file"


def test_from_model_dir_without_template_falls_back_to_chatml(tmp_path):
    _write_config(tmp_path, eos_token="<|im_end|>", added_tokens_decoder={"7": {"content": "<think>"}})
    t = ChatTemplate.from_model_dir(tmp_path)
    assert t.is_fallback and t.reasoning
    assert (
        t.render([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not ChatTemplate.from_model_dir(empty).reasoning


# ------------------------------------------------------------------------------ ChatML fallback


def test_chatml_basic_exact():
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "héllo"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    body = (
        "<|im_start|>system\nsys<|im_end|>\n"
        "<|im_start|>user\nhéllo<|im_end|>\n"
        "<|im_start|>assistant\nhi<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
    )
    assert ChatTemplate().render(msgs) == body + "<|im_start|>assistant\n"
    assert ChatTemplate().render(msgs, add_generation_prompt=False) == body
    assert ChatTemplate(reasoning=True).render(msgs) == body + "<|im_start|>assistant\n<think>\n"
    assert ChatTemplate(reasoning=True).render(msgs, enable_thinking=False) == (
        body + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert think_open(ChatTemplate(reasoning=True).render(msgs))


def test_chatml_tool_messages_exact():
    msgs = [
        {"role": "user", "content": "weather?"},
        openai_tool_turn('{"city": "Lyon"}'),
        {"role": "tool", "tool_call_id": "call_1", "content": "12C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Cool, 12C."},
    ]
    assert ChatTemplate().render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nweather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12C\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nCool, 12C.<|im_end|>\n"
    )


def test_chatml_tools_listing_exact():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    out = render_chatml([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], tools=[tool])
    assert out == (
        "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )
    # Same as what the Qwen3 template writes for tools (it is the Hermes/Qwen form).
    need_specs()
    assert out == hf_render(
        QWEN3.read_text(),
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
        tools=[tool],
        bos=None,
    )


# ------------------------------------------------------------------------------ the test model's folder


def test_tiny_model_folder_matches_transformers(tiny_model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    ours = ChatTemplate.from_model_dir(tiny_model)
    assert ours.eos_token == hf.eos_token
    args = {"city": "Zürich"}
    conversations = [
        (BASIC, BASIC, {}),
        (THINKING_HISTORY, THINKING_HISTORY, {"enable_thinking": False}),
        (
            [
                {"role": "user", "content": "weather?"},
                openai_tool_turn(json.dumps(args), content="Checking."),
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            [
                {"role": "user", "content": "weather?"},
                hf_tool_turn(args, content="Checking."),
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            {"tools": TOOLS},
        ),
    ]
    for mine, theirs, kw in conversations:
        for agp in (True, False):
            want = hf.apply_chat_template(theirs, tokenize=False, add_generation_prompt=agp, **kw)
            assert ours.render(mine, add_generation_prompt=agp, **kw) == want
