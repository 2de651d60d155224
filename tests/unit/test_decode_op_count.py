"""The ops of one decode step, counted, so that the count cannot grow back unseen (issue 28 §2).

An eager decode step on a small model costs its number of torch ops more than its arithmetic
(each dispatch is microseconds; SmolLM2-135M's int4 step is ~1,600 of them). This counts the ops
every layer of one pure decode step dispatches, on the plain fp32 CPU path (the same ops on every
host), and holds them to the count measured when the test was written: a change that adds ops
per layer must raise the bound here, on purpose, and say why in its commit.
"""

from __future__ import annotations

import collections

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine
from workers.kernels import paged
from workers.layers import decode_layer

# Ops per decode step of the ``tiny`` preset (Qwen3 shapes, 2 layers) on the fp32 path, measured
# at batch 1 and 4; 194 / 203 before the quantized KV cache and speculation merged, 197 / 206 after
# (2026-12-05), 161 / 161 once q/k were normed and rotated together (one norm, a roll), the heads
# split once and greedy rows took one batched argmax (so the batch no longer adds ops per row).
# With the paged decode kernel (workers/kernels: one call per layer for the decode rows' attention
# instead of ~13 ops) 129 / 131; without it (no C compiler, PANTHEON_ATTN_KERNEL=0) the torch path's,
# 155 / 155; 125 / 127 and 151 / 151 once the rotary tables' q/k scale was made once, not each
# step (rotary._qk_scale, for the CUDA graphs). Lower them when a change cuts ops.
MAX_OPS = {1: 125, 4: 127} if paged.available() else {1: 151, 4: 151}
# The same count for a Llama layer whose linears run our quantized kernel: the whole layer is one
# native call (workers/layers/decode_layer.py), one op a layer (its output's allocation); the
# rest are the step's own (rotary tables, embedding, final norm, head, argmax). ``tiny-llama``
# (2 layers) on the int4 path, 2026-12-05: 53 at batch 1 and 4; 52 once all the layers ran in
# one call (``decode_layer.Layers``: one allocation a step, not one a layer); 48 with the q/k scale
# made once.
MAX_FUSED_OPS = {1: 48, 4: 48}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _count_a_step(engine: Engine, batch: int) -> tuple[int, collections.Counter[str]]:
    for i in range(batch):
        engine.submit(
            f"r{batch}-{i}",
            [1, 2, 3, 4, 5 + i],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
    for _ in range(3):  # prefill, then plain decode steps
        engine.step()
    assert len(engine.scheduler.running()) == batch
    count = _Count()
    with count:
        engine.step()
    while engine.has_work():
        engine.step()
    return sum(count.ops.values()), count.ops


@pytest.fixture(scope="module")
def engine(model_factory):
    eng = Engine(str(model_factory("tiny")), cpu_path="fp32", num_slots=4, kv_budget_bytes=16 << 20)
    yield eng
    eng.close()


@pytest.mark.parametrize("batch", [1, 4])
def test_a_decode_step_dispatches_no_more_ops_than_counted(engine, batch):
    total, ops = _count_a_step(engine, batch)
    assert 0 < total <= MAX_OPS[batch], f"{total} ops (most: {ops.most_common(12)})"


@pytest.mark.skipif(not decode_layer.available(), reason="no C compiler: no fused layer")
@pytest.mark.parametrize("batch", [1, 4])
def test_a_fused_llama_step_dispatches_no_more_ops_than_counted(model_factory, batch):
    eng = Engine(str(model_factory("tiny-llama")), cpu_path="int4", num_slots=4, kv_budget_bytes=16 << 20)
    try:
        total, ops = _count_a_step(eng, batch)
    finally:
        eng.close()
    assert 0 < total <= MAX_FUSED_OPS[batch], f"{total} ops (most: {ops.most_common(12)})"
