"""``EngineSpec`` (``pantheon/core/engine_spec.py``): each default said once, the load message is
one, and the engine's in-process shorthand checks its fields as the wire does."""

from __future__ import annotations

import pytest

from pantheon.config.table import DEFAULTS
from pantheon.core import engine_spec
from pantheon.core.engine_spec import EngineSpec
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.protocol import LoadModel, decode_router_msg, encode
from workers.engine import Engine
from workers.errors import LoadError
from workers.step_budget import StepBudget


def test_defaults():
    s = EngineSpec(path="/m")
    assert (s.num_slots, s.prefill_chunk, s.step_target_s) == (8, 512, 0.5)
    assert (s.kv_budget_bytes, s.block_size) == (256 << 20, 16)
    assert (s.dtype, s.devices, s.max_model_len, s.quantize) == ("auto", [], None, False)
    assert (s.state_checkpoints, s.speculative, s.draft) == (None, 0, None)
    assert (s.cpu_path, s.compile_decode, s.cuda_graphs, s.prefix_cache) == (None, None, None, True)
    assert s.kv_types == KvCacheTypes()


def test_the_router_settings_and_the_step_budget_take_the_same_defaults():
    assert DEFAULTS["slots"] == engine_spec.SLOTS
    assert DEFAULTS["prefill_chunk"] == engine_spec.PREFILL_CHUNK
    assert DEFAULTS["step_target"] == engine_spec.STEP_TARGET_S
    b = StepBudget()
    assert (b.target_s, b.ceiling) == (engine_spec.STEP_TARGET_S, engine_spec.PREFILL_CHUNK)


def test_the_load_message_is_the_spec_on_the_wire():
    msg = LoadModel(instance="m#1", path="/m", num_slots=4, kv_cache_k="q8_0", draft="mtp")
    assert isinstance(msg, EngineSpec) and msg.kv_types == KvCacheTypes("q8_0", "auto")
    back = decode_router_msg(encode(msg))
    assert back == msg and isinstance(back, LoadModel)
    assert {f for f in EngineSpec.__struct_fields__} | {"instance"} == set(LoadModel.__struct_fields__)


def test_shorthand_refuses_what_a_spec_would(tmp_path, tiny_model):
    with pytest.raises(LoadError, match="not an engine spec field: num_slot"):
        Engine(str(tmp_path), num_slot=4)
    with pytest.raises(LoadError, match=r"Expected `int`, got `str` - at `\$.num_slots`"):
        Engine(str(tmp_path), num_slots="4")
    with pytest.raises(LoadError, match="unknown KV cache type 'q9'"):
        Engine(EngineSpec(path=str(tiny_model), kv_cache_k="q9"))
