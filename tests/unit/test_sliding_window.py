"""Sliding-window attention's bookkeeping, exactly: the step's window views
(``workers/layers/sliding.py``: which cache rows each query reads, which it masks) and the
descriptions that declare windows (Gemma 3's layer schedule and RoPE pair, Mistral's window on
the Llama family), with no model run."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.archs.gemma3 import FULL, SLIDING, Gemma3Description
from pantheon.core.description import AttentionCache, ModelError, RopeConfig, describe
from pantheon.core.sizing import estimate
from workers.layers.attention import PrefillChunk, StepBatch
from workers.layers.sliding import ring_attention, window_view
from workers.models.gemma3 import checkpoint_name

# ---------------------------------------------------------------- the window views


def _batch(n_decode: int, chunks: list[tuple[int, int]]) -> StepBatch:
    """A step of ``n_decode`` decode rows then prefill chunks of (p0, p1) positions (the paged
    gathers are not the view's concern: left empty)."""
    pre, start = [], n_decode
    for p0, p1 in chunks:
        pre.append(
            PrefillChunk(start, start + p1 - p0, torch.zeros(0, dtype=torch.long), None, fresh=p0 == 0)
        )
        start += p1 - p0
    z = torch.zeros(start, 3, 4)
    gather = torch.zeros(n_decode, 1, dtype=torch.long) if n_decode else None
    return StepBatch(z, z, torch.arange(start), n_decode, gather, None, pre)


def _read(v: StepBatch, i: int, window: int) -> list[tuple[int, int]]:
    """(slot, position mod window) of each ring row decode row ``i`` reads (less padding)."""
    assert v.decode_gather is not None
    keep = (
        [True] * v.decode_gather.shape[1] if v.decode_bias is None else (v.decode_bias[i, 0, 0] == 0).tolist()
    )
    return [divmod(int(r), window) for r, k in zip(v.decode_gather[i], keep) if k]


def test_decode_rows_read_their_last_window_positions_in_their_ring():
    dec = [(0, 3), (1, 5), (2, 6), (3, 9), (4, 1)]  # (slot, length): the last min(length, 5)
    v = window_view(_batch(5, []), 5, dec, [])
    assert v.slot_mapping.tolist() == [0 * 5 + 2, 1 * 5 + 4, 2 * 5 + 0, 3 * 5 + 3, 4 * 5 + 0]
    assert v.decode_gather is not None and v.decode_gather.shape == (5, 5)
    assert v.decode_bias is not None and v.decode_bias.shape == (5, 1, 1, 5)
    got = [_read(v, i, 5) for i in range(5)]
    assert got == [
        [(0, 0), (0, 1), (0, 2)],
        [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4)],
        [(2, 1), (2, 2), (2, 3), (2, 4), (2, 0)],  # positions 1..5: 5 wrapped to row 0
        [(3, 4), (3, 0), (3, 1), (3, 2), (3, 3)],  # positions 4..8
        [(4, 0)],
    ]


def test_decode_rows_all_past_the_window_need_no_bias():
    v = window_view(_batch(2, []), 4, [(1, 7), (0, 12)], [])
    assert v.decode_bias is None
    assert [_read(v, i, 4) for i in range(2)] == [
        [(1, 3), (1, 0), (1, 1), (1, 2)],
        [(0, 0), (0, 1), (0, 2), (0, 3)],
    ]


def _band(p0: int, p1: int, k0: int, w: int) -> torch.Tensor:
    """The expected mask: query q sees key k iff q - w < k <= q."""
    return torch.tensor([[q - w < k <= q for k in range(k0, p1)] for q in range(p0, p1)])


@pytest.mark.parametrize(
    "p0, p1, window, first_key, plain_causal",
    [
        (0, 4, 8, 0, True),  # a first chunk inside the window: the plain causal case
        (0, 8, 8, 0, True),  # exactly the window: still plain causal
        (0, 12, 8, 0, False),  # longer than the window: banded, no history
        (5, 9, 8, 0, False),  # a later chunk: its first query still sees position 0
        (10, 14, 4, 7, False),  # a later chunk past the window: history from p0 - window + 1
        (20, 21, 1, 20, False),  # a window of one: each query sees itself only
        (30, 50, 8, 23, False),  # a chunk longer than the window after history
    ],
)
def test_prefill_chunks_read_their_ring_history_with_a_band(p0, p1, window, first_key, plain_causal):
    slot = 2
    v = window_view(_batch(0, [(p0, p1)]), window, [], [(slot, p0, p1)])
    (c,) = v.prefills
    assert c.windowed and (c.start, c.end) == (0, p1 - p0)
    assert c.gather.tolist() == [slot * window + p % window for p in range(first_key, p0)]  # history only
    assert v.slot_mapping.tolist() == [slot * window + p % window for p in range(p0, p1)]
    if plain_causal:
        assert c.mask is None
    else:
        assert c.mask is not None
        assert torch.equal(c.mask[0, 0], _band(p0, p1, first_key, window))  # history then chunk


def test_a_mixed_step_keeps_rows_slots_and_order():
    b = _batch(1, [(0, 3), (9, 12)])
    b.decode_slots, b.decode_slot_run = torch.tensor([2]), 2
    cos = torch.ones(7, 3, 4)
    v = window_view(b, 4, [(2, 6)], [(0, 0, 3), (1, 9, 12)], (cos, -cos))
    assert v.rot_cos is cos and torch.equal(v.rot_sin, -cos)  # the sliding layers' own tables
    assert v.n_decode == 1 and v.decode_slot_run == 2 and v.decode_slots is b.decode_slots
    assert v.slot_mapping.tolist() == [8 + 1, 0, 1, 2, 4 + 1, 4 + 2, 4 + 3]
    assert [(c.start, c.end) for c in v.prefills] == [(1, 4), (4, 7)]
    assert _read(v, 0, 4) == [(2, 2), (2, 3), (2, 0), (2, 1)]
    assert v.prefills[0].mask is None and v.prefills[1].gather.tolist() == [4 + 2, 4 + 3, 4 + 0]
    assert window_view(b, 4, [(2, 6)], [(0, 0, 3), (1, 9, 12)]).rot_cos is b.rot_cos  # default: the step's


def test_ring_attention_equals_full_attention_with_the_band():
    """Two sequences decoding and one prefilling past the window, through the ring step by step,
    against a dense banded softmax over all positions."""
    torch.manual_seed(0)
    w, h, kv, d, slots = 5, 4, 2, 8, 3
    ring_k, ring_v = torch.zeros(slots + 1, w, kv, d), torch.zeros(slots + 1, w, kv, d)
    total = 23
    q, k, v = torch.randn(total, h, d), torch.randn(total, kv, d), torch.randn(total, kv, d)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(h // kv, dim=1))
    pos = torch.arange(total)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w)
    want = torch.einsum(
        "hqk,khd->qhd",
        scores.masked_fill(~band, float("-inf")).softmax(-1),
        v.repeat_interleave(h // kv, dim=1),
    )
    got = torch.empty_like(want)
    # slot 1: a prefill of 7 (past the window), one of 9 (longer than it), then decode rows
    for p0, p1 in ((0, 7), (7, 16), (16, 17), (17, 18), (18, 23)):
        if p1 - p0 == 1:
            view = window_view(_batch(1, []), w, [(1, p1)], [])
        else:
            view = window_view(_batch(0, [(p0, p1)]), w, [], [(1, p0, p1)])
        got[p0:p1] = ring_attention(q[p0:p1], k[p0:p1], v[p0:p1], view, ring_k, ring_v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (ring_k[0] == 0).all() and (ring_k[2] == 0).all()  # other slots' rings untouched


# ---------------------------------------------------------------- the descriptions

GEMMA3_TEXT = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=4032,
    sliding_window=16,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=24,
)


def test_gemma3_schedule_windows_and_ropes():
    d = describe(GEMMA3_TEXT, {}, "c")
    assert isinstance(d, Gemma3Description) and d.family == "gemma3"
    assert d.layer_types == (SLIDING,) * 5 + (FULL,) + (SLIDING,) * 2  # sliding_window_pattern 6
    assert [s.cache for s in d.layers][4:6] == [AttentionCache(2, 16, 16), AttentionCache(2, 16)]
    assert d.windows == [16] and d.attention_layers == list(range(8))
    assert d.rope == RopeConfig(theta=1e6) and d.sliding_rope == RopeConfig(theta=1e4)
    assert d.attention_scale == 24**-0.5 and d.tie_word_embeddings
    # the paged pool keeps the global layer's K and V per token; a sliding layer keeps a ring of
    # its window per slot, counted with the states
    assert d.kv_bytes_per_token(2) == 1 * 2 * 2 * 16 * 2
    assert d.state_bytes_per_slot(2) == 7 * 16 * (2 * 2 * 16 * 2) and d.slot_state_layers == [
        0,
        1,
        2,
        3,
        4,
        6,
        7,
    ]
    pattern = describe({**GEMMA3_TEXT, "sliding_window_pattern": 2}, {}, "c")
    assert isinstance(pattern, Gemma3Description)
    assert pattern.layer_types == (SLIDING, FULL) * 4


def test_gemma3_rope_parameters_by_layer_type():
    """transformers 5's spelling: one RoPE per layer type, the global one with its scaling."""
    raw = {k: v for k, v in GEMMA3_TEXT.items() if not k.startswith("rope")}
    raw["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    d = describe(raw, {}, "c")
    assert d.rope == RopeConfig(theta=1e6, type="linear", scaling={"factor": 8.0})
    assert d.sliding_rope == RopeConfig(theta=1e4)


def test_gemma3_multimodal_config_takes_the_text_defaults():
    """The Hub's Gemma3ForConditionalGeneration configs write only what differs from transformers'
    defaults in their text_config (gemma-3-4b-it's names no head counts)."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152},
    }
    d = describe(raw, {}, "c")
    assert isinstance(d, Gemma3Description)
    assert (d.num_heads, d.num_kv_heads, d.head_dim, d.vocab_size) == (8, 4, 256, 262208)
    assert d.eos_token_ids == (1, 106) and d.sliding_window == 1024 and d.attention_scale == 256**-0.5
    assert d.rope.type == "linear" and d.rope.theta == 1e6 and d.sliding_rope == RopeConfig(theta=1e4)
    assert d.layer_types.count(FULL) == 5 and d.skipped == ("the vision tower and its projector",)


@pytest.mark.parametrize(
    "change, kind, words",
    [
        (dict(attn_logit_softcapping=50.0), "unsupported", "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "unsupported", "bidirectional"),
        (dict(hidden_activation="silu"), "unsupported", "gelu_pytorch_tanh"),
        (dict(layer_types=["sliding_attention"] * 3), "invalid", "layer_types"),
        (dict(sliding_window=0), "invalid", "sliding_window"),
        (dict(final_logit_softcapping=-1), "invalid", "final_logit_softcapping"),
    ],
)
def test_gemma3_configs_refused_say_why(change, kind, words):
    with pytest.raises(ModelError) as e:
        describe({**GEMMA3_TEXT, **change}, {}, "c.json")
    assert e.value.kind == kind and words in e.value.reason and "c.json" in e.value.reason


def test_gemma3_multimodal_checkpoint_names():
    assert checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert checkpoint_name("language_model.model.norm.weight") == "model.norm.weight"
    assert checkpoint_name("language_model.lm_head.weight") == "lm_head.weight"
    for skipped in ("model.vision_tower.x.weight", "multi_modal_projector.mm_input_projection_weight"):
        assert checkpoint_name(skipped) is None
    assert checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


MISTRAL = dict(
    architectures=["MistralForCausalLM"],
    model_type="mistral",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4032,
    max_position_embeddings=32768,
)


def test_mistral_window_slides_every_layer():
    d = describe({**MISTRAL, "sliding_window": 4096}, {}, "c")
    assert d.family == "llama" and d.windows == [4096]
    assert all(s.cache == AttentionCache(2, 16, 4096) for s in d.layers)
    # no window (Mistral 7B v0.2 on), or one as long as the context: full attention
    assert describe({**MISTRAL, "sliding_window": None}, {}, "c").windows == []
    assert describe({**MISTRAL, "sliding_window": 32768}, {}, "c").windows == []


def test_qwen2_window_slides_from_max_window_layers():
    raw = {**MISTRAL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 4}
    d = describe({**raw, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1}, {}, "c")
    assert [s.cache.sliding_window for s in d.layers] == [
        None,
        4096,
        4096,
        4096,
    ]
    types = ["sliding_attention", "full_attention"] * 2
    d = describe({**raw, "sliding_window": 64, "use_sliding_window": True, "layer_types": types}, {}, "c")
    assert d.slot_state_layers == [0, 2]
    assert describe({**raw, "sliding_window": 4096, "use_sliding_window": False}, {}, "c").windows == []
    with pytest.raises(ModelError) as e:
        describe({**raw, "sliding_window": 64, "use_sliding_window": True, "layer_types": types[:3]}, {}, "c")
    assert e.value.kind == "invalid" and "layer_types" in e.value.reason


def test_sizing_books_the_rings_per_slot_and_the_global_layers_per_token():
    """A Gemma 3 context costs KV per token only on its global layers: the router's booking (and
    with it the context a KV budget holds) counts each sliding layer as a ring per slot."""
    est = estimate(describe(GEMMA3_TEXT, {}, "c"), cpu_path="fp32")
    assert est.kv_per_token == 1 * 2 * 2 * 16 * 4
    assert est.state_per_slot == 7 * 16 * 2 * 2 * 16 * 4
    llama_like = estimate(describe({**GEMMA3_TEXT, "layer_types": [FULL] * 8}, {}, "c"), cpu_path="fp32")
    assert llama_like.kv_per_token == 8 * est.kv_per_token and llama_like.state_per_slot == 0
    mistral = estimate(describe({**MISTRAL, "sliding_window": 4096}, {}, "c"), cpu_path="fp32")
    assert mistral.kv_per_token == 0 and mistral.state_per_slot == 2 * 4096 * 2 * 2 * 16 * 4
