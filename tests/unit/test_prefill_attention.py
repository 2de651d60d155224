"""Prefill attention after cached history: by pages (the full pages before a row unmasked, its
own page causal, merged by log-sum-exp in fp32) and the one masked call, each against one SDPA
call over the whole gather in fp32 (the reference), in fp32 and in bf16; and by pages, a row's
result whatever its chunk (cached prefix == uncached)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.layers import attention as A

SHAPES = [(16, 48, 9, 3), (33, 200, 4, 4), (1, 7, 8, 2), (64, 1000, 9, 3), (300, 0, 9, 3), (600, 250, 9, 3)]
needs_pages = pytest.mark.skipif(not A._PAGES_OK["cpu"], reason="no fused CPU SDPA kernel with log-sum-exp")


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


@needs_pages
@pytest.mark.parametrize(("chunk", "hist", "heads", "kv"), SHAPES)
def test_pages_match_the_reference_in_fp32(chunk: int, hist: int, heads: int, kv: int) -> None:
    q, k_cache, v_cache, rows, _mask, ref = _case(chunk, hist, heads, kv, torch.float32)
    got = A._prefill_by_pages(q, rows, k_cache, v_cache)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_pages
@pytest.mark.parametrize(("chunk", "hist", "heads", "kv"), SHAPES)
def test_pages_in_bf16_are_near_the_one_masked_call(chunk: int, hist: int, heads: int, kv: int) -> None:
    """bf16 inputs: each part comes from the kernel in bf16 (as the one call's does) and the
    parts merge in fp32: within twice the one masked bf16 call's largest error."""
    q, k_cache, v_cache, rows, mask, ref = _case(chunk, hist, heads, kv, torch.bfloat16)
    got = A._prefill_by_pages(q, rows, k_cache, v_cache)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    one_call = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_cache[rows].transpose(0, 1).unsqueeze(0),
        v_cache[rows].transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
        scale=1.0,
    )[0].transpose(0, 1)
    err_pages = (got.float() - ref).abs().max()
    err_one = (one_call.float() - ref).abs().max()
    assert err_pages <= err_one * 2 + 1e-6, (err_pages, err_one)


def _batch(q: torch.Tensor, rows: torch.Tensor, hist: int) -> A.StepBatch:
    n, h, d = q.shape
    empty = torch.zeros(n, h, d)
    chunk = A.PrefillChunk(0, n, rows, None, fresh=hist == 0)
    return A.StepBatch(empty, empty, rows[hist:], 0, None, None, [chunk])


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_of_a_chunk_after_history(
    pages: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``paged_attention`` (the chunk's K/V written into the cache first), on both paths:
    by pages where the CPU kernel has it, the masked call (built once, kept on the chunk)."""
    if pages and not A._PAGES_OK["cpu"]:
        pytest.skip("no fused CPU SDPA kernel with log-sum-exp")
    monkeypatch.setitem(A._PAGES_OK, "cpu", pages)
    chunk, hist = 40, 300
    q, k_cache, v_cache, rows, _mask, ref = _case(chunk, hist, 9, 3, dtype)
    k_new, v_new = k_cache[rows[hist:]].clone(), v_cache[rows[hist:]].clone()
    k_cache[rows[hist:]] = 0  # the chunk's rows hold nothing until paged_attention writes them
    v_cache[rows[hist:]] = 0
    b = _batch(q, rows, hist)
    got = A.paged_attention(q, k_new, v_new, b, k_cache, v_cache)
    assert (b.prefills[0].mask is None) == pages  # by pages, no [C, T] mask
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@needs_pages
def test_a_row_is_the_same_whatever_its_chunk() -> None:
    """bf16, by pages: rows computed as the tail of a prompt after a cached prefix (any length,
    1-row chunks included) are bit for bit the rows of the whole prompt in one chunk: a
    prefix-cached prompt gets the uncached one's hidden states."""
    torch.manual_seed(0)
    t, kv, heads, d = 700, 3, 9, 64
    k_cache = torch.randn(t, kv, d).bfloat16()
    v_cache = torch.randn(t, kv, d).bfloat16()
    q = (torch.randn(t, heads, d) * 0.4).bfloat16()
    rows = torch.arange(t)
    for end in (241, 700):
        whole = A._prefill_by_pages(q[:end], rows[:end], k_cache, v_cache)
        for hist in (0, 16, 127, 128, 160, 256, 300, 512, end - 5, end - 3, end - 1):
            for cut in sorted({hist + 1, hist + 2, hist + 3, hist + 7, hist + 300, end}):
                if hist < cut <= end:
                    part = A._prefill_by_pages(q[hist:cut], rows[:cut], k_cache, v_cache)
                    assert torch.equal(part, whole[hist:cut]), (end, hist, cut)


def test_zero_rows_pad_the_kernels_last_query_block() -> None:
    for m in range(1, 2000):
        e = A._pad_rows(torch.zeros(1, m, 1)).shape[1] - m
        assert e < 4 and not 0 < (m + e) % A._q_block(m + e) < 4, m


def _quantized(kind: str, cache: torch.Tensor):
    from workers.kernels.kv_quant import QuantRows

    rows, kv, d = cache.shape
    qr = QuantRows.empty(kind, rows, kv, d, cache.device)
    qr.write(torch.arange(rows), cache)
    return qr, qr.read(torch.arange(rows), cache.dtype)  # the cache and its dequantized copy


@needs_pages
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize(("chunk", "hist"), [(40, 300), (300, 700), (1, 900), (129, 127)])
def test_a_quantized_history_read_in_chunks_equals_its_dequantized_copy(
    kind: str, chunk: int, hist: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quantized cache's history is read ``HISTORY`` rows at a time (here 256: several chunks
    per page), merged by log-sum-exp: the rows of one call over the dequantized copy, in fp32."""
    monkeypatch.setattr(A, "HISTORY", 256)
    q, k_cache, v_cache, rows, _mask, _ref = _case(chunk, hist, 9, 3, torch.float32)
    kq, kd = _quantized(kind, k_cache)
    vq, vd = _quantized(kind, v_cache)
    got = A._prefill_by_pages(q, rows, kq, vq)
    want = A._prefill_by_pages(q, rows, kd, vd)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_pages
def test_a_quantized_row_is_the_same_whatever_its_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 over a q8_0 cache, history in chunks of 256: a prefix-cached prompt's rows are bit for
    bit the uncached prompt's, however either was chunked."""
    monkeypatch.setattr(A, "HISTORY", 256)
    torch.manual_seed(0)
    t, kv, heads, d = 700, 3, 9, 64
    kq, _ = _quantized("q8_0", torch.randn(t, kv, d).bfloat16())
    vq, _ = _quantized("q8_0", torch.randn(t, kv, d).bfloat16())
    q = (torch.randn(t, heads, d) * 0.4).bfloat16()
    rows = torch.arange(t)
    whole = A._prefill_by_pages(q, rows, kq, vq)
    for hist in (0, 127, 256, 300, 512, 600, t - 1):
        for cut in sorted({hist + 1, hist + 3, hist + 200, t}):
            if hist < cut <= t:
                part = A._prefill_by_pages(q[hist:cut], rows[:cut], kq, vq)
                assert torch.equal(part, whole[hist:cut]), (hist, cut)
