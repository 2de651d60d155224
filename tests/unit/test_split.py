"""Layers split across several dies: exercised on CPU with two 'cpu' devices in the list."""

import pytest

from pantheon.core.protocol import SamplingParams
from workers.cache import StateCache
from workers.engine import Engine


@pytest.mark.parametrize("preset,layers", [("tiny-llama", 3), ("tiny-qwen3.5-text", 4), ("tiny-gemma3", 6)])
def test_split_placement_gives_the_same_tokens(model_factory, preset, layers):
    """The Qwen3.5 hybrid too: each recurrent layer's state pool lives on its layer's die."""
    path = str(model_factory(preset, dtype="float32", num_hidden_layers=layers))
    one = Engine(path, devices=["cpu"], dtype="float32", kv_budget_bytes=2 << 20)
    two = Engine(path, devices=["cpu", "cpu"], dtype="float32", kv_budget_bytes=2 << 20)
    outs = []
    for eng in (one, two):
        eng.submit(
            "r", [4, 8, 15, 16, 23, 42], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        toks = []
        while eng.has_work():
            toks += [o.token for o in eng.step()]
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0]) == 8
    caches = two.runner.caches
    assert len(caches) == layers and (preset == "tiny-llama") != any(
        isinstance(c, StateCache) for c in caches
    )
