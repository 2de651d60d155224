"""Gemma 4's output format (pantheon.chat.gemma4): thinking, tool calls in the template's own
argument syntax, content; split anywhere; and the real template (../shared/specs) around it."""

from __future__ import annotations

import json
import random

import pytest
from test_structured_router import accepts

from pantheon.api import structured
from pantheon.chat.emitter import Emitter, join_deltas
from pantheon.chat.gemma4 import GEMMA4_MARKERS, Gemma4Parser, gemma4_arguments, read_gemma4_calls
from pantheon.chat.output import output_parser
from pantheon.chat.template import ChatTemplate
from pantheon.chat.toolformats.gemma4 import gemma4_thinks
from pantheon.chat.tools import GEMMA4_TOOL_FORMAT, JSON_TOOL_FORMAT, forced_call_prefix, tool_call_format

from helpers.parsers import run_parser
from helpers.paths import SPECS, need_specs

THOUGHT = "<|channel>thought\nThe user wants the weather in Zürich 🌧.\n<channel|>"
CALL = '<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>,days:2}<tool_call|>'
CALL2 = '<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|>'
NESTED = (
    '<|tool_call>call:plan{note:<|"|>say "hi", then\n{go}<|"|>,opts:{deep:true,ratio:2.5,'
    'tiny:1e-05,xs:[1,-2,<|"|>a<|"|>,[]],none:None},flag:false}<tool_call|>'
)
NESTED_ARGS = {
    "note": 'say "hi", then\n{go}',
    "opts": {"deep": True, "ratio": 2.5, "tiny": 1e-05, "xs": [1, -2, "a", []], "none": None},
    "flag": False,
}
ANSWER = "It is sunny, 22 °C."


def run(chunks, **kw):
    """Feed ``chunks``; return (joined result with ids checked and blanked, parser, deltas)."""
    return run_parser(Gemma4Parser, chunks, **kw)


def whole(text, **kw):
    return run([text], **kw)[0]


def calls(out):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out["tool_calls"]]


def assert_split_invariant(text, **kw):
    """Whole, char by char, at every single split point and at random splits: the same."""
    want, p_whole, _ = run([text], **kw)
    assert run(list(text), **kw)[0] == want
    for i in range(len(text) + 1):
        got, p, _ = run([text[:i], text[i:]], **kw)
        assert got == want, i
        assert p.stopped == p_whole.stopped
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        assert run([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], **kw)[0] == want
    return want


# ------------------------------------------------------------------ the parser


def test_thinking_calls_and_content_every_split_the_same():
    out = assert_split_invariant(THOUGHT + CALL + CALL2 + "<|tool_response>")
    assert out["reasoning"] == "The user wants the weather in Zürich 🌧."
    assert out["content"] == ""
    assert calls(out) == [("get_weather", {"city": "Zürich", "days": 2}), ("get_time", {"tz": "CET"})]
    out = assert_split_invariant(THOUGHT + "\n\n" + ANSWER + "<turn|>")
    assert out == {
        "reasoning": "The user wants the weather in Zürich 🌧.",
        "content": ANSWER,
        "tool_calls": [],
    }
    # no thinking (the prompt closed an empty thought channel): content from the first character
    assert assert_split_invariant(ANSWER) == {"reasoning": "", "content": ANSWER, "tool_calls": []}


def test_text_before_a_call_and_two_thoughts():
    text = THOUGHT + "Let me check.\n" + CALL + "<|channel>thought\nAnd the time.<channel|>" + CALL2
    out = assert_split_invariant(text)
    assert out["content"] == "Let me check."
    assert out["reasoning"] == "The user wants the weather in Zürich 🌧.\nAnd the time."
    assert [n for n, _ in calls(out)] == ["get_weather", "get_time"]


def test_the_argument_syntax_reads_back_as_json():
    out = assert_split_invariant(NESTED)
    assert calls(out) == [("plan", NESTED_ARGS)]
    assert gemma4_arguments('{<|"|>quoted<|"|>:1, spaced : <|"|>x<|"|> }') == (
        '{"quoted": 1, "spaced": "x"}',
        True,
    )
    assert gemma4_arguments("{word:Paris,n:007,big:12345678901234567890}") == (
        '{"word": "Paris", "n": 7, "big": 12345678901234567890}',
        True,
    )
    assert gemma4_arguments("{}") == ("{}", True)
    with pytest.raises(ValueError):
        gemma4_arguments("city:1")
    with pytest.raises(ValueError):
        gemma4_arguments("{a:1 b:2}")
    # several calls in one block
    (a, b), whole_ = read_gemma4_calls("call:f{x:1}call:g{}")
    assert (a.name, a.arguments, b.name, b.arguments, whole_) == ("f", '{"x": 1}', "g", "{}", True)
    (c,), whole_ = read_gemma4_calls("call:f{x:1 y:2} more")  # strays from the syntax: as it is
    assert (c.name, c.arguments, whole_) == ("f", '{"x": 1', False)
    assert read_gemma4_calls("call:get_wea") == ([], False)


def test_cut_off_arguments_are_the_json_so_far():
    assert gemma4_arguments('{city:<|"|>Pa') == ('{"city": "Pa', False)
    assert gemma4_arguments('{city:<|"|>Paris<|"') == ('{"city": "Paris', False)  # a cut closing marker
    assert gemma4_arguments('{city:<|"|>Paris<|"|>,da') == ('{"city": "Paris", ', False)  # a key held back
    assert gemma4_arguments("{n:12") == ('{"n": ', False)  # a number may go on
    assert gemma4_arguments("{n:12,xs:[tr") == ('{"n": 12, "xs": [', False)


def test_a_call_cut_off_is_what_it_is_never_markup():
    """Every prefix of a call (max_tokens): its name and the arguments so far once the name is
    whole, nothing before; never a marker in the content; the same split anywhere."""
    text = "Sure. " + NESTED
    for i in range(len(text) + 1):
        out = whole(text[:i])
        assert "<|" not in out["content"] and "|>" not in out["content"], i
        assert "Sure. <".startswith(out["content"]), (i, out)  # (a lone "<" is text)
        if i >= len("Sure. <|tool_call>call:plan{"):
            ((name, args),) = [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]]
            assert name == "plan" and args.startswith("{"), i
        else:
            assert out["tool_calls"] == [], i
    out = assert_split_invariant(text[: text.index("ratio")])
    assert (
        out["tool_calls"][0]["function"]["arguments"]
        == '{"note": "say \\"hi\\", then\\n{go}", "opts": {"deep": true, '
    )


def test_stop_strings_in_every_part():
    out = assert_split_invariant(THOUGHT + ANSWER, stop=["22"])
    assert out["content"] == "It is sunny, " and out["reasoning"].startswith("The user")
    out, p, _ = run([THOUGHT + ANSWER], stop=["Zürich"])
    assert p.stopped and p.stop_string == "Zürich" and out["reasoning"] == "The user wants the weather in "
    out = assert_split_invariant(CALL, stop=["days"])  # inside a call: cut there
    assert out["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich", '
    assert whole(CALL, stop=["thought"])["tool_calls"]  # a marker's text is no stop string's


def test_markers_never_leak():
    text = "<|turn>Hi<tool_response|> there<|think|><channel|>.<|tool_response>response:f{value:1}"
    out = assert_split_invariant(text)
    assert out == {"reasoning": "", "content": "Hi there.", "tool_calls": []}
    assert whole(ANSWER + "<turn|><|turn>user\nmore")["content"] == ANSWER  # the turn's end ends it
    assert whole("<|channel>thought\nhm")["reasoning"] == "hm"  # cut off in a thought
    assert whole("<|channel>thou") == {"reasoning": "", "content": "", "tool_calls": []}
    assert whole("Done <|tool_ca")["content"] == "Done"  # the output ended inside a marker
    assert whole("a < b")["content"] == "a < b"


def test_a_closed_block_that_is_no_call_is_content_and_tools_off_too():
    assert whole("<|tool_call>hello<tool_call|>")["content"] == "<|tool_call>hello<tool_call|>"
    out = whole(CALL, tools_enabled=False)
    assert out["tool_calls"] == [] and out["content"] == CALL


def test_the_factory_picks_the_parser_from_the_template():
    src = "{{ '<|tool_call>call:' + name + '{' }}x{{ '}<tool_call|>' }}"
    assert tool_call_format(src) == GEMMA4_TOOL_FORMAT
    assert ChatTemplate(src).tool_format == GEMMA4_TOOL_FORMAT
    p = output_parser(GEMMA4_TOOL_FORMAT, reasoning=True, stop=["x"])
    assert isinstance(p, Gemma4Parser) and p.keep_special == GEMMA4_MARKERS
    assert {'<|"|>', "<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>"} <= p.keep_special
    assert isinstance(output_parser(JSON_TOOL_FORMAT, reasoning=False), Emitter)
    assert forced_call_prefix(GEMMA4_TOOL_FORMAT, "get_weather") == "<|tool_call>call:get_weather{"
    assert forced_call_prefix(GEMMA4_TOOL_FORMAT, None) == "<|tool_call>call:"


# ------------------------------------------------------------------ the real template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city."},
                    "days": {"type": "integer"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "plan",
            "description": "Anything nested.",
            "parameters": {
                "type": "object",
                "properties": {
                    "note": {"type": "string"},
                    "opts": {"type": "object"},
                    "flag": {"type": "boolean"},
                },
            },
        },
    },
]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    need_specs()
    src = (SPECS / "gemma-4-31B-it.chat_template.jinja").read_text(encoding="utf-8")
    return ChatTemplate(src, bos_token="<bos>", eos_token="<turn|>", name="gemma-4-31B-it")


def _assistant(calls_args: list[tuple[str, dict]], reasoning: str | None = None) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "reasoning_content": reasoning,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls_args)
        ],
    }


def test_the_real_template_is_gemma4s_and_renders_a_whole_conversation(template):
    assert template.tool_format == GEMMA4_TOOL_FORMAT
    assert template.takes_tools
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich, and a plan?"},
        _assistant([("get_weather", {"city": "Zürich", "days": 2}), ("plan", NESTED_ARGS)], "Two tools."),
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    prompt = template.render(messages, tools=TOOLS, enable_thinking=True)
    assert prompt.startswith("<bos><|turn>system\n<|think|>\nBe brief.<|tool>declaration:get_weather{")
    assert "<|channel>thought\nTwo tools.\n<channel|>" in prompt
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>' in prompt
    assert prompt.endswith('response:plan{value:<|"|>done<|"|>}<tool_response|>')  # the model goes on
    # thinking off: the generation prompt closes an empty thought channel; reasoning_effort turns it on
    plain = template.render(messages[:2], tools=TOOLS)
    assert plain.endswith("<|turn>model\n<|channel>thought\n<channel|>") and "<|think|>" not in plain
    assert "<|think|>" in template.render(messages[:2], reasoning_effort="low")
    assert "<|think|>" not in template.render(messages[:2], reasoning_effort="none")
    assert "<|think|>" not in template.render(messages[:2], reasoning_effort="high", enable_thinking=False)
    assert gemma4_thinks({"reasoning_effort": "medium"}) and not gemma4_thinks({})


def test_a_call_rendered_by_the_template_parses_back_to_its_arguments(template):
    """Round trip: the template's own macro writes the calls of a model turn; the parser reads
    that turn (as the model would write it) back to the same reasoning and arguments."""
    turn = [("get_weather", {"city": "Zürich", "days": 2, "unit": "c"}), ("plan", NESTED_ARGS)]
    head = template.render([{"role": "user", "content": "Go."}], add_generation_prompt=False)
    text = template.render(
        [{"role": "user", "content": "Go."}, _assistant(turn, "Two tools.")],
        tools=None,
        add_generation_prompt=False,
    )
    model = text[len(head) :].removeprefix("<|turn>model\n")
    assert model.startswith("<|channel>thought\nTwo tools.\n<channel|><|tool_call>call:get_weather{")
    assert model.endswith("<tool_call|><|tool_response>")
    out = assert_split_invariant(model)
    assert out["reasoning"] == "Two tools." and out["content"] == ""
    assert calls(out) == turn


def test_the_forced_call_grammar_accepts_what_the_template_writes(template):
    turn = [("get_weather", {"city": "Zürich", "days": 2})]
    text = template.render(
        [{"role": "user", "content": "Go."}, _assistant(turn)], tools=None, add_generation_prompt=False
    )
    block = text[text.index("<|tool_call>") : text.index("<tool_call|>")]
    named = structured.tool_grammar(
        TOOLS, "get_weather", forced_call_prefix(GEMMA4_TOOL_FORMAT, "get_weather"), "gemma4"
    )
    after = block.removeprefix(forced_call_prefix(GEMMA4_TOOL_FORMAT, "get_weather"))
    assert after == 'city:<|"|>Zürich<|"|>,days:2}'
    assert accepts(named, after)
    assert accepts(named, 'city:<|"|>Paris<|"|>}')  # days is optional
    assert accepts(named, 'city:<|"|>Paris<|"|>,unit:<|"|>f<|"|>}')
    assert not accepts(named, "days:2}")  # city is required
    assert not accepts(named, 'city:<|"|>Paris<|"|>,days:two}')  # an integer
    assert not accepts(named, 'city:<|"|>Paris<|"|>,unit:<|"|>k<|"|>}')  # the enum
    assert not accepts(named, 'days:2,city:<|"|>Paris<|"|>}')  # the template's key order
    anyone = structured.tool_grammar(TOOLS, None, forced_call_prefix(GEMMA4_TOOL_FORMAT, None), "gemma4")
    assert accepts(anyone, "get_weather{" + after)
    nested = template.render(
        [{"role": "user", "content": "Go."}, _assistant([("plan", NESTED_ARGS)])],
        tools=None,
        add_generation_prompt=False,
    )
    plan = nested[nested.index("<|tool_call>call:") + len("<|tool_call>call:") : nested.index("<tool_call|>")]
    assert accepts(anyone, plan)
    assert not accepts(anyone, "other{}")
    # what a grammar-held output ends with (the call's "}", no <tool_call|>) is a whole call
    out = whole(forced_call_prefix(GEMMA4_TOOL_FORMAT, None) + plan)
    assert calls(out) == [("plan", NESTED_ARGS)]


# ------------------------------------------------------------------ a model folder with it


@pytest.fixture(scope="module")
def assets(tmp_path_factory, template):
    """tiny-gemma4's tokenizer (its channel and turn markers special tokens) with the real
    template: what ``ModelAssets`` makes of a Gemma 4 folder (no weights needed)."""
    from makemodel.families.gemma4 import TOKENIZER
    from pantheon.models.assets import ModelAssets

    folder = tmp_path_factory.mktemp("gemma4-assets")
    (folder / "tokenizer.json").write_text(TOKENIZER.json(), encoding="utf-8")
    cfg = TOKENIZER.config(4096)
    cfg["chat_template"] = template.source
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return ModelAssets(folder)


def test_a_gemma4_folder_reasons_calls_and_ends_at_its_turn(assets):
    assert assets.template.tool_format == GEMMA4_TOOL_FORMAT
    assert assets.reasoning and assets.tool_call_markup
    assert assets.tokenizer.token_to_id("<turn|>") in assets.eos_ids


def test_the_detokenizer_keeps_the_markers_the_parser_reads(assets):
    from pantheon.chat.detokenize import IncrementalDetokenizer

    tid = assets.tokenizer.token_to_id
    ids = [
        tid("<|channel>"),
        *assets.encode("thought\nHm."),
        tid("<channel|>"),
        *assets.encode("Hi"),
        tid("<turn|>"),
    ]
    parser = Gemma4Parser()
    detok = IncrementalDetokenizer(assets.tokenizer, keep_special=parser.keep_special)
    deltas = [d for i in ids for d in parser.feed(detok.push(i))]
    deltas += parser.feed(detok.flush()) + parser.finish()
    assert join_deltas(deltas) == {"reasoning": "Hm.", "content": "Hi", "tool_calls": []}
    plain = IncrementalDetokenizer(assets.tokenizer)  # without them the channel is lost in the text
    assert "".join(plain.push(i) for i in ids) + plain.flush() == "thought\nHm.Hi"


def test_a_response_format_starts_after_the_thought_channel_when_thinking_is_on(assets):
    from pantheon.api.generation import constraint_of
    from pantheon.api.openai.protocol import parse_chat_request
    from pantheon.control.context import fit_context

    from helpers.instances import ready_instance

    inst = ready_instance(assets, "gemma4")

    def constraint(**kwargs):
        req = parse_chat_request(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
                "chat_template_kwargs": kwargs,
            }
        )
        assert req.grammar is not None
        grammar, after, opening = constraint_of(inst, req, fit_context(assets, req, 4096))
        assert grammar == req.grammar
        return after, opening

    tid = assets.tokenizer.token_to_id
    on = constraint(enable_thinking=True)
    assert on == ([tid("<channel|>")], tid("<|channel>"))
    assert constraint(reasoning_effort="high") == on
    assert constraint() == ([], -1)


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "none"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab Z,:{}[]"\\\n\tü🌧<|>') for _ in range(rng.randrange(0, 8)))
    if kind == "int":
        return rng.randrange(-(10**12), 10**12)
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-05, 3.0e16, rng.uniform(-1e3, 1e3)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {f"k{j}_{rng.randrange(99)}": _random_value(rng, depth + 1) for j in range(rng.randrange(0, 4))}


def test_random_arguments_round_trip_through_the_template_and_stream_as_they_grow(template):
    rng = random.Random(4)
    head = template.render([{"role": "user", "content": "Go."}], add_generation_prompt=False)
    for case in range(40):
        args = {f"a{j}": _random_value(rng) for j in range(rng.randrange(1, 5))}
        text = template.render(
            [{"role": "user", "content": "Go."}, _assistant([("f", args)])], add_generation_prompt=False
        )
        model = text[len(head) :].removeprefix("<|turn>model\n")
        out, _, deltas = run(list(model))  # one character at a time
        assert calls(out) == [("f", args)], (case, model)
        assert out == whole(model)
        pieces = [d.arguments for d in deltas if d.kind == "tool_call" and d.id is None]
        assert len(pieces) > 1 or len(model) < 40, case  # streamed as it grew, not at the close


def test_a_vocabulary_with_the_quote_token_gets_it_in_the_call_grammar():
    """Gemma 4's tokenizer has ``<|"|>`` as a special token, which llguidance never matches
    against text: the grammar names the token there (and the text literal elsewhere)."""
    import llguidance as llg
    from tokenizers import AddedToken, Tokenizer

    from makemodel.families.gemma4 import TOKENIZER

    tok = Tokenizer.from_str(TOKENIZER.json())
    tok.add_special_tokens([AddedToken('<|"|>', special=True, normalized=False)])
    n, q = tok.get_vocab_size(with_added_tokens=True), tok.token_to_id('<|"|>')
    model = structured.ModelTokenizer(tok.to_str(), n, [tok.token_to_id("<turn|>")])
    prefix = forced_call_prefix(GEMMA4_TOOL_FORMAT, "get_weather")
    text_form = structured.tool_grammar(TOOLS, "get_weather", prefix, "gemma4")
    with pytest.raises(Exception, match="cannot be enforced with this model"):
        structured.check_for_model(text_form, model, "tools")
    for forced in ("get_weather", None):
        g = structured.tool_grammar(TOOLS, forced, prefix, "gemma4", token_id={'<|"|>': q}.get)
        structured.check_for_model(g, model, "tools")

    def consumes(grammar, pieces) -> bool:
        m = llg.LLMatcher(model.tokenizer, grammar, log_level=0)
        ids = [
            i for p in pieces for i in ([q] if p == '<|"|>' else tok.encode(p, add_special_tokens=False).ids)
        ]
        return m.consume_tokens(ids) and m.is_accepting()

    named = structured.tool_grammar(TOOLS, "get_weather", prefix, "gemma4", token_id={'<|"|>': q}.get)
    assert consumes(named, ["city:", '<|"|>', 'Zürich, "CH"', '<|"|>', ",unit:", '<|"|>', "f", '<|"|>', "}"])
    assert consumes(named, ["city:", '<|"|>', '<|"|>', "}"])  # an empty string
    assert not consumes(named, ["city:", '<|"|>', "Paris", '<|"|>', ",unit:", '<|"|>', "k", '<|"|>', "}"])
    assert not consumes(named, ["city:<|", '"|>Paris<|', '"|>}'])  # the marker spelled in plain tokens
