"""Four families served end to end by one ``pantheon serve`` (one CPU die), through the official
``openai`` client:

- ``tiny-gemma3``: five sliding-window layers with a 16-token window, one global layer;
- ``tiny-gemma4``: sliding layers with a 16-token window, global layers with their own head dim
  and K as V, per-layer embeddings, the last two layers reading the KV of layers 3 and 2;
- ``tiny-gpt-oss``: a 16-token sliding layer with sinks and a full one, 8 experts top 4, the
  Harmony template;
- ``tiny-qwen3-moe``: 3 layers of 8 experts, top 2.

Random weights, so the text is noise: the checks are on token counts and finish reasons, a chat
past the window whose stream says what the whole answer says, the prefix cache (a repeated
conversation reuses its cached blocks and the sliding layers' ring checkpoint, and writes the same
seeded answer), the router's books (KV per token for the global layers that own a cache, a ring
per slot for each sliding owner, nothing for KV-shared layers, every expert's weights) and the
admin view's total and active parameters. (The Harmony output parser's reasoning and tool calls
are tested where it lives.)
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pantheon.core.sizing import read_shape

from helpers.one_model import booking, reuses_its_prefix, served, stream_past_the_window
from helpers.serve import Server

pytestmark = pytest.mark.timeout(180)

MODELS = {"g3": "tiny-gemma3", "g4": "tiny-gemma4", "oss": "tiny-gpt-oss", "moe": "tiny-qwen3-moe"}


@pytest.fixture(scope="module")
def paths(model_factory) -> dict[str, Path]:
    return {name: model_factory(preset) for name, preset in MODELS.items()}


@pytest.fixture(scope="module")
def srv(paths, tmp_path_factory):
    args = [a for name, path in paths.items() for a in ("--model", str(path), "--name", name)]
    log = tmp_path_factory.mktemp("families-logs") / "serve.log"
    yield from served([*args, "--dies", "cpu:0", "--cpu-dies", "1"], log, tuple(MODELS))


def _admin_row(srv: Server, name: str) -> dict:
    rows = httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]
    (row,) = [r for r in rows if r["name"] == name]
    return row


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_chat_past_the_window_streams_what_the_whole_answer_says(srv, name):
    stream_past_the_window(srv, name)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_repeated_conversation_reuses_its_cached_prefix(srv, name):
    reuses_its_prefix(srv, name)


def test_gemma3_context_costs_kv_on_the_global_layer_only(srv, paths):
    """The KV pool holds the global layer's K and V per token; the five sliding layers' rings are
    booked per slot with the states (slots, scratch and prefix-cache checkpoints); the advertised
    context is the model's and the pool holds it."""
    (m,) = [m for m in srv.client().models.list().data if m.id == "g3"]
    cfg = json.loads((paths["g3"] / "config.json").read_text())
    mml = (m.model_extra or {})["max_model_len"]
    assert mml == cfg["max_position_embeddings"]
    inst, booked, est = booking(srv, paths["g3"], name="g3")
    b = est.kv_per_token // (2 * 2 * 16)  # one layer's K and V (2 KV heads of 16) in the path's dtype
    assert b in (2, 4) and est.kv_per_token == 2 * 2 * 16 * b
    assert est.state_per_slot == 5 * 16 * est.kv_per_token  # five rings of 16 positions
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token >= mml
    assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0


def test_gemma4_shared_layers_are_booked_nothing(srv, paths):
    inst, booked, est = booking(srv, paths["g4"], name="g4")
    b = est.kv_per_token // (2 * 1 * 32)  # the global owner's K and V: 1 KV head of 32
    assert b in (2, 4) and est.kv_layer_bytes == (0, 0, est.kv_per_token, 0, 0, 0)
    assert est.state_layer_bytes[4:] == (0, 0)  # the KV-shared layers
    assert est.state_per_slot == 3 * 16 * (2 * 2 * 16 * b)  # three rings of 16 positions
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token
    assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0


@pytest.mark.parametrize("name", ["moe", "oss"])
def test_admin_shows_total_and_active_parameters(srv, paths, name):
    desc = read_shape(paths[name])
    inst = _admin_row(srv, name)
    assert inst["params"] == {"total": desc.total_params, "active": desc.active_params}
    assert desc.active_params < desc.total_params
    # all experts of each layer are resident: the booking holds them (bf16 or wider)
    experts = sum(s.experts.params for s in desc.layers if s.experts)
    assert experts > 0 and inst["weights_bytes"] >= 2 * experts
