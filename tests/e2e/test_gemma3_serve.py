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

import pytest

from helpers.one_model import booking, reuses_its_prefix, served, stream_past_the_window

pytestmark = pytest.mark.timeout(180)

NAME = "g3"


@pytest.fixture(scope="module")
def g3_path(model_factory):
    return model_factory("tiny-gemma3")


@pytest.fixture(scope="module")
def g3(g3_path, tmp_path_factory):
    args = ["--model", str(g3_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"]
    yield from served(args, tmp_path_factory.mktemp("gemma3-logs") / "serve.log", (NAME,))


def test_the_context_costs_kv_on_the_global_layer_only(g3, g3_path):
    """The KV pool holds the global layer's K and V per token; the five sliding layers' rings are
    booked per slot with the states (slots, scratch and prefix-cache checkpoints); the advertised
    context is the model's and the pool holds it."""
    (m,) = g3.client().models.list().data
    cfg = json.loads((g3_path / "config.json").read_text())
    mml = (m.model_extra or {})["max_model_len"]
    assert m.id == NAME and mml == cfg["max_position_embeddings"]
    inst, booked, est = booking(g3, g3_path)
    b = est.kv_per_token // (2 * 2 * 16)  # one layer's K and V (2 KV heads of 16) in the path's dtype
    assert b in (2, 4) and est.kv_per_token == 2 * 2 * 16 * b
    assert est.state_per_slot == 5 * 16 * est.kv_per_token  # five rings of 16 positions
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token >= mml
    assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0


def test_a_chat_past_the_window_streams_what_the_whole_answer_says(g3):
    stream_past_the_window(g3, NAME)


def test_a_repeated_conversation_reuses_its_cached_prefix(g3):
    reuses_its_prefix(g3, NAME)
