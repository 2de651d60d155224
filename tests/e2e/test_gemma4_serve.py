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

import pytest

from helpers.one_model import booking, reuses_its_prefix, served, stream_past_the_window

pytestmark = pytest.mark.timeout(180)

NAME = "g4"


@pytest.fixture(scope="module")
def g4_path(model_factory):
    return model_factory("tiny-gemma4")


@pytest.fixture(scope="module")
def g4(g4_path, tmp_path_factory):
    args = ["--model", str(g4_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"]
    yield from served(args, tmp_path_factory.mktemp("gemma4-logs") / "serve.log", (NAME,))


def test_shared_layers_are_booked_nothing(g4, g4_path):
    (m,) = g4.client().models.list().data
    assert m.id == NAME
    inst, booked, est = booking(g4, g4_path)
    b = est.kv_per_token // (2 * 1 * 32)  # the global owner's K and V: 1 KV head of 32
    assert b in (2, 4) and est.kv_layer_bytes == (0, 0, est.kv_per_token, 0, 0, 0)
    assert est.state_layer_bytes[4:] == (0, 0)  # the KV-shared layers
    assert est.state_per_slot == 3 * 16 * (2 * 2 * 16 * b)  # three rings of 16 positions
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token
    assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0


def test_a_chat_past_the_window_streams_what_the_whole_answer_says(g4):
    stream_past_the_window(g4, NAME)


def test_a_repeated_conversation_reuses_its_cached_prefix(g4):
    reuses_its_prefix(g4, NAME)
