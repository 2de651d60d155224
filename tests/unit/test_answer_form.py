"""Call or reply (issue 26 §2, ``pantheon.chat.answer_form``): ``tool_choice: "auto"`` on a template
that takes no tools answers one JSON object, ``{"response": ...}`` or ``{"tool_call(s)": ...}``,
under a grammar; the reader maps it to content and tool calls the same however it is split."""

from __future__ import annotations

import json
import shutil

import llguidance as llg
import pytest

from pantheon.api import structured
from pantheon.api.openai.protocol import parse_chat_request
from pantheon.chat.answer_form import (
    AFTER_RESULTS,
    AnswerReader,
    CallOrReply,
    answer_prompt,
    past_answer,
    with_answer_prompt,
)
from pantheon.chat.emitter import Delta, join_deltas
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
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}]}'
)

# (answer text, the content it gives, the calls it gives as (name, arguments))
CASES = [
    ('{"response": "It is sunny."}', "It is sunny.", []),
    (
        '{"response": "a\\nb \\"q\\" \\\\ \\/ \\t caf\\u00e9 \\ud83d\\ude00 lone \\ud83d! end"}',
        'a\nb "q" \\ / \t café \U0001f600 lone \ufffd! end',
        [],
    ),
    ('{"response": "\\udc00x"}', "\ufffdx", []),
    ('{ "response" :\n "spaced" }', "spaced", []),
    (CALL, "", [("get_weather", '{"city": "Paris"}')]),
    (CALLS, "", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Zürich"}')]),
    # cut off (max_tokens, a stop string): what there is, never markup
    ('{"response": "It is sun', "It is sun", []),
    ('{"response": "caf\\u00', "caf", []),
    ('{"respo', "", []),
    (
        '{"tool_call": {"name": "get_weather", "arguments": {"city": "Pa',
        "",
        [("get_weather", '{"city": "Pa')],
    ),
    ('{"tool_call": {"name": "get_wea', "", []),
    (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "argu',
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", "")],
    ),
    # not the form (no grammar was in force): content as written
    ("Hello there", "Hello there", []),
    ('{"tool_call": "oops"}', '{"tool_call": "oops"}', []),
]


def run(text: str, cuts: list[int]) -> list[Delta]:
    reader = AnswerReader()
    out, last = [], 0
    for cut in [*cuts, len(text)]:
        out += reader.feed(text[last:cut])
        last = cut
    return out + reader.finish()


def shape(deltas: list[Delta]) -> dict:
    """The joined message, call ids replaced by whether each call has one of OpenAI's form."""
    msg = join_deltas(deltas)
    for call in msg["tool_calls"]:
        assert call["id"].startswith("call_") and len(call["id"]) == 29
        call["id"] = "id"
    return msg


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_split_gives_the_same_deltas(text, content, calls):
    want = {
        "reasoning": "",
        "content": content,
        "tool_calls": [
            {"id": "id", "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    assert shape(run(text, [])) == want
    assert shape(run(text, list(range(1, len(text))))) == want  # a character at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert shape(run(text, [i, j])) == want, (i, j)


def test_the_reply_streams_as_it_comes():
    reader = AnswerReader()
    assert reader.feed('{"resp') == []
    assert [d.text for d in reader.feed('onse": "Bonj')] == ["Bonj"]
    assert reader.feed("our \\") == [Delta("content", text="our ")]  # the escape waits for its letter
    assert [d.text for d in reader.feed('u00e9t\\u00e9"}')] == ["été"]
    assert reader.done and reader.feed("trailing") == [] and reader.finish() == []


def test_a_call_comes_once_its_object_closes():
    reader = AnswerReader()
    assert reader.feed(CALL[:-1]) == []
    deltas = reader.feed(CALL[-1])
    assert [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Paris"}'),
    ]


def test_stop_strings_and_reasoning_go_through_the_emitter_first():
    got = CallOrReply(reasoning=True, stop=["sun"])
    deltas = got.feed('<think>\nhm\n</think>\n\n{"response": "It is sunny."}')
    assert got.stopped and join_deltas(deltas)["reasoning"] == "hm"
    assert join_deltas(deltas)["content"] == "It is "
    plain = CallOrReply(reasoning=False)
    assert (
        join_deltas(plain.feed(CALL) + plain.finish())["tool_calls"][0]["function"]["name"] == "get_weather"
    )


def test_the_prompt_and_the_history_in_the_form():
    prompt = answer_prompt([WEATHER])
    assert '"name": "get_weather"' in prompt and '{"response": ' in prompt and '{"tool_calls": [' in prompt
    assert '{"tool_calls"' not in answer_prompt([WEATHER], parallel=False)
    called = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert json.loads(past_answer(called)) == {
        "tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}
    }
    assert json.loads(past_answer({"role": "assistant", "content": "Hi"})) == {"response": "Hi"}
    user = {"role": "user", "content": "Weather in Paris?"}
    result = {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}
    msgs = with_answer_prompt([{"role": "system", "content": "Be brief."}, user, called, result], [WEATHER])
    assert msgs[0] == {"role": "system", "content": "Be brief.\n\n" + prompt}
    assert msgs[2] == {"role": "assistant", "content": past_answer(called)}
    assert msgs[3:] == [result, {"role": "system", "content": AFTER_RESULTS}]  # only after results
    assert with_answer_prompt([user], [WEATHER]) == [{"role": "system", "content": prompt}, user]
    assert len(with_answer_prompt([user, called, result], [WEATHER], nudge=False)) == 4


def _accepts(grammar: str, text: str) -> bool:
    tok = structured._bytes()
    m = llg.LLMatcher(tok, grammar, log_level=0)
    return all(m.consume_token(t) for t in tok.tokenize_str(text)) and m.is_accepting()


def test_the_grammar_allows_a_call_or_a_reply_and_nothing_else():
    grammar = structured.call_or_reply_grammar([WEATHER])
    for text in ('{"response": "hi \\"x\\""}', CALL, CALLS.replace("Z\\u00fcrich", "Rome")):
        assert _accepts(grammar, text), text
    for text in (
        '{"response": ""}',
        "Paris is sunny.",
        '{"tool_call": {"name": "get_time", "arguments": {}}}',
        '{"tool_call": {"name": "get_weather", "arguments": {}}}',  # city is required
    ):
        assert not _accepts(grammar, text), text
    assert not _accepts(
        structured.call_or_reply_grammar([WEATHER], parallel=False), CALLS.replace("Z\\u00fcrich", "Rome")
    )


def test_the_lazy_grammar_allows_prose_and_holds_an_opened_form():
    """``prose``: free text as the model writes it, but an answer that opens with ``{`` is one of
    the forms, as strictly as without it (issue 40 section 5)."""
    grammar = structured.call_or_reply_grammar([WEATHER], prose=True)
    for text in ("Paris is sunny.", "I'm fine, thanks! {not json}", '{"response": "hi"}', CALL):
        assert _accepts(grammar, text), text
    for text in (
        '{"tool_call": {"name": "get_time", "arguments": {}}}',
        '{"tool_call": {"name": "get_weather", "arguments": {}}}',
        "{Paris is sunny.}",
        " Paris",  # a leading blank opens nothing
        "",
    ):
        assert not _accepts(grammar, text), text


NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_FIRST_ONLY = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
)


@pytest.fixture(scope="module")
def assets_with(tiny_model, tmp_path_factory):
    """``make(template)``: the tiny model's assets with ``template`` as its chat template."""
    made: dict[str, ModelAssets] = {}

    def make(template: str) -> ModelAssets:
        if template not in made:
            folder = tmp_path_factory.mktemp("template") / "model"
            shutil.copytree(tiny_model, folder)
            (folder / "chat_template.jinja").write_text(template)
            made[template] = ModelAssets(folder)
        return made[template]

    return make


def _prompt(assets: ModelAssets, body: dict):
    prep = fit_context(assets, parse_chat_request(body), 1 << 20)
    return prep, assets.tokenizer.decode(prep.prompt_ids, skip_special_tokens=False)


def test_auto_on_a_template_without_tools_answers_in_the_form_and_only_then(assets_with):
    assets = assets_with(NO_TOOLS_TEMPLATE)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prep, text = _prompt(assets, {"messages": user, "tools": [WEATHER]})
    assert prep.answer_form and answer_prompt([WEATHER]) in text
    prep, text = _prompt(assets, {"messages": user, "tools": [WEATHER], "parallel_tool_calls": False})
    assert prep.answer_form and answer_prompt([WEATHER], parallel=False) in text
    for other in (
        {"tool_choice": "required"},  # forced in the <tool_call> form, as before
        {"response_format": {"type": "json_object"}},  # the request's own constraint wins
        {"tool_choice": "none"},
    ):
        prep, text = _prompt(assets, {"messages": user, "tools": [WEATHER], **other})
        assert not prep.answer_form and '{"response"' not in text, other
    # a schema llguidance cannot compile (a look-behind): free text in the generic form, no 400
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"y": {"type": "string", "pattern": "(?<=a)b"}}},
        },
    }
    prep, text = _prompt(assets, {"messages": user, "tools": [bad]})
    assert not prep.answer_form and "<tool_call>" in text
    takes = assets_with("{% for t in tools or [] %}{{ t.function.name }}\n{% endfor %}" + NO_TOOLS_TEMPLATE)
    assert not _prompt(takes, {"messages": user, "tools": [WEATHER]})[0].answer_form


def test_a_template_that_refuses_the_line_after_results_renders_without_it(assets_with):
    assets = assets_with(SYSTEM_FIRST_ONLY)
    called = {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    }
    msgs = [
        {"role": "user", "content": "Weather?"},
        called,
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]
    prep, text = _prompt(assets, {"messages": msgs, "tools": [WEATHER]})
    assert prep.answer_form and text.endswith("tool: Sunny\n") and AFTER_RESULTS not in text
    prep, text = _prompt(assets_with(NO_TOOLS_TEMPLATE), {"messages": msgs, "tools": [WEATHER]})
    assert text.endswith(f"<|im_start|>system\n{AFTER_RESULTS}<|im_end|>\n<|im_start|>assistant\n")
