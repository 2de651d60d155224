"""The cache specs answer for themselves (``pantheon/core/description.py``): each kind's bytes per
token and per slot, exactly, the KV types it can hold, the cache it makes (``workers/cache.py``)
and what that cache answers (its bytes, its pool, its step view, its state copies)."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.description import (
    AttentionCache,
    FullAttention,
    LayerSpec,
    ModelDescription,
    RecurrentState,
    RopeConfig,
    SharedKV,
    SlidingWindow,
    StateTensor,
)
from pantheon.core.kv_types import KvCacheTypes
from workers.cache import KVCache, RingCache, SharedCache, StateCache, kv_block_bytes, make_caches
from workers.kernels.kv_quant import QuantRows
from workers.layers.attention import StepBatch

FULL = FullAttention(kv_heads=2, head_dim=64)
SLIDING = SlidingWindow(kv_heads=2, head_dim=64, window=8)
RECURRENT = RecurrentState(
    (StateTensor("conv", (3, 96), "model"), StateTensor("state", (2, 16, 16), "float32"))
)
SHARED = SharedKV(layer=0)
Q8 = KvCacheTypes("q8_0", "q8_0")


def test_bytes_per_token_and_per_slot_of_each_kind():
    # full: K and V of 2 heads x 64 values a token, nothing per slot
    assert FULL.bytes_per_token(2) == 2 * 2 * 64 * 2 == 512
    assert FULL.bytes_per_token(4) == 1024
    assert FULL.bytes_per_slot(2) == 0
    # ... stored as q8_0: 34 bytes per 32 values (llama.cpp's block), K and V
    assert FULL.bytes_per_token(2, Q8) == 2 * 2 * (64 // 32) * 34 == 272
    assert FULL.bytes_per_token(2, KvCacheTypes("q8_0", "q4_0")) == 2 * 2 * 34 + 2 * 2 * 18 == 208
    # sliding: nothing paged; a ring of its window's K and V per slot, always full width
    assert SLIDING.bytes_per_token(2) == SLIDING.bytes_per_token(2, Q8) == 0
    assert SLIDING.bytes_per_slot(2) == 8 * 512 == 4096
    assert SLIDING.bytes_per_slot(4) == 8 * 1024
    # recurrent: its tensors per slot, the fp32 one at 4 bytes whatever the model's dtype
    assert RECURRENT.bytes_per_token(2) == 0
    assert RECURRENT.bytes_per_slot(2) == 3 * 96 * 2 + 2 * 16 * 16 * 4 == 2624
    assert RECURRENT.bytes_per_slot(4) == 3 * 96 * 4 + 2 * 16 * 16 * 4 == 3200
    # shared: the owner's bytes, counted there
    assert SHARED.bytes_per_token(2) == SHARED.bytes_per_token(2, Q8) == SHARED.bytes_per_slot(2) == 0


def test_kinds_say_what_they_keep():
    kinds = (FULL, SLIDING, RECURRENT, SHARED)
    assert [s.paged for s in kinds] == [True, False, False, False]
    assert [s.slot_state for s in kinds] == [False, True, True, False]
    assert [s.owns_kv for s in kinds] == [True, True, False, False]
    assert [s.sliding_window for s in kinds] == [None, 8, None, None]
    # the families' spelling builds the kind its window says
    assert AttentionCache(2, 64) == FULL and AttentionCache(2, 64, 8) == SLIDING


def test_only_paged_rows_refuse_a_kv_type_their_heads_cannot_hold():
    narrow = FullAttention(2, 16)  # not a whole q8_0 block of 32 values
    assert "blocks of 32 values" in (narrow.kv_types_problem(Q8) or "")
    assert narrow.kv_types_problem(KvCacheTypes()) is None and FULL.kv_types_problem(Q8) is None
    assert SlidingWindow(2, 16, 8).kv_types_problem(Q8) is None  # a ring stays full width
    assert RECURRENT.kv_types_problem(Q8) is None and SHARED.kv_types_problem(Q8) is None


def _desc(*caches) -> ModelDescription:
    layers = tuple(LayerSpec("attention", ((64, 64),), 0, c) for c in caches)
    return ModelDescription(
        family="llama", arch="llama", vocab_size=32, hidden_size=64, intermediate_size=128,
        num_layers=len(layers), num_heads=2, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope=RopeConfig(), tie_word_embeddings=True,
        torch_dtype="float32", bos_token_id=None, eos_token_ids=(0,), layers=layers,
    )  # fmt: skip


DESC = _desc(FULL, SLIDING, RECURRENT, SharedKV(0), SharedKV(1))


def test_description_sums_its_specs():
    assert DESC.kv_bytes_per_token(2) == 512 and DESC.kv_bytes_per_token(2, Q8) == 272
    assert DESC.state_bytes_per_slot(2) == 4096 + 2624
    assert DESC.attention_layers == [0, 1] and DESC.recurrent_layers == [2]
    assert DESC.slot_state_layers == [1, 2] and DESC.windows == [8]
    assert kv_block_bytes(DESC, 16, torch.bfloat16) == 16 * 512
    assert kv_block_bytes(DESC, 16, torch.bfloat16, Q8) == 16 * 272


def test_each_kind_makes_its_cache():
    cpu = torch.device("cpu")
    full, ring, state, on_full, on_ring = make_caches(DESC, [cpu] * 5, 32, 3, torch.bfloat16, checkpoints=2)
    assert isinstance(full, KVCache) and full.k.shape == (32, 2, 64) and full.k.dtype == torch.bfloat16
    assert isinstance(ring, RingCache) and ring.window == 8
    assert ring.tensors["k"].shape == (4, 8, 2, 64) and ring.checkpoints["v"].shape == (2, 8, 2, 64)
    assert isinstance(state, StateCache) and not isinstance(state, RingCache)
    assert state.tensors["conv"].shape == (4, 3, 96) and state.tensors["conv"].dtype == torch.bfloat16
    assert state.tensors["state"].dtype == torch.float32 and state.checkpoints["state"].shape == (
        2,
        2,
        16,
        16,
    )
    assert isinstance(on_full, SharedCache) and on_full.source is full and on_ring.source is ring
    # bytes: the pool's are KV, the states' (slots + scratch + checkpoints) are state, a reader's none
    assert full.kv_nbytes == 32 * 512 and full.state_nbytes == 0
    assert ring.kv_nbytes == 0 and ring.state_nbytes == (4 + 2) * 4096
    assert state.state_nbytes == (4 + 2) * 2624
    assert on_full.kv_nbytes == on_full.state_nbytes == on_ring.nbytes == 0
    # the pool the fused decode call and the graphs write: a paged layer's own only
    assert full.pool is full and [c.pool for c in (ring, state, on_full)] == [None, None, None]
    assert [list(c.slot_states()) for c in (full, ring, state, on_full)] == [
        [],
        ["k", "v"],
        ["conv", "state"],
        [],
    ]


def test_quantized_pool_takes_the_bytes_the_spec_says():
    cpu = torch.device("cpu")
    full, ring, *_ = make_caches(DESC, [cpu] * 5, 32, 3, torch.bfloat16, kv_types=Q8)
    assert isinstance(full.k, QuantRows) and full.kv_nbytes == 32 * FULL.bytes_per_token(2, Q8)
    assert ring.tensors["k"].dtype == torch.bfloat16  # rings stay at the compute dtype


def test_views_and_state_copies():
    cpu = torch.device("cpu")
    full, ring, state, _on_full, on_ring = make_caches(DESC, [cpu] * 5, 32, 3, torch.float32, checkpoints=2)
    z = torch.zeros(1)
    window = StepBatch(z, z, z.long(), 0, None, None, [])
    b = StepBatch(z, z, z.long(), 0, None, None, [], windows={8: window})
    assert full.view(b) is b and state.view(b) is b
    assert ring.view(b) is window and on_ring.view(b) is window  # a reader sees its owner's window
    # a slot's state into a checkpoint and back, for rings and recurrent states alike
    for c in (ring, state):
        for t in c.tensors.values():
            t[1].fill_(7.0)
        c.save_state(1, 0)
        for t in c.tensors.values():
            t[1].zero_()
        c.load_state(1, 0)
        assert all(bool((t[1] == 7.0).all()) for t in c.tensors.values())
    full.save_state(1, 0)  # nothing per slot: nothing to do
    with pytest.raises(TypeError, match="no K/V"):
        state.attend(z, z, z, b)
