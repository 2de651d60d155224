"""Gemma 4 served end to end: ``tiny-gemma4`` (sliding layers with a 16-token window, global layers
with their own head dim and K as V, per-layer embeddings, the last two layers reading the KV of
layers 3 and 2) through the official ``openai`` client, with prompts longer than the window.

Random weights, so the text is noise: the checks are on the router's books (KV per token for the
one global layer that owns a cache, a ring per slot for each sliding owner, nothing for the
KV-shared layers), a stream equal to the whole answer past the window, and the prefix cache (a
repeated conversation reuses its cached blocks and the rings' checkpoint, and writes the same
seeded answer).
"""

from __future__ import annotations

import httpx
import pytest

from pantheon.core.sizing import estimate, read_shape

from helpers.serve import Server

pytestmark = pytest.mark.timeout(180)

NAME = "g4"
LONG = [
    {
        "role": "system",
        "content": "You answer in one short sentence about the weather in the city you are asked.",
    },
    {
        "role": "user",
        "content": "What is the weather like in Paris today, and should I take an umbrella "
        "when I walk along the river to the museum this afternoon?",
    },
]


@pytest.fixture(scope="module")
def g4_path(model_factory):
    return model_factory("tiny-gemma4")


@pytest.fixture(scope="module")
def g4(g4_path, tmp_path_factory):
    s = Server(
        ["--model", str(g4_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("gemma4-logs") / "serve.log",
    )
    try:
        s.wait_ready((NAME,))
        yield s
    finally:
        s.stop()


def test_shared_layers_are_booked_nothing(g4, g4_path):
    (m,) = g4.client().models.list().data
    assert m.id == NAME
    d = {x["die"]: x for x in httpx.get(g4.url + "/admin/dies", timeout=10).json()["data"]}["cpu:0"]
    inst = d["instances"][0]
    booked = d["bookings"][inst["instance"]]
    est = estimate(read_shape(g4_path), cpu_path=inst.get("cpu_path") or "fp32")
    b = est.kv_per_token // (2 * 1 * 32)  # the global owner's K and V: 1 KV head of 32
    assert b in (2, 4) and est.kv_layer_bytes == (0, 0, est.kv_per_token, 0, 0, 0)
    assert est.state_layer_bytes[4:] == (0, 0)  # the KV-shared layers
    assert est.state_per_slot == 3 * 16 * (2 * 2 * 16 * b)  # three rings of 16 positions
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token
    assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0


def test_a_chat_past_the_window_streams_what_the_whole_answer_says(g4):
    c = g4.client()
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


def test_a_repeated_conversation_reuses_its_cached_prefix(g4):
    c = g4.client()
    kw = dict(model=NAME, messages=LONG, max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    first = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    again = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 16
    assert again.choices[0].message.content == first.choices[0].message.content
