"""A prefill chunk after cached history: the two-part attention (history unmasked, chunk causal,
merged by log-sum-exp) against one masked SDPA over the whole gather."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.layers import attention as A


@pytest.mark.skipif(not A._SPLIT_OK["cpu"], reason="no fused CPU SDPA kernel with log-sum-exp")
@pytest.mark.parametrize(("chunk", "hist", "heads", "kv"), [(16, 48, 9, 3), (33, 200, 4, 4), (1, 7, 8, 2)])
def test_split_matches_masked_sdpa(chunk: int, hist: int, heads: int, kv: int) -> None:
    torch.manual_seed(0)
    d, t = 64, hist + chunk
    k_cache = torch.randn(t + 20, kv, d)
    v_cache = torch.randn(t + 20, kv, d)
    rows = torch.randperm(t + 20)[:t]  # the sequence's cache rows, scattered like paged blocks
    q = torch.randn(chunk, heads, d) * d**-0.5
    mask = (torch.arange(t)[None, :] <= torch.arange(hist, t)[:, None])[None, None]
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_cache[rows].transpose(0, 1).unsqueeze(0),
        v_cache[rows].transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
        scale=1.0,
    )[0].transpose(0, 1)
    got = A._prefill_split(q, k_cache[rows[hist:]], v_cache[rows[hist:]], rows[:hist], k_cache, v_cache)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
