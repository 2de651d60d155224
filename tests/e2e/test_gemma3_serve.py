"""Gemma 3 served end to end: ``tiny-gemma3`` (five sliding-window layers with a 16-token window,
one global layer) through the official ``openai`` client, with prompts longer than the window.

Random weights, so the text is noise: the checks are on structure, token counts and finish
reasons, a stream equal to the whole answer, the advertised context and the router's books (KV per
token for the global layer, a ring per slot for each sliding one), and the prefix cache (a repeated
conversation reuses its cached blocks and the sliding layers' ring checkpoint, and writes the same
seeded answer).
"""

from __future__ import annotations

import json

import httpx
import pytest

from pantheon.core.sizing import estimate, read_shape

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


def test_the_context_costs_kv_on_the_global_layer_only(g3, g3_path):
    """The KV pool holds the global layer's K and V per token; the five sliding layers' rings are
    booked per slot with the states (slots, scratch and prefix-cache checkpoints); the advertised
    context is the model's and the pool holds it."""
    (m,) = g3.client().models.list().data
    cfg = json.loads((g3_path / "config.json").read_text())
    mml = (m.model_extra or {})["max_model_len"]
    assert m.id == NAME and mml == cfg["max_position_embeddings"]
    d = {x["die"]: x for x in httpx.get(g3.url + "/admin/dies", timeout=10).json()["data"]}["cpu:0"]
    inst = d["instances"][0]
    booked = d["bookings"][inst["instance"]]
    est = estimate(read_shape(g3_path), cpu_path=inst.get("cpu_path") or "fp32")
    b = est.kv_per_token // (2 * 2 * 16)  # one layer's K and V (2 KV heads of 16) in the path's dtype
    assert b in (2, 4) and est.kv_per_token == 2 * 2 * 16 * b
    assert est.state_per_slot == 5 * 16 * est.kv_per_token  # five rings of 16 positions
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token >= mml
    assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0


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
