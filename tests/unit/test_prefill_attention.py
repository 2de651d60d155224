"""A prefill chunk after cached history: the two-part attention (history unmasked, chunk causal,
merged by log-sum-exp in fp32) and the one masked call, each against one SDPA call over the whole
gather in fp32 (the reference), in fp32 and in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.layers import attention as A

SHAPES = [(16, 48, 9, 3), (33, 200, 4, 4), (1, 7, 8, 2), (64, 1000, 9, 3)]
needs_split = pytest.mark.skipif(not A._SPLIT_OK["cpu"], reason="no fused CPU SDPA kernel with log-sum-exp")


def _case(chunk: int, hist: int, heads: int, kv: int, dtype: torch.dtype):
    """A sequence's K/V scattered in a paged cache, a chunk's queries and the fp32 reference."""
    torch.manual_seed(0)
    d, t = 64, hist + chunk
    k_cache = torch.randn(t + 20, kv, d).to(dtype)
    v_cache = torch.randn(t + 20, kv, d).to(dtype)
    rows = torch.randperm(t + 20)[:t]  # the sequence's cache rows, scattered like paged blocks
    q = (torch.randn(chunk, heads, d) * d**-0.5 * 3).to(dtype)  # * 3: peaked, like a real model's
    mask = A.offset_causal_mask(hist, chunk, q.device)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),
        k_cache[rows].float().transpose(0, 1).unsqueeze(0),
        v_cache[rows].float().transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
        scale=1.0,
    )[0].transpose(0, 1)
    return q, k_cache, v_cache, rows, mask, ref


def test_the_offset_mask_is_causal_after_the_history() -> None:
    m = A.offset_causal_mask(2, 3, torch.device("cpu"))[0, 0]
    assert m.tolist() == [[True, True, True, False, False]] + [
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


@needs_split
@pytest.mark.parametrize(("chunk", "hist", "heads", "kv"), SHAPES)
def test_split_matches_the_reference_in_fp32(chunk: int, hist: int, heads: int, kv: int) -> None:
    q, k_cache, v_cache, rows, _mask, ref = _case(chunk, hist, heads, kv, torch.float32)
    got = A._prefill_split(q, k_cache[rows[hist:]], v_cache[rows[hist:]], rows[:hist], k_cache, v_cache)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_split
@pytest.mark.parametrize(("chunk", "hist", "heads", "kv"), SHAPES)
def test_split_in_bf16_is_rounded_once(chunk: int, hist: int, heads: int, kv: int) -> None:
    """bf16 inputs: the result is the fp32 reference rounded to bf16 (its halves merged in fp32),
    at least as close to it as the one masked bf16 call that the uncached path's kernel uses."""
    q, k_cache, v_cache, rows, mask, ref = _case(chunk, hist, heads, kv, torch.bfloat16)
    got = A._prefill_split(q, k_cache[rows[hist:]], v_cache[rows[hist:]], rows[:hist], k_cache, v_cache)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.to(torch.bfloat16).float(), atol=1e-2, rtol=8e-3)
    one_call = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_cache[rows].transpose(0, 1).unsqueeze(0),
        v_cache[rows].transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
        scale=1.0,
    )[0].transpose(0, 1)
    err_split = (got.float() - ref).abs().max()
    err_one = (one_call.float() - ref).abs().max()
    assert err_split <= err_one * 1.05 + 1e-6, (err_split, err_one)


def _batch(q: torch.Tensor, rows: torch.Tensor, hist: int) -> A.StepBatch:
    n, h, d = q.shape
    empty = torch.zeros(n, h, d)
    chunk = A.PrefillChunk(0, n, rows, None, fresh=hist == 0)
    return A.StepBatch(empty, empty, rows[hist:], 0, None, None, [chunk])


@pytest.mark.parametrize("split", [True, False], ids=["split", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_of_a_chunk_after_history(
    split: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``paged_attention`` (the chunk's K/V written into the cache first), on both paths:
    the two-part one where the CPU kernel has it, the masked call (built once, kept on the chunk)."""
    if split and not A._SPLIT_OK["cpu"]:
        pytest.skip("no fused CPU SDPA kernel with log-sum-exp")
    monkeypatch.setitem(A._SPLIT_OK, "cpu", split)
    chunk, hist = 40, 300
    q, k_cache, v_cache, rows, _mask, ref = _case(chunk, hist, 9, 3, dtype)
    k_new, v_new = k_cache[rows[hist:]].clone(), v_cache[rows[hist:]].clone()
    k_cache[rows[hist:]] = 0  # the chunk's rows hold nothing until paged_attention writes them
    v_cache[rows[hist:]] = 0
    b = _batch(q, rows, hist)
    got = A.paged_attention(q, k_new, v_new, b, k_cache, v_cache)
    assert (b.prefills[0].mask is None) == split  # the split path needs no mask
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), ref, **tol)
