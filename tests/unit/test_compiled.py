"""The opt-in compiled decode step (workers/compiled.py): the same tokens as eager, batch 1 and
a batch of unequal lengths, and a compile that fails leaves the engine eager and says why."""

from __future__ import annotations

import torch

from pantheon.core.protocol import SamplingParams
from workers import compiled
from workers.engine import Engine


def _run(eng: Engine, prompts: list[list[int]], n: int = 8) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token)
    return out


def test_compiled_decode_gives_the_eager_tokens(model_factory):
    path = str(model_factory("tiny-llama", dtype="float32", num_hidden_layers=2))
    fast = Engine(path, kv_budget_bytes=1 << 20, cpu_path="fp32", compile_decode=True)
    assert fast.compiled, fast.compile_error
    eager = Engine(path, kv_budget_bytes=1 << 20, cpu_path="fp32")
    assert not eager.compiled
    batch = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3] * 20]  # unequal lengths: a padding bias
    assert _run(fast, batch) == _run(eager, batch)
    assert _run(fast, [[4, 5, 6]]) == _run(eager, [[4, 5, 6]])  # batch 1: its own graph
    # every decode step ran the graphs built at load: none would have needed a new compile
    # (which a serving step must never wait for; it would run eager and count here)
    assert fast.runner.compiled.fallbacks == 0


def test_a_failed_compile_stays_eager(model_factory, monkeypatch):
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("InductorError: no C++ compiler found")

        return call

    monkeypatch.setattr(compiled.torch, "compile", broken)
    monkeypatch.setenv("PANTHEON_COMPILE", "1")
    eng = Engine(str(model_factory("tiny")), kv_budget_bytes=1 << 20)
    assert not eng.compiled and "no C++ compiler" in eng.compile_error
    assert len(_run(eng, [[1, 2, 3]], 4)["r0"]) == 4
    assert torch.compile is not None
