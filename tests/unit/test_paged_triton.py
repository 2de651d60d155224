"""The Triton paged decode-attention kernel (``workers/kernels/paged_triton.py``) against a float64
reference over the gathered rows and the torch path it replaces on a CUDA die
(``attention._decode_by_rows``).

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by the
``interp`` fixture for the tests that use it, and undone after them), on CPU tensors; without
triton those tests skip. The ``gpu`` tests run the compiled kernels on cuda:0. The refusals of
``reads`` and the import check need neither."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine
from workers.kernels import paged_triton as PT
from workers.layers import attention as A
from workers.layers.kv_quant import QuantRows

from helpers.decode_rows import decode_batch, drain

ROOT = Path(__file__).resolve().parents[2]
JIT = "workers.kernels.paged_triton_jit"


@pytest.fixture(scope="module")
def interp() -> Iterator[None]:
    """Triton's interpreter for this module's interpreter tests, on a host without CUDA (with
    one, the ``gpu`` tests run the compiled kernels instead). ``TRITON_INTERPRET=1`` is set
    before triton's first import (``triton.jit`` reads it when it decorates, its own library
    included), then the kernels' module is imported afresh under it; both are dropped after
    (the variable, and the kernels' module), so no other test sees them."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the gpu tests run the compiled kernels")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.zeros, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET=1 in this process")
        from helpers.triton_interp import fix

        fix()
        sys.modules.pop(JIT, None)
        yield
    finally:
        sys.modules.pop(JIT, None)
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture
def compiled() -> Iterator[None]:
    """The compiled kernels (the gpu tests): no interpreter, a fresh kernels' module."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in the environment: the gpu tests run compiled kernels")
    sys.modules.pop(JIT, None)
    yield
    sys.modules.pop(JIT, None)


def _reference(q, kc, vc, tab, lens, bs, sinks) -> torch.Tensor:
    """Float64 attention of each row over the rows its table names, gathered one by one."""
    bsz, h, d = q.shape
    kv = kc.shape[1]
    g = h // kv
    out = torch.empty(bsz, h, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(lens[b])
        pos = torch.arange(n)
        rows = tab[b].long()[pos // bs] * bs + pos % bs
        k = kc[rows].double()  # [n, KV, D]
        v = vc[rows].double()
        for hh in range(h):
            s = k[:, hh // g] @ q[b, hh].double()  # [n]
            if sinks is not None:
                s = torch.cat((s, sinks[hh : hh + 1].double()))
            p = torch.softmax(s, 0)[:n]
            out[b, hh] = p @ v[:, hh // g]
    return out


TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.5e-2, 1e-2), torch.float16: (2e-3, 2e-3)}

# (B, KV, G, D, block size, dtype, table dtype, sinks): each value of each axis at least twice,
# a few seconds in the interpreter in all
CASES = [
    (1, 1, 1, 64, 16, torch.float32, torch.int64, False),
    (3, 2, 4, 128, 32, torch.bfloat16, torch.int32, True),
    (3, 1, 8, 64, 32, torch.float16, torch.int64, True),
    (1, 2, 8, 128, 16, torch.bfloat16, torch.int64, False),
    (3, 2, 1, 128, 16, torch.float32, torch.int32, True),
    (3, 1, 4, 64, 16, torch.bfloat16, torch.int64, False),
    (1, 1, 4, 128, 32, torch.float16, torch.int32, False),
    (3, 2, 8, 64, 16, torch.float32, torch.int64, True),
    (3, 2, 4, 64, 32, torch.float16, torch.int32, False),
    (1, 2, 1, 64, 32, torch.bfloat16, torch.int32, True),
    (3, 2, 2, 16, 16, torch.float32, torch.int64, True),  # the tiny presets' heads (D 16, G 2)
    (1, 1, 4, 256, 16, torch.bfloat16, torch.int32, False),  # D 256: tiles of 32 positions
]


def _ids(c) -> str:
    b, kv, g, d, bs, dt, idx, sinks = c
    return f"b{b}kv{kv}g{g}d{d}bs{bs}{str(dt)[6:]}{str(idx)[6:]}{'sinks' if sinks else ''}"


def _inputs(case, lens: list[int], seed: int):
    b, kv, g, d, bs, dt, idx, with_sinks = case
    bt, rows = decode_batch(lens, bs, seed=seed, idx=idx)  # shuffled blocks, block 0 past the end
    torch.manual_seed(seed)
    kc = torch.randn(rows, kv, d).to(dt)
    vc = torch.randn(rows, kv, d).to(dt)
    q = (torch.randn(len(lens), kv * g, d) * 0.3).to(dt)
    sinks = torch.randn(kv * g) if with_sinks else None
    return bt, q, kc, vc, sinks


def _lens(case) -> list[int]:
    """One position, exactly four blocks, several partitions of 64 (and one short of a block)."""
    bs = case[4]
    return [300] if case[0] == 1 else [1, 4 * bs, 300]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_kernel_equals_the_reference(interp, case):
    bs, dt = case[4], case[5]
    lens = _lens(case)
    bt, q, kc, vc, sinks = _inputs(case, lens, seed=len(lens) + case[3] + case[2])
    assert bt.decode_blocks is not None and bt.decode_lens is not None
    assert PT.reads(q, kc, vc)
    bsz, h, d = q.shape
    part, n_parts = 64, -(-bt.decode_blocks.shape[1] * bs // 64)
    assert n_parts >= 5  # 300 positions: five partitions of 64
    out = torch.full_like(q, float("nan"))
    sc = PT.scratch(bsz, h, d, n_parts, q.device)
    sc.o.fill_(float("nan"))  # partitions past a row's length are never written nor read
    sc.lse.fill_(float("nan"))
    got = PT.paged_decode(
        q, kc, vc, bt.decode_blocks, bt.decode_lens, bs, sinks, out=out, scratch_=sc, part=part
    )
    assert got.data_ptr() == out.data_ptr() and got.dtype == dt
    assert not got.isnan().any()
    want = _reference(q, kc, vc, bt.decode_blocks, lens, bs, sinks)
    atol, rtol = TOL[dt]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    # and the torch path over the same values (in fp32)
    sk = None if sinks is None else sinks.float()
    torch_path = A._decode_by_rows(q.float(), bt, kc.float(), vc.float(), sk)
    torch.testing.assert_close(got.float(), torch_path, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=_ids)
def test_default_split_and_fresh_outputs(interp, case):
    """Without ``part``, ``scratch_`` or ``out``: the split ``split`` picks (longer partitions),
    new tensors; lens of one, a block multiple, several of ``MIN_PART``."""
    bs, dt = case[4], case[5]
    lens = [1, 8 * bs, 2 * PT.MIN_PART + 5][: case[0]]
    bt, q, kc, vc, sinks = _inputs(case, lens, seed=3)
    assert bt.decode_blocks is not None and bt.decode_lens is not None
    part, n_parts = PT.split(len(lens), kc.shape[1], bt.decode_blocks.shape[1], bs, q.shape[2], q.device)
    assert part % 64 == 0 and part >= PT.MIN_PART and n_parts * part >= max(lens)
    got = PT.paged_decode(q, kc, vc, bt.decode_blocks, bt.decode_lens, bs, sinks)
    atol, rtol = TOL[dt]
    want = _reference(q, kc, vc, bt.decode_blocks, lens, bs, sinks)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_split_depends_on_shapes_only():
    dev = torch.device("cpu")
    # short contexts: one partition of MIN_PART, or fewer positions than that
    assert PT.split(1, 8, 2, 16, 128, dev) == (PT.MIN_PART, 1)
    # a long context, few rows: cut to fill the device (PROGRAMS_PER_SM programs per SM)
    part, n = PT.split(1, 1, 1024, 16, 128, dev)
    assert n >= PT._INTERPRETER_SMS * PT.PROGRAMS_PER_SM // 2 and part * n >= 1024 * 16
    # a large batch fills it alone: one partition a row
    assert PT.split(512, 8, 64, 16, 128, dev) == (1024, 1)
    assert PT.split(1, 1, 1024, 16, 256, dev)[0] % 32 == 0  # D = 256: tiles of 32


def test_reads_refuses():
    q = torch.randn(2, 8, 64)
    kc, vc = torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        assert not PT.reads(q, kc, vc)  # a CPU tensor, no interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        assert PT.reads(q, kc, vc)
        kq = QuantRows.empty("q8_0", 40, 2, 64, torch.device("cpu"))
        assert not PT.reads(q, kq, vc) and not PT.reads(q, kc, kq)  # quantized rows
        odd = torch.randn(40, 2, 48)
        assert not PT.reads(torch.randn(2, 8, 48), odd, odd)  # D not a power of two
        small = torch.randn(40, 2, 8)
        assert not PT.reads(torch.randn(2, 8, 8), small, small)  # D below 16
        assert not PT.reads(q.bfloat16(), kc, vc)  # q's dtype differs from the pools'
        assert not PT.reads(q, kc.transpose(0, 1).contiguous().transpose(0, 1), vc)  # not contiguous
        assert not PT.reads(torch.randn(2, 9, 64), kc, vc)  # H not a multiple of KV
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


NO_TRITON = """
import sys
import torch
sys.path.insert(0, "tests")
from helpers.decode_rows import decode_batch, drain
from workers.layers import attention as A
b, rows = decode_batch([5, 40], 16)
q = torch.randn(2, 4, 64)
kc, vc = torch.randn(rows, 2, 64), torch.randn(rows, 2, 64)
out = A.decode_attention(q, b, kc, vc)
assert out.shape == (2, 4, 64)
assert "triton" not in sys.modules, "the CPU decode imported triton"
print("ok")
"""


def test_cpu_decode_never_imports_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = subprocess.run(
        [sys.executable, "-c", NO_TRITON], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_switched_off():
    old = os.environ.get("PANTHEON_ATTN_KERNEL")
    os.environ["PANTHEON_ATTN_KERNEL"] = "0"
    try:
        assert not PT.available() and PT.describe() == "torch: PANTHEON_ATTN_KERNEL=0"
    finally:
        if old is None:
            os.environ.pop("PANTHEON_ATTN_KERNEL")
        else:
            os.environ["PANTHEON_ATTN_KERNEL"] = old


# --- on cuda:0 ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 8, 64])
def test_cuda_kernel_equals_the_torch_path(compiled, bsz):
    """Llama-3.1-8B's heads (32 q, 8 KV, D 128), bf16, contexts 1..4096 (one of each end), with
    and without sinks; through ``decode_attention``'s seam too."""
    dev = torch.device("cuda:0")
    torch.manual_seed(bsz)
    lens = torch.randint(1, 4097, (bsz,)).tolist()
    lens[0] = 1
    if bsz > 1:
        lens[1] = 4096
    bt, rows = decode_batch(lens, 16, seed=bsz)
    bt = bt.to(dev)
    assert bt.decode_blocks is not None and bt.decode_lens is not None
    kc = torch.randn(rows, 8, 128, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(rows, 8, 128, device=dev, dtype=torch.bfloat16)
    q = (torch.randn(bsz, 32, 128, device=dev) * 0.1).bfloat16()
    assert PT.available() and PT.reads(q, kc, vc)
    for sinks in (None, torch.randn(32, device=dev).bfloat16()):
        got = PT.paged_decode(q, kc, vc, bt.decode_blocks, bt.decode_lens, 16, sinks)
        sk = None if sinks is None else sinks.float()
        want = A._decode_by_rows(q.float(), bt, kc.float(), vc.float(), sk)
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1e-2)
        assert torch.equal(A.decode_attention(q, bt, kc, vc, sinks), got)  # the seam takes it
        for dt in (torch.float32, torch.float16):  # the other pools' dtypes (fp32: no TF32)
            got = PT.paged_decode(q.to(dt), kc.to(dt), vc.to(dt), bt.decode_blocks, bt.decode_lens, 16, sinks)
            torch.testing.assert_close(got.float(), want, atol=TOL[dt][0] + 1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_cuda_graph_replays_new_lengths(compiled):
    """Captured once at a batch and table width, replayed with other lengths and tables written
    in place: the kernel reads them on the device (no host sync, no size from their values)."""
    dev = torch.device("cuda:0")
    bs, nb, bsz = 16, 64, 4
    lens0 = [1, 100, 1024, 500]
    bt, rows = decode_batch(lens0, bs, seed=1)
    bt = bt.to(dev)
    assert bt.decode_blocks is not None and bt.decode_lens is not None
    tab = torch.zeros(bsz, nb, dtype=torch.long, device=dev)
    tab[:, : bt.decode_blocks.shape[1]] = bt.decode_blocks
    ln = bt.decode_lens.clone()
    kc = torch.randn(max(rows, nb * bs * bsz), 2, 64, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = (torch.randn(bsz, 6, 64, device=dev) * 0.3).bfloat16()
    part, n_parts = PT.split(bsz, 2, nb, bs, 64, dev)
    sc = PT.scratch(bsz, 6, 64, n_parts, dev)
    out = torch.empty_like(q)
    PT.paged_decode(q, kc, vc, tab, ln, bs, out=out, scratch_=sc)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        PT.paged_decode(q, kc, vc, tab, ln, bs, out=out, scratch_=sc)
    for lens in ([1, 100, 1024, 500], [1024, 3, 17, 999]):
        b2, _rows = decode_batch(lens, bs, seed=sum(lens))
        assert b2.decode_blocks is not None
        tab.zero_()
        tab[:, : b2.decode_blocks.shape[1]] = b2.decode_blocks.to(dev)
        ln.copy_(torch.tensor(lens))
        graph.replay()
        want = PT.paged_decode(q, kc, vc, tab, ln, bs)
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_engine_tokens_with_and_without_the_kernel(compiled, model_factory, monkeypatch):
    """Greedy tokens of the tiny Llama (4 q heads, 2 KV, D 16) on cuda:0, fp32: the same with the
    kernel (which runs: counted) as with the torch path."""
    path = str(model_factory("tiny-llama", dtype="float32"))
    prompts = [[5, 17, 300, 41], list(range(100, 160)), [64], list(range(10, 300))]
    calls = []
    kernel = PT.paged_decode
    monkeypatch.setattr(PT, "paged_decode", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    out = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("PANTHEON_ATTN_KERNEL", switch)
        eng = Engine(path, devices=["cuda:0"], dtype="float32", kv_budget_bytes=4 << 20)
        for i, p in enumerate(prompts):
            eng.submit(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        out[switch] = drain(eng)
        assert bool(calls) == (switch == "1")
    assert out["0"] == out["1"]
