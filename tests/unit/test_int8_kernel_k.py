"""``Int8Linear`` on in-feature counts torch's int8 CPU kernel gets wrong (``workers.quant.INT8_KERNEL_K``).

torch's ``_weight_int8pack_mm`` (2.13, AVX-512) is right only for K a multiple of 16; for other K it
returns wrong sums or crashes the process (K = 12: a segfault). Such layers take the widening path
(``F.linear`` of the int8 weight as bf16, times the row scales), which these shapes run here, in
process: a crash would fail the whole test run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.quant import INT8_KERNEL_K, Int8Linear


@pytest.mark.parametrize("k", [8, 12, 24, 31, INT8_KERNEL_K, 64])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_int8_linear_is_right_for_any_in_features(k, m):
    torch.manual_seed(k * 100 + m)
    w = torch.randn(48, k)
    lin = Int8Linear(w.to(torch.bfloat16), None)
    assert lin.kernel == (k % INT8_KERNEL_K == 0)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float()) * lin.scale.float()  # the int8 levels, exactly
    got = lin(x).float()
    assert got.shape == (m, 48)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-2
