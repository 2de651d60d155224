"""flash-linear-attention's Gated DeltaNet kernels against our torch functions (the reference
tests hold those to transformers). The kernels need CUDA: these run on a lent GPU
(``bench/gpu_check.py`` carries the ``fla-core`` wheel); on the CPU only the switch is checked."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import fla_gdn
from workers.layers.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_step


def test_a_cpu_tensor_never_imports_fla():
    fla_gdn._ops.cache_clear()
    assert not fla_gdn.available(torch.zeros(1))
    assert fla_gdn._ops.cache_info().currsize == 0  # not even tried


def _inputs(t: int, hk: int, hv: int, d: int, dtype: torch.dtype, lead: tuple[int, ...] = ()):
    dev = "cuda:0"
    q = torch.randn(*lead, t, hk, d, device=dev).to(dtype)
    k = torch.randn(*lead, t, hk, d, device=dev).to(dtype)
    v = torch.randn(*lead, t, hv, d, device=dev).to(dtype)
    g = -torch.rand(*lead, t, hv, device=dev) * 0.5  # log decays
    beta = torch.rand(*lead, t, hv, device=dev)
    return q, k, v, g, beta


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 63, 64, 130])
def test_chunk_matches_the_torch_rule(dtype, t):
    pytest.importorskip("fla")
    torch.manual_seed(t)
    q, k, v, g, beta = _inputs(t, 2, 4, 64, dtype)
    state = torch.randn(4, 64, 64, device="cuda:0") * 0.1
    want_o, want_s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert fla_gdn.available(q)
    got_o, got_s = fla_gdn.chunk(q, k, v, g, beta, state.clone())
    tol = 5e-3 if dtype == torch.float32 else 2e-2  # (FLA's dots may run in tf32 / bf16)
    assert got_o.dtype == dtype and got_o.shape == want_o.shape
    assert _rel(got_o, want_o) < tol and _rel(got_s, want_s) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_the_torch_step(dtype):
    pytest.importorskip("fla")
    torch.manual_seed(0)
    q, k, v, g, beta = (x[:, 0] for x in _inputs(1, 2, 4, 64, dtype, lead=(5,)))  # [B=5, ...]
    state = torch.randn(5, 4, 64, 64, device="cuda:0") * 0.1
    want_o, want_s = recurrent_gated_delta_step(q, k, v, g, beta, state.clone())
    got_o, got_s = fla_gdn.step(q, k, v, g, beta, state)
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert _rel(got_o, want_o) < tol and _rel(got_s, want_s) < tol


@pytest.mark.gpu
def test_engine_tokens_with_and_without_fla(model_factory, monkeypatch):
    """Qwen3.5 on cuda:0 (fp32): FLA's kernels give the torch path's greedy tokens."""
    pytest.importorskip("fla")
    from pantheon.core.protocol import SamplingParams
    from workers.engine import Engine

    path = str(model_factory("tiny-qwen3.5-text", dtype="float32"))
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PANTHEON_FLA", flag)
        eng = Engine(path, devices=["cuda:0"], dtype="float32", kv_budget_bytes=4 << 20)
        for i, p in enumerate([[5, 17, 300, 41], list(range(100, 190)), [64]]):
            eng.submit(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while eng.has_work():
            for o in eng.step():
                out.setdefault(o.request_id, []).append(o.token)
        got[flag] = out
    assert got["0"] == got["1"]
