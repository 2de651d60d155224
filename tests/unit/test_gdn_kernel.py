"""The gated-delta decode step kernel (``workers/kernels/gated_delta.c`` through ``gdn_step.py``):
right against float64 on every ISA it is built for, only the slots it is given written, the same
bits on any thread count; and Qwen3.5's decode path through it gives what torch's ops give.

Each ISA builds in a subprocess of its own (``PANTHEON_KERNEL_ISA``: native, avx2, scalar).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_qlinear_kernel import X86, _cpu_flags, _run

from workers.kernels import gdn_step
from workers.layers.gated_delta import gated_delta_step_slots, recurrent_gated_delta_step

CHECK = "import json; from helpers.gdn_ref import check; print(json.dumps(check()))"


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_each_isa_is_right_against_float64(isa):
    if not gdn_step.available():
        pytest.skip("no C compiler here: decode keeps torch's ops (tested in test_gated_delta.py)")
    if isa != "native" and not X86:
        pytest.skip("the avx2 / scalar builds name x86-64 levels")
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    got = json.loads(_run(CHECK, {"PANTHEON_KERNEL_ISA": isa}))
    assert got["worst"] < 1e-5, got
    assert got["untouched"] and got["same"], got


def test_the_slots_step_matches_torchs_ops_and_the_switch(monkeypatch):
    """``gated_delta_step_slots`` (the kernel) against ``recurrent_gated_delta_step`` on
    gathered states, for slot lists and runs, GQA heads and bf16 values; with
    ``PANTHEON_GDN_KERNEL=0`` the same through torch's ops."""
    g_ = torch.Generator().manual_seed(1)
    b, hk, hv, dk, dv = 3, 2, 4, 32, 24
    q, k = torch.randn(b, hk, dk, generator=g_), torch.randn(b, hk, dk, generator=g_)
    v = torch.randn(b, hv, dv, generator=g_).bfloat16()
    g, beta = -torch.rand(b, hv, generator=g_), torch.rand(b, hv, generator=g_)
    pool = torch.randn(6, hv, dk, dv, generator=g_)
    for at in (torch.tensor([4, 0, 2]), slice(1, 4)):
        want_o, want_s = recurrent_gated_delta_step(q, k, v, g, beta, pool[at].clone())
        for switch in ("1", "0"):
            monkeypatch.setenv("PANTHEON_GDN_KERNEL", switch)
            p = pool.clone()
            o = gated_delta_step_slots(q, k, v, g, beta, p, at)
            assert o.dtype == torch.bfloat16
            assert torch.allclose(o.float(), want_o.float(), atol=2e-2, rtol=0), (switch, at)
            assert torch.allclose(p[at], want_s, atol=1e-5, rtol=0), (switch, at)
