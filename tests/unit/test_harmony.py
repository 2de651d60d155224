"""gpt-oss's Harmony output format (pantheon.chat.harmony): every message kind, split anywhere."""

from __future__ import annotations

import json
import random

import pytest

from pantheon.chat.emitter import join_deltas
from pantheon.chat.harmony import HARMONY_MARKERS, MAX_HEADER, HarmonyParser

from helpers.parsers import CALL_ID, run_parser

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Zürich 🌧.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny, 22 °C.<|return|>"
# the recipient after the channel, with <|constrain|> (what gpt-oss writes) ...
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Zürich", "days": 2}<|call|>'
)
# ... and before it, in the role part of the header (what the template renders)
CALL_IN_ROLE = (
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>'
)
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"


def run(chunks, **kw):
    """Feed ``chunks``; return (joined result with ids checked and blanked, parser, deltas)."""
    return run_parser(HarmonyParser, chunks, **kw)


def whole(text, **kw):
    return run([text], **kw)[0]


def assert_split_invariant(text, every=True, **kw):
    """Whole, char by char, at every single split point (``every``) and at random splits: the
    same."""
    want, p_whole, _ = run([text], **kw)
    assert run(list(text), **kw)[0] == want
    for i in range(len(text) + 1) if every else ():
        got, p, _ = run([text[:i], text[i:]], **kw)
        assert got == want, i
        assert p.stopped == p_whole.stopped
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(chunks, **kw)[0] == want, chunks
    return want, p_whole


def calls(out):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]]


# ----------------------------------------------------------------------------- message kinds


def test_analysis_then_final():
    out, p = assert_split_invariant(ANALYSIS + FINAL)
    assert out == {
        "reasoning": "The user wants the weather in Zürich 🌧.",
        "content": "It is sunny, 22 °C.",
        "tool_calls": [],
    }
    assert p.finish_reason("stop") == "stop"


def test_analysis_then_call_recipient_after_channel():
    out, p = assert_split_invariant(ANALYSIS + CALL)
    assert out["reasoning"] == "The user wants the weather in Zürich 🌧."
    assert out["content"] == ""
    assert calls(out) == [("get_weather", '{"city": "Zürich", "days": 2}')]
    assert p.finish_reason("stop") == "tool_calls"
    assert p.tool_calls[0]["function"]["arguments"] == '{"city": "Zürich", "days": 2}'


def test_call_with_recipient_in_the_role_header():
    out, _ = assert_split_invariant(ANALYSIS + CALL_IN_ROLE)
    assert calls(out) == [("get_time", '{"tz": "CET"}')]
    # the first message may carry the recipient too (the prompt ends with <|start|>assistant)
    out, _ = assert_split_invariant(
        ' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>'
    )
    assert calls(out) == [("get_time", '{"tz": "UTC"}')]


def test_preamble_is_content_and_calls_follow():
    out, _ = assert_split_invariant(ANALYSIS + PREAMBLE + CALL + CALL_IN_ROLE)
    assert out["content"] == "Let me check."
    assert calls(out) == [("get_weather", '{"city": "Zürich", "days": 2}'), ("get_time", '{"tz": "CET"}')]


def test_call_deltas_are_openai_shaped_and_stream_arguments():
    _, _, deltas = run(list(CALL))
    head, *frags = [d for d in deltas if d.kind == "tool_call"]
    assert head.index == 0 and head.name == "get_weather" and head.arguments == ""
    assert head.id is not None and CALL_ID.fullmatch(head.id)
    assert all(d.index == 0 and d.id is None and d.name is None for d in frags)
    assert len(frags) > 1  # streamed as it came
    assert "".join(d.arguments or "" for d in frags) == '{"city": "Zürich", "days": 2}'


def test_same_kind_messages_are_joined_with_a_newline():
    text = ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + PREAMBLE + FINAL
    out, _ = assert_split_invariant(text)
    assert out["reasoning"] == "The user wants the weather in Zürich 🌧.\nMore."
    assert out["content"] == "Let me check.\nIt is sunny, 22 °C."


def test_unknown_channel_and_no_channel_are_content():
    out, _ = assert_split_invariant("<|channel|>scratchpad<|message|>odd<|end|>" + FINAL)
    assert out == {"reasoning": "", "content": "odd\nIt is sunny, 22 °C.", "tool_calls": []}
    out, _ = assert_split_invariant("<|message|>bare<|end|>")
    assert out["content"] == "bare"


def test_final_ended_by_end_or_by_the_next_start():
    out, _ = assert_split_invariant("<|channel|>final<|message|>a<|end|>")
    assert out["content"] == "a"
    out, _ = assert_split_invariant(
        "<|channel|>analysis<|message|>r<|start|>assistant<|channel|>final<|message|>c"
    )
    assert (out["reasoning"], out["content"]) == ("r", "c")


def test_markers_never_reach_the_output():
    text = ANALYSIS + PREAMBLE + CALL + FINAL
    _, _, deltas = run(list(text))
    for d in deltas:
        for m in HARMONY_MARKERS:
            assert m not in (d.text or "") and m not in (d.arguments or "")
        assert "assistant" not in (d.text or "") and "commentary" not in (d.text or "")


def test_body_whitespace_is_kept_and_call_arguments_are_trimmed():
    out, _ = assert_split_invariant("<|channel|>final<|message|>\n  two\nlines  \n<|return|>")
    assert out["content"] == "\n  two\nlines  \n"
    out, _ = assert_split_invariant('<|channel|>commentary to=functions.f<|message|> \n{"a": 1} \n<|call|>')
    assert calls(out) == [("f", '{"a": 1}')]


def test_tools_disabled_call_body_is_content():
    out, p = assert_split_invariant(CALL, tools_enabled=False)
    assert out == {"reasoning": "", "content": '{"city": "Zürich", "days": 2}', "tool_calls": []}
    assert p.finish_reason("stop") == "stop"


def test_a_message_to_the_assistant_is_no_call():
    out, _ = assert_split_invariant(
        "<|start|>functions.f to=assistant<|channel|>commentary<|message|>42<|end|>"
    )
    assert out == {"reasoning": "", "content": "42", "tool_calls": []}


# ----------------------------------------------------------------------------- not Harmony


def test_plain_text_is_content_and_streams_at_once():
    out, _ = assert_split_invariant("Hello, no Harmony here.")
    assert out["content"] == "Hello, no Harmony here."
    p = HarmonyParser()
    assert join_deltas(p.feed("Hel"))["content"] == "Hel"  # "H" cannot begin a header


def test_stray_header_with_a_newline_or_too_long_is_content():
    out, _ = assert_split_invariant("assistant\nsays hi<|end|>")
    assert out["content"] == "assistant\nsays hi"
    long = "<|" + "x" * (MAX_HEADER + 10)
    out, _ = assert_split_invariant(long)
    assert out["content"] == long


def test_header_cut_off_is_dropped_unless_it_names_a_recipient():
    for cut in (
        "<",
        "<|chan",
        "<|channel|>analy",
        "<|channel|>analysis",
        "assist",
        "<|channel|>commentary to=functions.get_wea",
    ):
        assert whole(cut) == {"reasoning": "", "content": "", "tool_calls": []}, cut
    out = whole("<|channel|>commentary to=functions.get_weather <|constr")
    assert calls(out) == [("get_weather", "")]
    assert whole(FINAL[: FINAL.index("<|channel|>")] + "<|chan") == whole("")  # after <|start|>
    # text that only began like a role is text
    out, _ = assert_split_invariant("assistant is here")
    assert out["content"] == "assistant is here"
    out, _ = assert_split_invariant("<|channel|>final<|message|>a<|end|>assistant b")
    assert out["content"] == "a\nassistant b"


def test_max_tokens_anywhere_in_a_call_is_what_it_is_never_markup():
    """The output cut after every character: streamed or not the same, no markup in any
    field, and once the recipient is whole a call with the arguments so far."""
    text = ANALYSIS + CALL
    args = '{"city": "Zürich", "days": 2}'
    named_at = text.index("get_weather") + len("get_weather") + 1
    for cut in range(len(text) + 1):
        out, _ = assert_split_invariant(text[:cut], every=False)
        for field in ("reasoning", "content"):
            assert "<|" not in out[field] and "to=" not in out[field], (cut, out)
            out[field] = out[field].removesuffix("<")  # a lone "<" may be text
        assert out["content"] == "", (cut, out)
        if cut >= named_at:
            ((name, got),) = calls(out)
            assert name == "get_weather" and args.startswith(got.removesuffix("<")), (cut, got)
        else:
            assert out["tool_calls"] == [], (cut, out)
        assert "The user wants the weather in Zürich 🌧.".startswith(out["reasoning"]), cut


def test_cut_in_the_middle_of_an_end_marker():
    for cut in range(1, len("<|return|>")):
        text = "<|channel|>final<|message|>done" + "<|return|>"[:cut]
        out, _ = assert_split_invariant(text)
        assert out["content"] == "done" + ("<" if cut == 1 else ""), cut  # a lone "<" is text


# ----------------------------------------------------------------------------- stop strings


def test_stop_string_in_a_body_at_every_position():
    body = "The answer is 42, surely."
    for i in range(len(body)):
        for j in range(i + 1, min(len(body), i + 4) + 1):
            stop = body[i:j]
            text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + body + "<|return|>"
            out, p = assert_split_invariant(text, stop=[stop])
            if stop in "The user wants the weather in Zürich 🌧.":
                continue  # it matched in the reasoning
            assert p.stopped and p.stop_string == stop
            assert out["content"] == body[: body.index(stop)]


def test_stop_strings_are_not_matched_in_headers_or_across_messages():
    out, p = assert_split_invariant(ANALYSIS + FINAL, stop=["final", "analysis", "assistant", "🌧.It"])
    assert not p.stopped
    assert out["content"] == "It is sunny, 22 °C."


def test_stop_inside_a_call_returns_the_call_so_far():
    out, p = assert_split_invariant(ANALYSIS + CALL, stop=['"days"'])
    assert p.stopped
    assert calls(out) == [("get_weather", '{"city": "Zürich",')]


def test_stop_in_reasoning_ends_everything():
    out, p = assert_split_invariant(ANALYSIS + FINAL, stop=["weather"])
    assert p.stopped and out == {"reasoning": "The user wants the ", "content": "", "tool_calls": []}
    assert p.feed("more") == [] and p.finish() == []


def test_stop_limits():
    with pytest.raises(ValueError):
        HarmonyParser(stop=["a", "b", "c", "d", "e"])


# ----------------------------------------------------------------------------- random texts


def test_random_harmony_texts_split_invariant():
    rng = random.Random(7)
    parts = [
        ANALYSIS,
        FINAL,
        CALL,
        CALL_IN_ROLE,
        PREAMBLE,
        "<|end|>",
        "<|start|>",
        "<|message|>",
        "x\n",
        " to=",
        "é",
    ]
    for _ in range(40):
        text = "".join(rng.choice(parts) for _ in range(rng.randrange(1, 5)))
        text = text[: rng.randrange(len(text) + 1)]
        out, _ = assert_split_invariant(text, stop=["sunny"] if rng.random() < 0.3 else ())
        json.dumps(out)


# ----------------------------------------------------------------------------- the detokenizer


def _harmony_tokenizer():
    """Our make-model tokenizer with Harmony's markers as special tokens (as gpt-oss's are)."""
    from tokenizers import AddedToken, Tokenizer

    from makemodel.tokenizer_train import tokenizer_json

    tok = Tokenizer.from_str(tokenizer_json())
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in sorted(HARMONY_MARKERS)])
    return tok


def test_markers_reach_the_parser_through_the_detokenizer_only_when_kept():
    from pantheon.chat.detokenize import IncrementalDetokenizer

    tok = _harmony_tokenizer()
    prompt = tok.encode(
        "<|start|>user<|message|>Weather?<|end|><|start|>assistant", add_special_tokens=False
    ).ids
    text = ANALYSIS + CALL + "<|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<|call|>") in ids  # one token each
    parser = HarmonyParser()
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, keep_special=parser.keep_special)
    deltas = []
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        deltas += parser.feed(pieces[-1])
    deltas += parser.feed(detok.flush()) + parser.finish()
    assert "".join(pieces) == ANALYSIS + CALL  # <|endoftext|> is still skipped
    out = join_deltas(deltas)
    assert out["reasoning"] == "The user wants the weather in Zürich 🌧."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] == [
        ("get_weather", '{"city": "Zürich", "days": 2}')
    ]
    # without keep_special (every other format) special tokens stay skipped, as before
    plain = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert plain.push_many(ids) + plain.flush() == tok.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- the template


def _gpt_oss_template():
    from pantheon.chat.template import ChatTemplate
    from tests.helpers.paths import need_specs

    source = (need_specs() / "gpt-oss-120b.chat_template.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, name="gpt-oss-120b")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def test_the_real_template_is_harmony_and_takes_tools():
    from pantheon.chat.output import output_parser
    from pantheon.chat.tools import HARMONY_TOOL_FORMAT, forced_call_prefix

    t = _gpt_oss_template()
    assert t.tool_format == HARMONY_TOOL_FORMAT
    assert t.takes_tools  # so the generic tool prompt is never added
    parser = output_parser(t.tool_format, reasoning=True)
    assert isinstance(parser, HarmonyParser)
    # a forced call's prompt ends with its header: the parser reads it as the call's opening
    prefix = forced_call_prefix(t.tool_format, "get_weather")
    out = join_deltas(parser.feed(prefix) + parser.feed('{"city": "Oslo"}') + parser.finish())
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')
    ]


def test_the_real_template_renders_tools_reasoning_and_tool_results():
    t = _gpt_oss_template()
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        # as an OpenAI client sends our answer back: reasoning_content, no content, the call
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    undescribed = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    prompt = t.render(messages, tools=[WEATHER_TOOL, undescribed], reasoning_effort="high")
    assert "// \ntype get_time = () => any;" in prompt  # no description: the template's own would fail
    assert "Reasoning: high" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in prompt
    assert "type get_weather = (_: {" in prompt
    assert "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>" in prompt
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        in prompt
    )
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"sky\\": \\"clear\\"}"<|end|>'
        in prompt
    )
    assert prompt.endswith("<|start|>assistant")

    # a preamble beside the reasoning: the template takes one of them, the reasoning
    messages[2]["content"] = "Let me look."
    assert "I should call the tool." in t.render(messages, tools=[WEATHER_TOOL])

    # a later final answer: the template drops the call's analysis, renders the answer
    messages += [
        {"role": "assistant", "content": "Clear skies.", "reasoning_content": "Easy."},
        {"role": "user", "content": "Thanks!"},
    ]
    prompt = t.render(messages, tools=[WEATHER_TOOL])
    assert "I should call the tool." not in prompt and "Easy." not in prompt
    assert "<|start|>assistant<|channel|>final<|message|>Clear skies.<|end|>" in prompt
    assert "Reasoning: medium" in prompt  # the template's default
    assert prompt.endswith("<|start|>user<|message|>Thanks!<|end|><|start|>assistant")


# ----------------------------------------------------------------------------- a model folder


@pytest.fixture(scope="module")
def harmony_assets(tmp_path_factory):
    """A model folder as the router reads it: gpt-oss's template, a tokenizer with Harmony's
    special tokens, a config that names only <|return|> as its end."""
    from pantheon.models.assets import ModelAssets
    from tests.helpers.paths import need_specs

    folder = tmp_path_factory.mktemp("harmony-model")
    _harmony_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(
        (need_specs() / "gpt-oss-120b.chat_template.jinja").read_text(encoding="utf-8"), encoding="utf-8"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}), encoding="utf-8")
    return ModelAssets(folder)


def test_assets_of_a_harmony_model(harmony_assets):
    a = harmony_assets
    assert a.reasoning and a.tool_call_markup
    ids = {a.tokenizer.token_to_id(t) for t in ("<|return|>", "<|call|>")}
    assert ids <= set(a.eos_ids)  # a call ends the output, whatever the config says


def test_a_forced_call_opens_its_header_in_the_prompt(harmony_assets):
    import llguidance as llg

    from pantheon.api import structured
    from pantheon.api.openai.protocol import parse_chat_request
    from pantheon.chat.tools import HARMONY_TOOL_FORMAT
    from pantheon.control.context import render

    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER_TOOL, other],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "reasoning_effort": "low",
    }
    req = parse_chat_request(body)
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    ids, prefix, opened, forced, _ = render(harmony_assets, req, req.messages)
    prompt = harmony_assets.tokenizer.decode(ids, skip_special_tokens=False)
    assert "Reasoning: low" in prompt
    assert forced == "get_weather" and not opened
    assert prompt.endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    )
    assert prefix == "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    # the grammar is the arguments alone
    grammar = structured.tool_grammar([WEATHER_TOOL], "get_weather", prefix, HARMONY_TOOL_FORMAT)
    assert "%json" in grammar and "tool_call" not in grammar
    # "required" with several tools: the prompt opens the call, the grammar names a function
    # and ends the header in its special tokens, which the model's own vocabulary has
    req = parse_chat_request(dict(body, tool_choice="required"))
    ids, prefix, _, forced, _ = render(harmony_assets, req, req.messages)
    assert forced is None and prefix == "<|channel|>commentary to=functions."
    tok = harmony_assets.tokenizer
    grammar = structured.tool_grammar(
        [WEATHER_TOOL, other], None, prefix, HARMONY_TOOL_FORMAT, token_id=tok.token_to_id
    )
    vocab = structured.ModelTokenizer(tok.to_str(), tok.get_vocab_size(), harmony_assets.eos_ids)
    structured.check_for_model(grammar, vocab, "tools")
    matcher = llg.LLMatcher(vocab.tokenizer, grammar)
    written = tok.encode('get_time <|constrain|>json<|message|>{"x": 1}', add_special_tokens=False).ids
    assert tok.token_to_id("<|message|>") in written
    for i in written:
        assert matcher.consume_token(i), tok.decode([i], skip_special_tokens=False)
    assert matcher.is_accepting()
    # the parser reads the prompt's opening and the rest as one call
    parser = HarmonyParser()
    text = prefix + tok.decode(written, skip_special_tokens=False)
    out = join_deltas(parser.feed(text) + parser.finish())
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] == [
        ("get_time", '{"x": 1}')
    ]


def test_reasoning_effort_reaches_the_template_kwargs():
    from pantheon.api.openai.protocol import parse_chat_request
    from pantheon.api.openai.responses import parse_responses_request
    from pantheon.errors import ApiError

    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat_request({"messages": msgs}).chat_template_kwargs == {}
    req = parse_chat_request({"messages": msgs, "reasoning_effort": "high"})
    assert req.chat_template_kwargs == {"reasoning_effort": "high"}
    # the client's own chat_template_kwargs win
    req = parse_chat_request(
        {"messages": msgs, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    )
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(ApiError) as e:
        parse_chat_request({"messages": msgs, "reasoning_effort": "extreme"})
    assert e.value.param == "reasoning_effort"
    # Responses: reasoning.effort
    r = parse_responses_request({"input": "hi", "reasoning": {"effort": "low"}})
    assert r.chat.chat_template_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(ApiError) as e:
        parse_responses_request({"input": "hi", "reasoning": {"effort": 3}})
    assert e.value.param == "reasoning.effort"


def test_a_constrained_answer_starts_after_the_analysis(harmony_assets):
    """``response_format`` on a Harmony model: the model reasons freely, the grammar starts at
    ``<|channel|>final<|message|>`` (as vLLM starts it)."""
    from pantheon.api.generation import constraint_of
    from pantheon.api.openai.protocol import parse_chat_request
    from pantheon.control.context import fit_context
    from pantheon.control.registry import Instance, Slots

    inst = Instance(
        name="h", instance_id="h#1", path="", dies=("cpu:0",), gate=Slots(1), assets=harmony_assets
    )
    req = parse_chat_request(
        {"messages": [{"role": "user", "content": "JSON please"}], "response_format": {"type": "json_object"}}
    )
    prep = fit_context(harmony_assets, req, 4096)
    grammar, after, opening = constraint_of(inst, req, prep)
    tok = harmony_assets.tokenizer
    assert grammar is not None and opening == -1
    assert after == tok.encode("<|channel|>final<|message|>", add_special_tokens=False).ids
    assert after[0] == tok.token_to_id("<|channel|>") and after[-1] == tok.token_to_id("<|message|>")
