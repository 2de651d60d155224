"""Gemma 3 served end to end: ``tiny-gemma3`` (five sliding-window layers with a 16-token window,
one global layer) through the official ``openai`` client, with prompts longer than the window.

Random weights, so the text is noise: the checks are on structure, token counts and finish
reasons, a stream equal to the whole answer, the advertised context, and the prefix cache (a
repeated conversation reuses its cached blocks, sliding layers' included, and writes the same
seeded answer).
"""

from __future__ import annotations

import json

import pytest

from helpers.serve import Server

pytestmark = pytest.mark.timeout(180)

NAME = "g3"
# ~60 tokens of user text: with the template's markers, well past the 16-token window
LONG = [
    {
        "role": "system",
        "content": "You answer in one short sentence about the weather in the city you are asked about.",
    },
    {
        "role": "user",
        "content": "What is the weather like in Paris today, and should I take an umbrella "
        "when I walk along the river to the museum this afternoon?",
    },
]


@pytest.fixture(scope="module")
def g3_path(model_factory):
    return model_factory("tiny-gemma3")


@pytest.fixture(scope="module")
def g3(g3_path, tmp_path_factory):
    s = Server(
        ["--model", str(g3_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("gemma3-logs") / "serve.log",
    )
    try:
        s.wait_ready((NAME,))
        yield s
    finally:
        s.stop()


def test_models_advertises_the_model_context(g3, g3_path):
    (m,) = g3.client().models.list().data
    cfg = json.loads((g3_path / "config.json").read_text())
    assert m.id == NAME and (m.model_extra or {})["max_model_len"] == cfg["max_position_embeddings"]


def test_a_chat_past_the_window_streams_what_the_whole_answer_says(g3):
    c = g3.client()
    kw = dict(model=NAME, messages=LONG, max_tokens=10, seed=3, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    ch = whole.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    assert whole.usage.prompt_tokens > 3 * 16  # the window is passed in prefill and decode
    chunks = list(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})  # pyright: ignore[reportCallIssue, reportArgumentType]
    )
    content = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    finishes = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
    assert finishes == ["length"] and content == (ch.message.content or "")
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_repeated_conversation_reuses_its_cached_prefix(g3):
    c = g3.client()
    kw = dict(model=NAME, messages=LONG, max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    first = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    again = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 16
    assert again.choices[0].message.content == first.choices[0].message.content
