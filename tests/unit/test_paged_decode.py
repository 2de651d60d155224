"""Decode attention that reads the paged pool by whole blocks (``decode_attention`` with the
step's block tables) against the gather of every row it replaced, and engines under quantized
KV caches: greedy tokens as under the full-width cache, and a request's tokens the same alone
and batched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.protocol import SamplingParams
from workers.engine import Engine
from workers.layers import attention as A

from helpers.decode_rows import decode_batch


@pytest.mark.parametrize("group_rows", [16, 64, 2048])  # many groups per row .. one group
@pytest.mark.parametrize("lens", [[37], [200, 5, 129], [64, 64]])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_block_wise_decode_equals_the_row_gather(monkeypatch, group_rows, lens, with_sinks):
    monkeypatch.setattr(A, "DECODE_ROWS", group_rows)
    h, kv, d, bs = 6, 2, 32, 16
    b, rows = decode_batch(lens, bs, kernel=False)
    torch.manual_seed(3)
    kc, vc = torch.randn(rows, kv, d), torch.randn(rows, kv, d)
    q = torch.randn(len(lens), h, d) * 0.3
    sinks = torch.randn(h) if with_sinks else None
    got = A.decode_attention(q, b, kc, vc, sinks)
    want = A.decode_attention(q, dataclasses.replace(b, decode_blocks=None), kc, vc, sinks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_block_wise_decode_in_bf16_stays_close(monkeypatch):
    monkeypatch.setattr(A, "DECODE_ROWS", 64)
    b, rows = decode_batch([300, 70], 16, kernel=False)
    torch.manual_seed(4)
    kc, vc = torch.randn(rows, 3, 64, dtype=torch.bfloat16), torch.randn(rows, 3, 64, dtype=torch.bfloat16)
    q = torch.randn(2, 9, 64, dtype=torch.bfloat16) * 0.2
    got = A.decode_attention(q, b, kc, vc).float()
    want = A.decode_attention(q.float(), dataclasses.replace(b, decode_blocks=None), kc.float(), vc.float())
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(300, 420))]


def _greedy(path, kinds: tuple[str, str], prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    e = Engine(str(path), dtype="float32", kv_budget_bytes=4 << 20, kv_types=KvCacheTypes(*kinds))
    for i, p in enumerate(prompts):
        e.submit(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while e.has_work():
        for o in e.step():
            out.setdefault(o.request_id, []).append(o.token)
    return [out[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def wide(model_factory):
    """The tiny Qwen3 preset with 32-value heads: one quantization block per head row."""
    return model_factory("tiny", dtype="float32", head_dim=32)


def test_greedy_under_q8_0_is_greedy_under_auto(wide):
    assert _greedy(wide, ("q8_0", "q8_0"), PROMPTS[:1]) == _greedy(wide, ("auto", "auto"), PROMPTS[:1])


@pytest.mark.parametrize("kinds", [("auto", "auto"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")])
def test_batched_is_alone_under_each_type(wide, kinds):
    together = _greedy(wide, kinds, PROMPTS)
    assert together == [_greedy(wide, kinds, [p])[0] for p in PROMPTS]
