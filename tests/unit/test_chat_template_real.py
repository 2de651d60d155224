"""Every real chat template in llama.cpp's ``models/templates`` renders a conversation with tools,
tool calls and tool results exactly as transformers' ``apply_chat_template`` does (issue 39 §3).

Pantheon is given the conversation the way an OpenAI client sends it (``content: null`` beside the
calls, ``arguments`` as JSON text, 9-alphanumeric call ids as Mistral's templates demand), that
request as the server's protocol layer reads it (``parse_chat_request``), and the conversation the
way transformers documents it (``arguments`` as the objects the templates read, ``content: ""``);
all three must render what transformers renders from the last (with ``arguments`` as the client's
text for the one template that takes text). Where transformers refuses a
conversation (``raise_exception``, a template's own bug), Pantheon refuses it too, with a
``TemplateError`` (the HTTP layer's 400), never anything else (a 500).

The templates are read from the vendored llama.cpp tree at test time, never copied here. Today's
date is pinned (``frozen_today``) for the templates that write it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from pantheon.api.openai.protocol import parse_chat_request
from pantheon.chat.template import ChatTemplate, TemplateError

from helpers.chat_template import frozen_today, hf_render, llama_cpp_templates

TODAY = datetime(2031, 3, 5, 12, 0, 0)

# Two tools with nested parameters (an object inside an object, an array of objects).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a place <b>&</b> — 天气",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "object",
                        "description": "where",
                        "properties": {
                            "city": {"type": "string"},
                            "country": {"type": "string", "enum": ["CH", "FR"]},
                        },
                        "required": ["city"],
                    },
                    "days": {"type": "integer", "minimum": 1},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_rooms",
            "description": "Book hotel rooms",
            "parameters": {
                "type": "object",
                "properties": {
                    "rooms": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"beds": {"type": "integer"}, "view": {"type": "boolean"}},
                        },
                    },
                    "note": {"type": "string"},
                },
                "required": ["rooms"],
            },
        },
    },
]

WEATHER = ("get_weather", {"location": {"city": "Zürich", "country": "CH"}, "days": 2})
BOOKING = ("book_rooms", {"rooms": [{"beds": 2, "view": True}], "note": 'late "arrival"'})
PARIS = ("get_weather", {"location": {"city": "Paris"}})

# Call ids of 9 alphanumerics: Mistral's templates refuse any other (OpenAI's "call_..." ids).
IDS = ("a1B2c3D4e", "f5G6h7I8j", "k9L0m1N2o")


@dataclass(frozen=True)
class Shapes:
    """One conversation as an OpenAI client sends it (``openai``) and as transformers documents it
    (``hf``, arguments as objects; ``hf_text``: as text, for a template that concatenates them)."""

    openai: list[dict]
    hf: list[dict]
    hf_text: list[dict]


def _turns(*turns) -> Shapes:
    """``turns``: messages, where a tuple ``(content, [(name, args), ...], [ids], reasoning?)`` is
    an assistant turn with tool calls."""

    def build(openai: bool, text_args: bool) -> list[dict]:
        out = []
        for turn in turns:
            if not isinstance(turn, tuple):
                out.append(copy.deepcopy(turn))
                continue
            content, calls, ids, *reasoning = turn
            out.append(
                {
                    "role": "assistant",
                    **({"reasoning_content": reasoning[0]} if reasoning else {}),
                    "content": content if content or not openai else None,
                    "tool_calls": [
                        {
                            "id": i,
                            "type": "function",
                            "function": {
                                "name": name,
                                "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))
                                if openai or text_args
                                else args,
                            },
                        }
                        for (name, args), i in zip(calls, ids, strict=True)
                    ],
                }
            )
        return out

    return Shapes(build(True, True), build(False, False), build(False, True))


SYSTEM = {"role": "system", "content": "You are a travel agent. Be brief."}
USER = {"role": "user", "content": "Weather in Zürich, and book me a room?"}
ANSWER = {"role": "assistant", "content": "It is 21 °C in Zürich; your room is booked."}
AGAIN = {"role": "user", "content": "Thanks! And Paris?"}


def _result(i: int, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": IDS[i], "name": name, "content": content}


CONVERSATIONS = {
    # one call, its result, the answer, a new question
    "one_call": _turns(
        SYSTEM, USER, ("", [WEATHER], IDS[:1]), _result(0, "get_weather", '{"temp": 21}'), ANSWER, AGAIN
    ),
    # two calls in one turn (with text beside them), both results, the answer, a new question
    "two_calls": _turns(
        SYSTEM,
        USER,
        ("Checking both.", [WEATHER, BOOKING], IDS[:2]),
        _result(0, "get_weather", '{"temp": 21}'),
        _result(1, "book_rooms", "booked"),
        ANSWER,
        AGAIN,
    ),
    # both of the above in one conversation
    "one_then_two": _turns(
        SYSTEM,
        USER,
        ("", [WEATHER], IDS[:1]),
        _result(0, "get_weather", '{"temp": 21}'),
        ("", [BOOKING, PARIS], IDS[1:3]),
        _result(1, "book_rooms", "booked"),
        _result(2, "get_weather", "sunny"),
        ANSWER,
        AGAIN,
    ),
    # a reasoning model's history: its reasoning beside a call and beside an answer
    "reasoning": _turns(
        SYSTEM,
        USER,
        ("", [WEATHER], IDS[:1], "The user wants the weather: call the tool."),
        _result(0, "get_weather", '{"temp": 21}'),
        {**ANSWER, "reasoning_content": "21 degrees: say it."},
        AGAIN,
    ),
    # the usual shape of a request after a call: its result, and the model to answer
    "after_result": _turns(SYSTEM, USER, ("", [WEATHER], IDS[:1]), _result(0, "get_weather", "21 C")),
}

# Shapes some templates refuse ("Conversation roles must alternate", ...): the outcome must be
# transformers' (the same text, or an error that is a 400).
ODD_SHAPES = {
    "user_twice": _turns({"role": "user", "content": "a"}, {"role": "user", "content": "b"}),
    "assistant_first": _turns({"role": "assistant", "content": "hi"}, {"role": "user", "content": "b"}),
    "user_after_result": _turns(USER, ("", [WEATHER], IDS[:1]), _result(0, "get_weather", "21 C"), AGAIN),
    "openai_call_ids": Shapes(
        *(
            [
                {**m, "tool_calls": [{**c, "id": "call_" + c["id"]} for c in m["tool_calls"]]}
                if "tool_calls" in m
                else ({**m, "tool_call_id": "call_" + m["tool_call_id"]} if m["role"] == "tool" else m)
                for m in shape
            ]
            for shape in (
                CONVERSATIONS["one_call"].openai,
                CONVERSATIONS["one_call"].hf,
                CONVERSATIONS["one_call"].hf_text,
            )
        )
    ),
    "system_only": _turns(SYSTEM),
}

# The families issue 39 names, with their real special tokens (bos None: the tokenizer has none),
# and the conversations each must render (not refuse): so that a comparison of two refusals
# cannot hide a conversation built wrong. The others refuse for the reason given.
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "unsloth-mistral-Devstral-Small-2507": ("<s>", "</s>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("<s>", "</s>"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "HuggingFaceTB-SmolLM3-3B": (None, "<|im_end|>"),
    "meetkai-functionary-medium-v3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "meetkai-functionary-medium-v3.2": ("<|begin_of_text|>", "<|eot_id|>"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen-QwQ-32B": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "Qwen3-Coder": (None, "<|im_end|>"),
    "Qwen3.5-4B": (None, "<|im_end|>"),
    "openai-gpt-oss-120b": ("<|startoftext|>", "<|return|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "google-gemma-4-31B-it": ("<bos>", "<eos>"),
    "google-gemma-4-31B-it-interleaved": ("<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "CohereForAI-c4ai-command-r-plus-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
}

# What transformers refuses of CONVERSATIONS, per template (every other pair renders).
REFUSED = {
    # "This model only supports single tool-calls at once!"
    **{
        f"meta-llama-Llama-3.{v}": {"two_calls", "one_then_two"}
        for v in ("1-8B-Instruct", "2-3B-Instruct", "3-70B-Instruct")
    },
    # "System role not supported"
    "google-gemma-2-2b-it": set(CONVERSATIONS),
    # the template reads ``additionalProperties`` of every parameter, which these tools lack
    "CohereForAI-c4ai-command-r-plus-tool_use": set(CONVERSATIONS),
}

# Templates that take a call's arguments as JSON text (they concatenate it).
TEXT_ARGUMENTS = {"meetkai-functionary-medium-v3.2"}


@pytest.fixture(scope="module")
def folder() -> Path:
    return llama_cpp_templates()


_CACHE: dict[str, tuple[str, ChatTemplate]] = {}


def _load(folder: Path, name: str) -> tuple[str, ChatTemplate]:
    """The template's source and Pantheon's ChatTemplate of it, once per module run."""
    if name not in _CACHE:
        src = (folder / f"{name}.jinja").read_text(encoding="utf-8")
        bos, eos = FAMILIES.get(name, ("<s>", "</s>"))
        _CACHE[name] = (src, ChatTemplate(src, bos_token=bos, eos_token=eos, name=name))
    return _CACHE[name]


def _outcome(render) -> tuple[str, str]:
    try:
        return "text", render()
    except TemplateError as e:
        return "refused", e.message
    except Exception as e:  # noqa: BLE001 - transformers' side: whatever the template raised
        return "refused", f"{type(e).__name__}: {e}"


def _compare(folder: Path, name: str, shapes: Shapes, **kw) -> tuple[str, str]:
    """transformers' outcome for ``shapes``; asserts Pantheon's equals it from both shapes."""
    src, ours = _load(folder, name)
    bos, eos = FAMILIES.get(name, ("<s>", "</s>"))
    theirs = shapes.hf_text if name in TEXT_ARGUMENTS else shapes.hf
    with frozen_today(TODAY):
        # the conversation as the template's tool format adapts it for every render (Mistral's
        # call ids renamed to the 9 letters and digits its templates demand), for both
        adapted = ours.tool_syntax.adapt(list(theirs), TOOLS, {})[0]
        want = _outcome(lambda: hf_render(src, adapted, tools=TOOLS, bos=bos, eos=eos, **kw))
        # what the server renders: the request's messages and tools as its protocol layer reads them
        served = parse_chat_request({"model": "m", "messages": shapes.openai, "tools": TOOLS})
        for given, msgs, tools in (
            ("openai", shapes.openai, TOOLS),
            ("hf", theirs, TOOLS),
            ("served", served.messages, served.tools),
        ):
            try:
                got = ours.render(msgs, tools=tools, **kw)
            except TemplateError:
                assert want[0] == "refused", f"{name}: Pantheon refuses what transformers renders ({given})"
                continue
            # anything but a TemplateError (a 500) fails the test here, unexpected
            assert want == ("text", got), f"{name}: Pantheon renders otherwise than transformers ({given})"
    return want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_renders_tools_calls_and_results_as_transformers(folder, name):
    for conv, shapes in CONVERSATIONS.items():
        kind, text = _compare(folder, name, shapes)
        expected = "refused" if conv in REFUSED.get(name, ()) else "text"
        assert kind == expected, f"{name} on {conv}: transformers {kind}: {text[:200]}"
    # and without the generation prompt
    _compare(folder, name, CONVERSATIONS["one_call"], add_generation_prompt=False)


def test_every_template_matches_transformers_on_every_shape(folder):
    """All of llama.cpp's templates (not only the families above) on the tool conversations, and
    on the shapes some refuse."""
    names = sorted(p.name.removesuffix(".jinja") for p in folder.glob("*.jinja"))
    assert set(FAMILIES) <= set(names), sorted(set(FAMILIES) - set(names))
    rendered = 0
    for name in names:
        # the families' tool conversations are their own test's
        shapes = (*(CONVERSATIONS.values() if name not in FAMILIES else ()), *ODD_SHAPES.values())
        rendered += sum(_compare(folder, name, s)[0] == "text" for s in shapes)
    others = len(set(names) - set(FAMILIES))
    assert rendered > others * len(CONVERSATIONS)  # most templates render most conversations


def test_the_shapes_templates_refuse_are_refused_as_transformers_does(folder):
    """A few refusals named: the error is the template's own message, a TemplateError (a 400)."""
    cases = [
        ("mistralai-Mistral-Nemo-Instruct-2407", "user_twice", "roles must alternate"),
        ("mistralai-Mistral-Nemo-Instruct-2407", "user_after_result", "roles must alternate"),
        ("meta-llama-Llama-3.3-70B-Instruct", "system_only", "no first user message"),
    ]
    for name, shape, message in cases:
        kind, text = _compare(folder, name, ODD_SHAPES[shape])
        assert kind == "refused" and message in text, (name, shape, text)
    # OpenAI's call ids, which Nemo's template refuses, are renamed to 9 letters and digits
    kind, text = _compare(folder, "mistralai-Mistral-Nemo-Instruct-2407", ODD_SHAPES["openai_call_ids"])
    assert kind == "text" and '"id": "' in text, text
    with pytest.raises(TemplateError, match="single tool-calls"):
        _load(folder, "meta-llama-Llama-3.1-8B-Instruct")[1].render(CONVERSATIONS["two_calls"].openai)


def test_dates_are_pinned_in_both(folder):
    """Llama 3.2 writes today's date (``strftime_now``), Llama 3.1 a fixed one unless given
    ``date_string``: the same in Pantheon and transformers either way."""
    assert (
        "Today Date: 05 Mar 2031"
        in _compare(folder, "meta-llama-Llama-3.2-3B-Instruct", CONVERSATIONS["one_call"])[1]
    )
    kind, text = _compare(
        folder, "meta-llama-Llama-3.1-8B-Instruct", CONVERSATIONS["one_call"], date_string="01 Jan 2030"
    )
    assert "Today Date: 01 Jan 2030" in text


def test_functionary_v32_takes_arguments_as_text(folder):
    """Its template concatenates ``arguments``: they stay JSON text there (and objects a client
    sent are written as JSON text), where every other template gets objects."""
    _, v32 = _load(folder, "meetkai-functionary-medium-v3.2")
    _, v31 = _load(folder, "meetkai-functionary-medium-v3.1")
    assert not v32.object_arguments and v31.object_arguments
    text = v32.render(CONVERSATIONS["one_call"].hf, tools=TOOLS)  # objects given: written as JSON
    assert '>>>get_weather\n{"location": {"city": "Zürich", "country": "CH"}, "days": 2}' in text
    text = v32.render(CONVERSATIONS["one_call"].openai, tools=TOOLS)  # text given: kept as sent
    assert '>>>get_weather\n{"location":{"city":"Zürich","country":"CH"},"days":2}' in text


def test_a_template_that_recurses_forever_is_a_400_not_a_hang(folder):
    """Hermes 2/3 Pro's ``json_to_python_type`` recurses without end on a union type
    (``["string", "null"]``: it iterates the string "null"): transformers dies of a RecursionError,
    Pantheon ends it at its nesting bound, a TemplateError (a 400)."""
    union = copy.deepcopy(TOOLS[1])
    union["function"]["parameters"]["properties"]["note"]["type"] = ["string", "null"]
    msgs = CONVERSATIONS["one_call"].openai
    for name in (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    ):
        src, ours = _load(folder, name)
        with pytest.raises(RecursionError):
            hf_render(src, CONVERSATIONS["one_call"].hf, tools=[union])
        with pytest.raises(TemplateError, match="nesting"):
            ours.render(msgs, tools=[union])
