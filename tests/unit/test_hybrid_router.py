"""The router's side of hybrid models (recurrent state per slot beside the paged KV cache): the
state pools booked and shown apart from the KV pool, ``Loaded``/``InstanceStats`` from older
workers, a media part refused naming the model, a named tool call opened in the model's own
format, and the dashboard's die line."""

from __future__ import annotations

import msgspec
import pytest

from pantheon.api.openai.protocol import parse_chat_request
from pantheon.control.dies import DieManager, booked_of, booking
from pantheon.core import protocol as p
from pantheon.core.sizing import Estimate
from pantheon.errors import ApiError
from pantheon.snapshot import DieState

# two recurrent layers (a state each) and two attention layers (K and V per token)
HYBRID = Estimate(
    base=4 << 20,
    layer_bytes=(2 << 20,) * 4,
    kv_layer_bytes=(0, 0, 0, 256),
    state_layer_bytes=(1000, 1000, 1000, 0),
    context_limit=4096,
)


def test_booking_splits_the_state_pools_from_the_kv_pool():
    one = booking(HYBRID, ("cpu:0",), kv=8 << 20, state=9 * HYBRID.state_per_slot)
    assert one == {"cpu:0": (12 << 20, 8 << 20, 27000)}
    # as est.split books them together: the cache bytes are KV and state
    assert HYBRID.split(("cpu:0",), kv=8 << 20, state=27000)["cpu:0"][1] == (8 << 20) + 27000
    # over two dies: the first holds layers 0-1 (state only), the second 2-3 (state and KV)
    two = booking(HYBRID, ("cpu:0", "cpu:1"), weights=1000, kv=4096, state=300)
    assert two == {"cpu:0": (two["cpu:0"][0], 0, 200), "cpu:1": (two["cpu:1"][0], 4096, 100)}
    assert two["cpu:0"][0] + two["cpu:1"][0] == 1000
    # a model without recurrent layers books no state
    plain = Estimate(
        base=10, layer_bytes=(5, 5), kv_layer_bytes=(8, 8), state_layer_bytes=(0, 0), context_limit=64
    )
    assert booking(plain, ("cpu:0",), kv=1024) == {"cpu:0": (20, 1024, 0)}


def test_booked_of_takes_the_workers_figures_and_an_old_workers_loaded():
    new = p.Loaded(
        instance="q#1",
        weight_bytes=5000,
        kv_bytes=4096,
        max_model_len=4096,
        num_slots=8,
        vocab_size=100,
        eos_token_ids=[1],
        state_bytes=27000,
    )
    assert booked_of(HYBRID, ("cpu:0",), new) == {"cpu:0": (5000, 4096, 27000)}
    # a worker that predates the field: its Loaded decodes, with no state
    old = {k: v for k, v in msgspec.to_builtins(new).items() if k != "state_bytes"}
    got = p.decode_worker_msg(msgspec.msgpack.encode(old))
    assert isinstance(got, p.Loaded) and got.state_bytes == 0
    assert booked_of(HYBRID, ("cpu:0",), got) == {"cpu:0": (5000, 4096, 0)}
    stats = msgspec.to_builtins(
        p.Stats(
            free_bytes=1,
            total_bytes=2,
            instances=[
                p.InstanceStats(
                    instance="q#1",
                    slots=[],
                    waiting=0,
                    kv_blocks_total=2,
                    kv_blocks_used=0,
                    weight_bytes=1,
                    kv_bytes=1,
                )
            ],
        )
    )
    del stats["instances"][0]["state_bytes"]
    decoded = p.decode_worker_msg(msgspec.msgpack.encode(stats))
    assert isinstance(decoded, p.Stats) and decoded.instances[0].state_bytes == 0


def test_dies_count_the_state_in_use_and_in_placement():
    dm = DieManager(cpu_dies=1, cpu_budget=64 << 20, reserve=0, cuda_count=0)
    d = dm.get("cpu:0")
    assert d is not None
    dm.book("a#1", {"cpu:0": (10 << 20, 4 << 20)})  # (w, kv) still books, with no state
    dm.book("q#1", {"cpu:0": (20 << 20, 8 << 20, 2 << 20)})
    assert (d.weights_bytes, d.kv_bytes, d.state_bytes) == (30 << 20, 12 << 20, 2 << 20)
    assert d.used_bytes == 44 << 20 and dm.free(d) == 20 << 20
    assert dm.bookings()["cpu:0"]["a#1"] == (10 << 20, 4 << 20, 0)
    # 12 MiB of weights and 4 of KV fit the 20 free; 6 MiB of state more do not, and the 507 says so
    assert dm.place(lambda ds: {ds[0]: (12 << 20, 4 << 20, 4 << 20)}, ("cpu:0",)) == ("cpu:0",)
    with pytest.raises(ApiError) as ei:
        dm.place(lambda ds: {ds[0]: (12 << 20, 4 << 20, 6 << 20)}, ("cpu:0",))
    assert ei.value.status == 507 and "recurrent state 6.0 MiB" in ei.value.message
    with pytest.raises(ApiError) as ei:
        dm.place(lambda ds: {ds[0]: (12 << 20, 4 << 20, 6 << 20)})
    assert ei.value.status == 507 and "recurrent state 6.0 MiB" in ei.value.message
    dm.release("q#1")
    assert d.state_bytes == 0


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_a_media_part_is_a_400_naming_the_model(part):
    body = {
        "model": "qwen3.5",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}],
    }
    with pytest.raises(ApiError) as ei:
        parse_chat_request(body)
    e = ei.value
    assert e.status == 400 and e.param == "messages[0].content[1].type"
    assert "model 'qwen3.5' serves text only" in e.message and repr(part["type"]) in e.message
    body.pop("model")  # no model named: the message still says why
    with pytest.raises(ApiError) as ei:
        parse_chat_request(body)
    assert "text only" in ei.value.message


def test_a_named_call_opens_in_the_models_own_format(model_factory, tiny_model):
    from pantheon.chat.tools import JSON_TOOL_FORMAT, XML_TOOL_FORMAT, forced_call_prefix
    from pantheon.control.context import fit_context
    from pantheon.models.assets import ModelAssets

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = parse_chat_request(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    for path, fmt in ((model_factory("tiny-qwen3.5"), XML_TOOL_FORMAT), (tiny_model, JSON_TOOL_FORMAT)):
        assets = ModelAssets(path)
        assert assets.template.tool_format == fmt
        prep = fit_context(assets, req, 4096)
        assert prep.prefix == forced_call_prefix(fmt, "f") and prep.forced == "f"
        assert prep.prompt_ids[-len(assets.encode(prep.prefix)) :] == assets.encode(prep.prefix)


def _die(**kw) -> DieState:
    base = dict(
        id="cpu:0",
        device_name="cpu",
        total_bytes=8 << 30,
        budget_bytes=8 << 30,
        weights_bytes=1 << 30,
        kv_bytes=1 << 30,
        free_bytes=6 << 30,
    )
    return DieState(**(base | kw))


def test_the_die_line_shows_the_state_beside_the_kv_cache():
    from tui.format import split_bar, split_parts
    from tui.widgets.dies import STATE, die_line

    hybrid = _die(state_bytes=512 << 20, free_bytes=(6 << 30) - (512 << 20))
    line = die_line(hybrid, 160).plain
    assert "w 1.0G kv 1.0G state 512M free 5.5G" in line and STATE in line
    assert "2.5G/8.0G" in line  # used: weights, KV and state
    plain = die_line(_die(), 160).plain
    assert "state" not in plain and STATE not in plain
    # the bar's cells: each part at least one, the total exact, split_bar the two-part case
    assert split_parts((1000, 10, 1), 0, 10) == [8, 1, 1, 0]
    assert split_parts((1, 1, 1), 1, 8) == [2, 2, 2, 2]
    for w, k, f, width in ((1, 1, 2, 8), (1000, 1, 0, 10), (5, 5, 0, 9), (3, 0, 1, 0)):
        assert tuple(split_parts((w, k), f, width)) == split_bar(w, k, f, width)
