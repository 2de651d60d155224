"""Layers split across several dies: exercised on CPU with two 'cpu' devices in the list."""

from pantheon.protocol import SamplingParams
from workers.engine import Engine


def test_split_placement_gives_the_same_tokens(model_factory):
    path = str(model_factory("tiny-llama", dtype="float32", num_hidden_layers=3))
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
