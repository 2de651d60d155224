"""Decode attention that reads the paged pool by whole blocks (``decode_attention`` with the
step's block tables) against the gather of every row it replaced, and engines under quantized
KV caches: greedy tokens as under the full-width cache, and a request's tokens the same alone
and batched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.layers import attention as A

from helpers.decode_rows import PROMPTS, decode_batch, greedy_tokens


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


@pytest.fixture(scope="module")
def wide(model_factory):
    """The tiny Qwen3 preset with 32-value heads: one quantization block per head row."""
    return model_factory("tiny", dtype="float32", head_dim=32)


def test_greedy_under_q8_0_is_greedy_under_auto(wide):
    assert greedy_tokens(wide, PROMPTS[:1], ("q8_0", "q8_0")) == greedy_tokens(
        wide, PROMPTS[:1], ("auto", "auto")
    )


@pytest.mark.parametrize("kinds", [("auto", "auto"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")])
def test_batched_is_alone_under_each_type(wide, kinds):
    together = greedy_tokens(wide, PROMPTS, kinds)
    assert together == [greedy_tokens(wide, [p], kinds)[0] for p in PROMPTS]
