"""The native paged decode-attention kernel (``workers/kernels``) against the torch path it
replaces on the CPU (``_decode_by_rows``: the gather of every row, then matmul / softmax /
matmul), its build cache and fallbacks, and engines decoding through it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.kernels import build, paged
from workers.kernels.kv_quant import QuantRows
from workers.layers import attention as A

from helpers.decode_rows import PROMPTS, decode_batch, greedy_tokens

pytestmark = pytest.mark.skipif(not paged.available(), reason=f"no paged kernel: {paged.status()}")

ROOT = Path(__file__).resolve().parents[2]


def _kernel(q, kc, vc, b: A.StepBatch, sinks=None, rows: slice = slice(None)) -> torch.Tensor:
    """The kernel on ``b``'s rows ``rows``."""
    assert b.decode_blocks is not None and b.decode_lens is not None
    return paged.paged_decode(
        q[rows], kc, vc, b.decode_blocks[rows], b.decode_lens[rows], b.block_size, sinks
    )


def _pools(kind: str, rows: int, kv: int, d: int, seed: int):
    """K and V pools of ``kind`` and their values at full width in fp32 (the reference's input)."""
    torch.manual_seed(seed)
    k, v = torch.randn(rows, kv, d), torch.randn(rows, kv, d)
    if kind in ("q8_0", "q4_0"):
        kq, vq = (
            QuantRows.empty(kind, rows, kv, d, torch.device("cpu")),
            QuantRows.empty(kind, rows, kv, d, torch.device("cpu")),
        )
        every = torch.arange(rows)
        kq.write(every, k)
        vq.write(every, v)
        return kq, vq, kq.read(every, torch.float32), vq.read(every, torch.float32)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
    return k.to(dt), v.to(dt), k.to(dt).float(), v.to(dt).float()


def _reference(q, b, kf, vf, sinks):
    """The torch path in fp32 over the same values."""
    return A._decode_by_rows(q.float(), b, kf, vf, None if sinks is None else sinks.float())


CASES = [  # (H, KV, D, block size, lens)
    (4, 4, 64, 16, [37]),  # G = 1
    (4, 2, 32, 16, [50, 3]),  # the tiny preset's narrow heads (D = 32; 16 for full-width pools)
    (9, 3, 64, 16, [700, 5, 129, 256, 257]),  # SmolLM2's heads; uneven lens, chunk edges
    (8, 2, 128, 32, [1000]),  # G = 4, D = 128
    (8, 2, 128, 32, [33, 600, 1, 64, 300]),
]


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp16", "q8_0", "q4_0"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}bs{c[3]}b{len(c[4])}")
@pytest.mark.parametrize("with_sinks", [False, True])
def test_kernel_equals_the_torch_path(kind, case, with_sinks):
    h, kv, d, bs, lens = case
    b, rows = decode_batch(lens, bs, seed=len(lens))
    kc, vc, kf, vf = _pools(kind, rows, kv, d, seed=h + d)
    q = torch.randn(len(lens), h, d) * 0.3
    sinks = torch.randn(h) if with_sinks else None
    assert paged.reads(q, kc, vc)
    want = _reference(q, b, kf, vf, sinks)
    got = _kernel(q, kc, vc, b, sinks)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32: summation order only
    # through the seam: decode_attention takes the kernel for these
    torch.testing.assert_close(A.decode_attention(q, b, kc, vc, sinks), got, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_bf16_queries_give_the_fp32_result_rounded_once(kind):
    h, kv, d, bs, lens = 9, 3, 64, 16, [300, 70, 1]
    b, rows = decode_batch(lens, bs)
    kc, vc, kf, vf = _pools(kind, rows, kv, d, seed=5)
    q = (torch.randn(len(lens), h, d) * 0.3).bfloat16()
    sinks = torch.randn(h).bfloat16()
    got = _kernel(q, kc, vc, b, sinks)
    assert got.dtype == torch.bfloat16
    want = _reference(q, b, kf, vf, sinks)
    # bf16 has 8 significant bits: within one unit in the last place of the fp32 result
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-3)
    assert ((got.float() - want).abs() <= ulp).all()
    # and closer to it than the torch path in bf16 (scores and probabilities rounded to bf16)
    torch_bf16 = A._decode_by_rows(q, b, kf.bfloat16(), vf.bfloat16(), sinks)
    assert (got.float() - want).abs().mean() <= (torch_bf16.float() - want).abs().mean()


def test_fp16_queries_and_int32_tables():
    h, kv, d, bs, lens = 6, 2, 64, 16, [90, 17]
    b, rows = decode_batch(lens, bs, idx=torch.int32)
    kc, vc, kf, vf = _pools("fp16", rows, kv, d, seed=2)
    q = (torch.randn(len(lens), h, d) * 0.3).half()
    got = _kernel(q, kc, vc, b)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), _reference(q, b, kf, vf, None), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["bf16", "q4_0"])
def test_a_row_is_the_same_alone_and_batched(kind):
    """Batch invariance: a row's output does not depend on its neighbours (the kernel splits a
    row's context by its own length only), bit for bit, at 1 and 2 threads."""
    h, kv, d, bs = 9, 3, 64, 16
    lens = [300, 3000, 1, 777, 2049]
    b, rows = decode_batch(lens, bs)
    kc, vc, _kf, _vf = _pools(kind, rows, kv, d, seed=9)
    q = (torch.randn(len(lens), h, d) * 0.3).bfloat16()
    threads = torch.get_num_threads()
    try:
        for nt in (2, 1):
            torch.set_num_threads(nt)
            together = _kernel(q, kc, vc, b)
            for i in range(len(lens)):
                alone = _kernel(q, kc, vc, b, rows=slice(i, i + 1))
                assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)


def test_verify_rows_are_plain_decode_rows():
    """Speculation's verify rows (one sequence's k + 1 rows, lengths p0 + 1 .. p0 + k + 1, one
    block table) each give what a plain one-row step at that length gives, bit for bit: no
    row is padded to the longest."""
    h, kv, d, bs, p0 = 9, 3, 64, 16, 1000
    lens = [p0 + i + 1 for i in range(5)]
    b, rows = decode_batch(lens, bs)
    assert b.decode_blocks is not None
    b.decode_blocks[:] = b.decode_blocks[-1].clone()  # one sequence's table on every row
    kc, vc, _kf, _vf = _pools("bf16", rows, kv, d, seed=1)
    q = (torch.randn(len(lens), h, d) * 0.3).bfloat16()
    together = _kernel(q, kc, vc, b)
    for i, n in enumerate(lens):
        one, _rows = decode_batch([n], bs)
        one.decode_blocks = b.decode_blocks[i : i + 1, : -(-n // bs)]
        assert torch.equal(_kernel(q[i : i + 1], kc, vc, one)[0], together[i])


MAPS = (
    "from pathlib import Path; from workers.kernels import paged; assert paged.library() is not None;"
    "print(sorted({l.split()[-1] for l in Path('/proc/self/maps').read_text().splitlines() if 'libgomp' in l}))"
)


def test_one_openmp_runtime_whose_threads_follow_torch():
    # In a fresh process, as a worker loads it (this test process may hold other libraries'
    # OpenMP runtimes: scikit-learn brings its own renamed libgomp): the kernel binds to torch's.
    gomp = eval(_run(MAPS, {}))
    assert gomp == [str(Path(torch.__file__).parent / "lib" / "libgomp.so.1")], gomp
    lib = paged.library()
    assert lib is not None
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert lib.pd_omp_max_threads() == n
    finally:
        torch.set_num_threads(threads)


def _run(code: str, env: dict[str, str]) -> str:
    import os

    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


STATUS = "from workers.kernels import paged; print(paged.status())"


def test_build_is_cached_by_its_inputs(tmp_path):
    first = _run(STATUS, {"PANTHEON_KERNEL_CACHE": str(tmp_path)})
    assert first.startswith("built ")
    so = Path(first.split(" ", 1)[1])
    mtime = so.stat().st_mtime_ns
    assert _run(STATUS, {"PANTHEON_KERNEL_CACHE": str(tmp_path)}) == f"cached {so}"
    assert so.stat().st_mtime_ns == mtime  # the same file: no recompile
    assert [p.name for p in tmp_path.iterdir()] == [so.name]  # no temporaries left behind


def test_a_broken_compiler_gives_none_and_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("PANTHEON_KERNEL_CACHE", str(tmp_path))
    lib, why = build.build("paged_decode")
    assert lib is None and "/bin/false" in why
    monkeypatch.setenv("CC", f"cc -include {tmp_path}/missing.h")  # runs, fails to compile
    lib, why = build.build("paged_decode")
    assert lib is None and "failed" in why
    assert not list(tmp_path.iterdir())


def test_engine_decodes_on_the_torch_path_without_a_compiler(tiny_model, tmp_path):
    code = (
        "from workers.kernels import paged; from workers.engine import Engine;"
        "from pantheon.core.protocol import SamplingParams as S;"
        f"e = Engine({str(tiny_model)!r}, dtype='float32', kv_budget_bytes=4 << 20);"
        "e.submit('a', [5, 6, 7, 8], S(temperature=0.0, max_tokens=4, ignore_eos=True));"
        "out = [o.token for _ in range(20) if e.has_work() for o in e.step()];"
        "print(paged.available(), len(out), paged.status())"
    )
    got = _run(code, {"CC": "/bin/false", "PANTHEON_KERNEL_CACHE": str(tmp_path)})
    assert got.startswith("False 4 compiler '/bin/false' does not run")


def test_switch_off_selects_the_torch_path(monkeypatch):
    h, kv, d, bs, lens = 6, 2, 64, 16, [90, 17]
    b, rows = decode_batch(lens, bs)
    kc, vc, _kf, _vf = _pools("bf16", rows, kv, d, seed=2)
    q = (torch.randn(len(lens), h, d) * 0.3).bfloat16()
    kernel = A.decode_attention(q, b, kc, vc)
    assert paged.describe().startswith(("kernel: built ", "kernel: cached "))  # what /admin/dies shows
    monkeypatch.setenv("PANTHEON_ATTN_KERNEL", "0")
    assert not paged.available()
    assert paged.describe() == "torch: PANTHEON_ATTN_KERNEL=0"
    torch_path = A.decode_attention(q, b, kc, vc)
    assert torch.equal(torch_path, A._decode_by_rows(q, b, kc, vc))
    assert not torch.equal(torch_path, kernel)  # bf16: the two paths round differently


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def wide(model_factory):
    """The tiny Qwen3 preset with 32-value heads (one quantization block per head row)."""
    return model_factory("tiny", dtype="float32", head_dim=32)


@pytest.mark.parametrize("kinds", [("auto", "auto"), ("q8_0", "q8_0")])
def test_engine_greedy_equals_the_torch_path(wide, monkeypatch, kinds):
    calls = []
    real = paged.paged_decode
    monkeypatch.setattr(paged, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    kernel = greedy_tokens(wide, PROMPTS, kinds)
    assert calls  # the decode rows went through the kernel
    monkeypatch.setenv("PANTHEON_ATTN_KERNEL", "0")
    n = len(calls)
    assert greedy_tokens(wide, PROMPTS, kinds) == kernel
    assert len(calls) == n  # and here they did not


def test_bf16_speculation_is_greedy_bit_for_bit(tiny_model):
    """Verify rows (k + 1 decode rows of one sequence) each read their own length in the kernel,
    as the plain decode steps do: greedy with speculation equals greedy without in bf16."""
    prompt = [[11, 12, 13, 14, 15, 16] * 6]
    plain = greedy_tokens(tiny_model, prompt, dtype="bfloat16", n=40)
    spec = greedy_tokens(tiny_model, prompt, dtype="bfloat16", n=40, speculative=4)
    assert spec == plain


def test_dataclass_copy_keeps_the_lens():
    b, _rows = decode_batch([5, 9], 16)
    moved = b.to(torch.device("cpu")).decode_lens
    assert moved is not None and b.decode_lens is not None and torch.equal(moved, b.decode_lens)
    assert dataclasses.replace(b, decode_blocks=None).decode_lens is not None
