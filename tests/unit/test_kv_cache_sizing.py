"""The router's side of the quantized KV cache (issue 27), torch-free: sizing counts each type's
real bytes per token (``KvCacheTypes.token_bytes`` for the paged layers, sliding rings at full
width), a head width that is not whole blocks is refused, and admission with real numbers
(Qwen3-0.6B's shapes on a die of a fixed budget) gives a quantized cache the tokens, and so the
sequences, that its bytes buy. The last test imports torch: the worker's pool layout agrees."""

from __future__ import annotations

import pytest

from makemodel import PRESETS
from pantheon import errors
from pantheon.control.dies import DieManager, booking
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.protocol import LoadModel
from pantheon.core.sizing import estimate, shape_from_config
from pantheon.errors import ApiError

AUTO, Q8, Q4 = KvCacheTypes(), KvCacheTypes("q8_0", "q8_0"), KvCacheTypes("q4_0", "q4_0")
QWEN3_06B = shape_from_config(PRESETS["qwen3-0.6b"], "qwen3-0.6b")  # 28 layers, 8 KV heads of 128


def test_bytes_per_token_per_type_exactly():
    layers, heads, width = 28, 8, 128
    want = {
        AUTO: layers * 2 * heads * width * 2,  # bf16: 114688 B
        Q8: layers * 2 * heads * (width // 32) * 34,  # 32 int8 + an fp16 scale a block
        Q4: layers * 2 * heads * (width // 32) * 18,  # 32 nibbles + an fp16 scale a block
        KvCacheTypes("fp8_e4m3", "fp8_e4m3"): layers * 2 * heads * width,
        KvCacheTypes("q8_0", "q4_0"): layers * heads * (width // 32) * (34 + 18),
    }
    for kv, b in want.items():
        assert QWEN3_06B.kv_bytes_per_token(2, kv) == b, kv
        for path in ("bf16", "bf16-packed", "int8"):  # every bf16 path: the same cache
            assert estimate(QWEN3_06B, cpu_path=path, kv_types=kv).kv_per_token == b, (kv, path)
        assert estimate(QWEN3_06B, cpu=False, kv_types=kv).kv_per_token == b
    # auto is the path's dtype: fp32 paths keep a 4-byte cache, the quantized types do not change
    assert estimate(QWEN3_06B, cpu_path="fp32").kv_per_token == 2 * want[AUTO]
    assert estimate(QWEN3_06B, cpu_path="fp32", kv_types=Q8).kv_per_token == want[Q8]
    # no cpu_path (the worker picks): the largest of the paths it may pick, here fp32's
    assert estimate(QWEN3_06B).kv_per_token == 2 * want[AUTO]
    assert estimate(QWEN3_06B, kv_types=Q4).kv_per_token == want[Q4]
    # the tokens a bf16 budget holds: the issue's ~1.9x and ~3.6x
    assert want[AUTO] / want[Q8] == pytest.approx(1.88, abs=0.01)
    assert want[AUTO] / want[Q4] == pytest.approx(3.56, abs=0.01)


def test_sliding_rings_stay_full_width_and_are_not_per_token():
    shape = shape_from_config({**PRESETS["tiny-gemma3"], "head_dim": 32}, "gemma3")
    auto, q8 = (estimate(shape, cpu_path="bf16", kv_types=kv) for kv in (AUTO, Q8))
    assert auto.state_layer_bytes == q8.state_layer_bytes  # the rings: the compute dtype's width
    assert sum(1 for b in q8.kv_layer_bytes if b) == 1  # one global layer in the paged pool
    heads = PRESETS["tiny-gemma3"]["num_key_value_heads"]
    assert q8.kv_per_token == heads * 2 * 34 and auto.kv_per_token == heads * 2 * 32 * 2


def test_a_head_that_is_not_whole_blocks_is_refused():
    tiny = shape_from_config(PRESETS["tiny"], "tiny")  # head_dim 16
    assert tiny.kv_types_problem(AUTO) is None
    assert tiny.kv_types_problem(KvCacheTypes("fp8_e4m3", "fp8_e4m3")) is None  # no blocks
    why = tiny.kv_types_problem(KvCacheTypes("auto", "q4_0"))
    assert why and "q4_0" in why and "16" in why
    assert shape_from_config({**PRESETS["tiny"], "head_dim": 32}, "t").kv_types_problem(Q4) is None
    e = errors.kv_cache_dtype_refused("q8_0", why)
    assert (e.status, e.param, e.code) == (400, "kv_cache_dtype", "invalid")


def _admit(kv: KvCacheTypes, budget: int, context: int = 40960, floor: int = 8192) -> int:
    """Tokens of KV pool a load of Qwen3-0.6B on one CPU die of ``budget`` bytes gets, as
    ``lifecycle.start_load`` sizes it (the room after the weights, times the KV fraction), booked
    and placed by the die manager; raises its 507 when the floor does not fit."""
    dm = DieManager(cpu_dies=1, cpu_budget=budget, reserve=0, cuda_count=0)
    d = dm.get("cpu:0")
    assert d is not None
    est = estimate(QWEN3_06B, cpu_path="bf16", kv_types=kv)
    room = int((dm.free(d) - est.weights) * 0.9) // est.kv_per_token
    pool = est.kv_for(context=context, floor=floor, room_tokens=room)
    need = booking(est, ("cpu:0",), kv=pool)
    assert dm.place(lambda ds: need, ()) == ("cpu:0",)
    dm.book("m#1", need)
    assert d.kv_bytes == pool  # the die books the pool's real bytes
    return pool // est.kv_per_token


def test_admission_holds_more_sequences_under_q4_than_auto_in_the_same_budget():
    budget = 2300 << 20  # Qwen3-0.6B's 1.19 GB of bf16 weights, then ~1.05 GiB of KV at 0.9
    auto, q8, q4 = (_admit(kv, budget) for kv in (AUTO, Q8, Q4))
    assert (auto, q8, q4) == (9584, 18016, 34032)  # whole 16-token blocks
    assert q8 / auto == pytest.approx(1.88, abs=0.01) and q4 / auto == pytest.approx(3.55, abs=0.01)
    seq = 4096  # sequences of 4096 tokens the pool holds at once (the engine's admission)
    assert (auto // seq, q8 // seq, q4 // seq) == (2, 4, 8)
    # a budget whose room holds less than --admit-ctx under auto refuses the load; q4_0 admits it
    small = 1800 << 20
    with pytest.raises(ApiError) as ei:
        _admit(AUTO, small)
    assert ei.value.status == 507
    assert _admit(Q4, small) == 19408


def test_the_load_message_carries_k_and_v():
    msg = LoadModel(instance="m#1", path="/m", kv_cache_k="q8_0", kv_cache_v="q4_0")
    assert (msg.kv_cache_k, msg.kv_cache_v) == ("q8_0", "q4_0")
    plain = LoadModel(instance="m#1", path="/m")
    assert (plain.kv_cache_k, plain.kv_cache_v) == ("auto", "auto")  # today's full-width cache


def test_the_workers_pool_takes_the_bytes_the_router_books():
    """The router's figure (torch-free) and the worker's layout (``workers/cache.py``) agree per
    type, so ``kv_pool_tokens = Loaded.kv_bytes // kv_per_token`` is the pool's real size."""
    import torch

    from workers.cache import kv_block_bytes

    for kv in (AUTO, Q8, Q4, KvCacheTypes("q8_0", "q4_0")):
        for path, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            est = estimate(QWEN3_06B, cpu_path=path, kv_types=kv)
            assert kv_block_bytes(QWEN3_06B, 16, dt, kv) == 16 * est.kv_per_token, (kv, path)
