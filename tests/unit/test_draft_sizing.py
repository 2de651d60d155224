"""A load with a draft model books the draft too (pantheon/control/load_sizing.py): its weights on
the first die, its KV pool (the model's block count) inside the KV budget, sized by both models'
bytes per token; and the wire and config carry the option."""

from __future__ import annotations

import pytest

from makemodel import PRESETS
from pantheon.config.file import _model_table
from pantheon.config.settings import ConfigError, build_config
from pantheon.control.dies import DieManager
from pantheon.control.load_sizing import LoadSizing
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.protocol import PROTOCOL_VERSION, LoadModel, decode_router_msg, encode
from pantheon.core.sizing import shape_from_config

TARGET = shape_from_config(PRESETS["qwen3-0.6b"], "qwen3-0.6b")
DRAFT = shape_from_config({**PRESETS["qwen3-0.6b"], "num_hidden_layers": 4}, "draft")


def _sizing(draft, budget: int = 6000 << 20, mml: int = 40960) -> LoadSizing:
    s = LoadSizing(
        shape=TARGET,
        config=build_config({}, {}),
        dies=DieManager(cpu_dies=1, cpu_budget=budget, reserve=0, cuda_count=0),
        quantize=False,
        mml=mml,
        floor=2048,
        n_slots=4,
        checkpoints=0,
        cpu_works={},
        kv_types=KvCacheTypes(),
    )
    s.draft = draft
    return s


def test_the_draft_is_booked_with_the_instance():
    alone, both = _sizing(None), _sizing(DRAFT)
    a, b = alone.estimate("cpu:0"), both.estimate("cpu:0")
    d = _sizing(None)
    d.shape = DRAFT
    dest = d.estimate("cpu:0")
    assert b.weights == a.weights + dest.weights
    assert b.kv_per_token == a.kv_per_token + dest.kv_per_token  # the draft's rows beside the model's
    # the same die gives the load fewer tokens of pool (both pools' rows, less room after weights)
    (wa, kva, _), (wb, kvb, _) = alone.need(("cpu:0",))["cpu:0"], both.need(("cpu:0",))["cpu:0"]
    assert wb == wa + dest.weights
    tokens_a, tokens_b = kva // a.kv_per_token, kvb // b.kv_per_token
    assert tokens_b < tokens_a
    # the worker shares kv_bytes between the two pools by block size: as many blocks in each
    assert both.kv_bytes(("cpu:0",)) == kvb and kvb % (16 * b.kv_per_token) == 0
    # a roomy die: the full context for both
    roomy = _sizing(DRAFT, budget=64 << 30, mml=4096)
    assert roomy.kv_bytes(("cpu:0",)) == 4096 * b.kv_per_token


def test_the_load_message_and_config_carry_the_draft():
    assert PROTOCOL_VERSION >= 6  # 6 added the draft
    assert LoadModel(instance="m#1", path="/m").draft is None
    back = decode_router_msg(encode(LoadModel(instance="m#1", path="/m", draft="/d")))
    assert isinstance(back, LoadModel) and back.draft == "/d"
    assert _model_table("t", {"path": "/m", "draft": "/d"})["draft"] == "/d"
    for bad in (3, "", True, ["/d"]):
        with pytest.raises(ConfigError, match="'draft' must be a model path"):
            _model_table("t", {"path": "/m", "draft": bad})
    (m,) = build_config({"models": [{"path": "/m", "draft": "/d"}]}, {}).models
    assert m.draft == "/d"


def test_the_models_own_head_books_its_layer_only():
    """``draft = "mtp"``: the head's one layer, its fc and norms and its K/V rows are booked; its
    embeddings and LM head are the model's (not booked again). A model without one is refused."""
    from pantheon.control.lifecycle import _read_draft
    from pantheon.core.description import mtp_description
    from pantheon.errors import ApiError

    target = shape_from_config(PRESETS["qwen3.5-0.8b"], "qwen3.5-0.8b")
    head = _read_draft("mtp", target)
    assert head == mtp_description(target) and head.num_layers == 1
    s = _sizing(None)
    s.shape = target
    alone = s.estimate("cpu:0")
    s.draft, s.draft_is_head = head, True
    both = s.estimate("cpu:0")
    h = target.hidden_size
    (spec,) = head.layers
    assert spec.linears[-1] == (h, 2 * h)  # the fc beside the layer's own linears
    full = next(x for x in target.layers if x.kind == "attention")
    added = both.weights - alone.weights
    # (no CPU path named: the booking is the largest the worker may pick, fp32 dense), and the
    # 4-bit copy of the LM head it picks drafts with: half a byte a weight, a scale and a minimum
    # (2 bytes each) a group of 32
    v = target.vocab_size
    head_copy = v * h // 2 + v * (h // 32) * 2 * 2
    assert added == (sum(n * k for n, k in spec.linears) + spec.small) * 4 + head_copy
    assert added == (sum(n * k for n, k in full.linears) + full.small + 2 * h * h + 2 * h) * 4 + head_copy
    assert both.kv_per_token == alone.kv_per_token + head.kv_bytes_per_token(4)
    with pytest.raises(ApiError, match="no multi-token-prediction head"):
        _read_draft("mtp", TARGET)
