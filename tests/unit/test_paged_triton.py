"""The Triton paged attention kernels (``workers/kernels/paged_triton.py``) against float64
references over the gathered rows and the torch paths they replace on a CUDA die: decode
(``attention._decode_by_rows``) and prefill (``paged_prefill``, through ``paged_attention`` and
``sinks.paged_sink_attention``).

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
from workers.kernels.kv_quant import QuantRows
from workers.layers import attention as A
from workers.layers import sinks as S

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
# a prefill chunk with its block ids (the runner's): the CPU path, no triton either
b.prefills = [A.PrefillChunk(2, 7, b.decode_gather[1, :5], None, blocks=b.decode_blocks[1])]
b.slot_mapping = torch.zeros(7, dtype=torch.long)
out = A.paged_attention(torch.randn(7, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64), b, kc, vc)
assert out.shape == (7, 4, 64) and not out.isnan().any()
assert "triton" not in sys.modules, "the CPU decode imported triton"
print("ok")
"""


def test_cpu_attention_never_imports_triton():
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


# --- prefill ------------------------------------------------------------------------------------


def _prefill_reference(q, kc, vc, spans, bs, sinks) -> dict[int, torch.Tensor]:
    """Float64 causal attention of each chunk's queries over its positions' rows (gathered through
    its blocks): chunk start -> [C, H, D]."""
    h, kv = q.shape[1], kc.shape[1]
    g = h // kv
    out = {}
    for sp in spans:
        n = sp.end - sp.start
        t = sp.p0 + n
        pos = torch.arange(t)
        rows = torch.as_tensor(sp.blocks).long()[pos // bs] * bs + pos % bs
        k = kc[rows].double().repeat_interleave(g, 1)  # [T, H, D]
        v = vc[rows].double().repeat_interleave(g, 1)
        scores = torch.einsum("chd,thd->hct", q[sp.start : sp.end].double(), k)  # [H, C, T]
        seen = pos[None, :] <= (sp.p0 + torch.arange(n))[:, None]  # [C, T]
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            scores = torch.cat((scores, sinks.double().view(h, 1, 1).expand(h, n, 1)), -1)
        out[sp.start] = torch.einsum("hct,thd->chd", torch.softmax(scores, -1)[..., :t], v)
    return out


def _prefill_spans(chunks: list[tuple[int, int]], bs: int, first_row: int, seed: int):
    """Spans of ``chunks`` ((p0, length) each) from row ``first_row`` of a flat batch, their
    sequences' blocks shuffled in a pool (block 0 and a few more unused); the pool's rows."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-(p0 + n) // bs) for p0, n in chunks]
    pool = sum(nbs) + 4
    perm = (torch.randperm(pool - 1, generator=g) + 1)[: sum(nbs)]
    spans, row, used = [], first_row, 0
    for (p0, n), nb in zip(chunks, nbs, strict=True):
        spans.append(PT.PrefillSpan(row, row + n, p0, perm[used : used + nb]))
        row, used = row + n, used + nb
    return spans, pool * bs


# (KV, G, D, block size, dtype, sinks)
PREFILL_CASES = [
    (1, 1, 16, 16, torch.float32, False),
    (2, 2, 64, 32, torch.bfloat16, True),
    (1, 4, 64, 16, torch.float32, True),
    (2, 4, 16, 32, torch.bfloat16, False),
    (2, 1, 64, 16, torch.bfloat16, True),
    (1, 2, 16, 16, torch.float16, True),
    (1, 2, 128, 32, torch.float32, False),  # fp32 at D 128: query tiles of 64 rows
    (2, 4, 128, 16, torch.bfloat16, False),  # Llama-3.1-8B's group and width: 32 positions x 4 heads
    (3, 3, 64, 16, torch.bfloat16, False),  # G 3 (SmolLM2's): a tile of 42 positions, 2 pad rows
    (1, 8, 256, 16, torch.bfloat16, True),  # D 256: key tiles of 32
    (1, 16, 16, 32, torch.float32, True),
]


def _prefill_ids(c) -> str:
    kv, g, d, bs, dt, sinks = c
    return f"kv{kv}g{g}d{d}bs{bs}{str(dt)[6:]}{'sinks' if sinks else ''}"


def _prefill_chunks(bs: int) -> list[tuple[int, int]]:
    """(p0, length): from 0, from a block multiple, from neither; lengths 1, 5, 64, 70."""
    return [(0, 70), (2 * bs, 64), (37, 5), (3 * bs + 5, 1), (0, 1), (bs, 70)]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_ids)
def test_prefill_kernel_equals_the_reference(interp, case):
    """Several chunks in one call, after 3 rows the kernel leaves alone (a step's decode rows):
    each chunk's rows equal the reference, every one written; the others untouched."""
    kv, g, d, bs, dt, with_sinks = case
    spans, rows = _prefill_spans(_prefill_chunks(bs), bs, 3, seed=d + g)
    n = spans[-1].end + 2
    torch.manual_seed(g * d)
    kc = torch.randn(rows, kv, d).to(dt)
    vc = torch.randn(rows, kv, d).to(dt)
    q = (torch.randn(n, kv * g, d) * d**-0.5 * 3).to(dt)  # * 3: peaked, like a real model's
    sinks = torch.randn(kv * g) if with_sinks else None
    assert PT.reads(q, kc, vc)
    out = torch.full_like(q, float("nan"))
    got = PT.paged_prefill(q, kc, vc, spans, bs, sinks, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dt
    assert out[:3].isnan().all() and out[-2:].isnan().all()  # rows of no chunk: untouched
    want = _prefill_reference(q, kc, vc, spans, bs, sinks)
    atol, rtol = TOL[dt]
    for sp in spans:
        o = out[sp.start : sp.end]
        assert not o.isnan().any(), f"chunk at {sp.p0}: rows not written"
        torch.testing.assert_close(o.double(), want[sp.start], atol=atol, rtol=rtol)


def test_prefill_tiles_heaviest_first():
    spans, _rows = _prefill_spans([(0, 70), (100, 5), (16, 1)], 16, 0, seed=1)
    t = PT.prefill_tiles(spans, 32, torch.device("cpu"))
    assert t.block_m == 32 and t.tiles.dtype == torch.int32 and t.table.shape == (3, 7)
    # (first row, first query, length, p0, chunk): the chunk at 100 first, then 70's tiles from the end
    assert t.tiles.tolist() == [
        [70, 0, 5, 100, 1], [0, 64, 70, 0, 0], [0, 32, 70, 0, 0], [0, 0, 70, 0, 0], [75, 0, 1, 16, 2],
    ]  # fmt: skip
    assert t.table[1].tolist() == spans[1].blocks.tolist()


def _step(chunks: list[tuple[int, int]], dec_lens: list[int], kv: int, d: int, bs: int, dt, seed: int):
    """A step as the runner builds one: decode rows of ``dec_lens`` then prefill chunks ((p0,
    length)), each sequence's blocks shuffled in the pool, every position's K/V in it but the
    step's own (written by the call); (batch, k, v, K pool, V pool)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(n - 1, 1) for n in dec_lens] + chunks  # (first position of the step, rows)
    nbs = [-(-(p0 + n) // bs) for p0, n in seqs]
    pool = sum(nbs) + 4
    perm = (torch.randperm(pool - 1, generator=g) + 1)[: sum(nbs)]
    tabs, used = [], 0
    for nb in nbs:
        tabs.append(perm[used : used + nb])
        used += nb
    torch.manual_seed(seed)
    kc = torch.randn(pool * bs, kv, d).to(dt)
    vc = torch.randn(pool * bs, kv, d).to(dt)
    nd = len(dec_lens)
    slots, pre, row = [], [], 0
    for i, ((p0, n), tab) in enumerate(zip(seqs, tabs, strict=True)):
        rows = tab[torch.arange(p0 + n) // bs] * bs + torch.arange(p0 + n) % bs
        slots.append(rows[p0:])
        if i >= nd:  # a prefill chunk: its positions' rows (the gather), its blocks
            pre.append(A.PrefillChunk(row, row + n, rows, None, blocks=tab))
        row += n
    dec_tab = torch.zeros(nd, max(nbs[:nd]), dtype=torch.long)
    for i in range(nd):
        dec_tab[i, : nbs[i]] = tabs[i]
    t = max(dec_lens)
    gather = (dec_tab[:, :, None] * bs + torch.arange(bs)).view(nd, -1)[:, :t]
    pad = torch.arange(t)[None, :] >= torch.tensor(dec_lens)[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :]
    b = A.StepBatch(
        torch.zeros(1), torch.zeros(1), torch.cat(slots), nd, gather, bias, pre,
        decode_blocks=dec_tab, block_size=bs, decode_lens=torch.tensor(dec_lens),
    )  # fmt: skip
    k = torch.randn(row, kv, d).to(dt)
    v = torch.randn(row, kv, d).to(dt)
    return b, k, v, kc, vc


def _plain(b: A.StepBatch) -> A.StepBatch:
    """``b`` without its chunks' block ids: the torch path's batch."""
    return A.StepBatch(
        b.rot_cos, b.rot_sin, b.slot_mapping, b.n_decode, b.decode_gather, b.decode_bias,
        [A.PrefillChunk(c.start, c.end, c.gather, None) for c in b.prefills],
        decode_blocks=b.decode_blocks, block_size=b.block_size, decode_lens=b.decode_lens,
    )  # fmt: skip


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_takes_the_prefill_kernel(interp, monkeypatch, dt, with_sinks):
    """Through ``paged_attention`` (``paged_sink_attention`` with sinks) on CPU tensors under the
    interpreter: decode rows and two prefill chunks (one with history, one from 0), against the
    torch path of the same step; the kernel runs once per layer call, its tiles cut once a step."""
    kv, g, d, bs = 2, 3, 64, 16
    b, k, v, kc, vc = _step([(40, 37), (0, 20)], [5, 40], kv, d, bs, dt, seed=7)
    torch.manual_seed(1)
    q = (torch.randn(k.shape[0], kv * g, d) * d**-0.5 * 3).to(dt)
    sinks = torch.randn(kv * g).to(dt) if with_sinks else None
    calls = []
    kernel = PT.paged_prefill
    monkeypatch.setattr(PT, "paged_prefill", lambda *a, **kw: calls.append(kw["tiles"]) or kernel(*a, **kw))

    def attend(batch, kc, vc):
        if sinks is None:
            return A.paged_attention(q, k, v, batch, kc, vc)
        return S.paged_sink_attention(q, k, v, batch, kc, vc, sinks)

    want = attend(_plain(b), kc.clone(), vc.clone())
    assert not calls
    got = attend(b, kc, vc)
    again = attend(b, kc, vc)  # a second layer: the same tiles
    assert len(calls) == 2 and calls[0] is calls[1] and list(b.prefill_tiles.values()) == [calls[0]]
    assert torch.equal(got, again)
    atol, rtol = TOL[dt]
    torch.testing.assert_close(got.float(), want.float(), atol=2 * atol, rtol=rtol)
    nd = b.n_decode
    assert torch.equal(got[:nd], want[:nd])  # the decode rows: the same path


def test_prefill_kernel_declines(interp):
    """A chunk without block ids, with a mask or a window's view keeps the caller's path; so do
    quantized rows."""
    b, k, v, kc, vc = _step([(16, 5)], [3], 1, 16, 16, torch.float32, seed=2)
    q = torch.randn(k.shape[0], 2, 16)
    out = torch.empty_like(q)
    assert A.prefill_kernel(q, b, kc, vc, out)
    c = b.prefills[0]
    for change in ({"blocks": None}, {"windowed": True}, {"mask": A.offset_causal_mask(16, 5, q.device)}):
        b.prefills = [A.PrefillChunk(**{**c.__dict__, **change})]
        assert not A.prefill_kernel(q, b, kc, vc, out)
    b.prefills = [c]
    kq = QuantRows.empty("q8_0", kc.shape[0], 1, 16, torch.device("cpu"))
    assert not A.prefill_kernel(q, b, kq, vc, out)


def test_engine_prefill_through_the_kernel(interp, model_factory, monkeypatch):
    """The runner's chunks carry their block ids: a CPU engine under the interpreter (the tiny
    Llama, fp32, prompts longer than the prefill chunk of 32) runs its prefill chunks through the
    kernel (counted, chunks with history among them; decode keeps the CPU path) and gets the
    torch path's greedy tokens."""
    path = str(model_factory("tiny-llama", dtype="float32"))
    prompts = [list(range(100, 160)), [64], list(range(10, 110))]
    spans: list[PT.PrefillSpan] = []
    kernel, dispatch = PT.paged_prefill, A.prefill_kernel
    monkeypatch.setattr(PT, "paged_prefill", lambda *a, **k: spans.extend(a[3]) or kernel(*a, **k))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(A, "prefill_kernel", dispatch if on else lambda *a, **k: False)
        eng = Engine(path, dtype="float32", kv_budget_bytes=4 << 20, prefill_chunk=32)
        for i, pr in enumerate(prompts):
            eng.submit(f"p{i}", pr, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        out[on] = drain(eng)
        assert bool(spans) == on
    assert any(sp.p0 > 0 for sp in spans) and max(sp.end - sp.start for sp in spans) <= 32
    assert out[False] == out[True]


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


@pytest.mark.gpu
def test_cuda_prefill_kernel_equals_the_torch_path(compiled):
    """Llama-3.1-8B's heads (32 q, 8 KV, D 128), bf16: prompts of 1 .. 4096 tokens in chunks of
    512, each step's chunks in one call beside 4 decode rows, against the torch path (the gather
    and SDPA, offset-causal after history); with sinks against ``paged_sink_attention``'s."""
    dev = torch.device("cuda:0")
    prompts = [1, 300, 1000, 4096]
    for step in range(8):
        chunks = [(step * 512, min(512, n - step * 512)) for n in prompts if n > step * 512]
        b, k, v, kc, vc = _step(chunks, [7, 2000, 1, 300], 8, 128, 16, torch.bfloat16, seed=step)
        b, k, v, kc, vc = b.to(dev), k.to(dev), v.to(dev), kc.to(dev), vc.to(dev)  # (blocks stay on the CPU)
        q = (torch.randn(k.shape[0], 32, 128, device=dev) * 128**-0.5 * 3).bfloat16()
        assert PT.available() and PT.reads(q, kc, vc)
        want = A.paged_attention(q, k, v, _plain(b), kc, vc)
        got = A.paged_attention(q, k, v, b, kc, vc)
        assert b.prefill_tiles  # the kernel ran
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1e-2)
        sinks = torch.randn(32, device=dev).bfloat16()
        want = S.paged_sink_attention(q, k, v, _plain(b), kc, vc, sinks)
        got = S.paged_sink_attention(q, k, v, b, kc, vc, sinks)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1e-2)
        for dt in (torch.float32, torch.float16):  # the other pools' dtypes (fp32: no TF32)
            qd, kd, vd, kcd, vcd = (x.to(dt) for x in (q, k, v, kc, vc))
            b.prefill_tiles.clear()
            want = A.paged_attention(qd, kd, vd, _plain(b), kcd.clone(), vcd.clone())
            got = A.paged_attention(qd, kd, vd, b, kcd, vcd)
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt][0] + 1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_engine_tokens_with_and_without_the_prefill_kernel(compiled, model_factory, monkeypatch):
    """Greedy tokens of the tiny Llama on cuda:0, fp32, prompts longer than the prefill chunk (32):
    chunks with history go through the kernel (counted) and give the torch path's tokens."""
    path = str(model_factory("tiny-llama", dtype="float32"))
    prompts = [list(range(100, 160)), [64], list(range(10, 300)), [5, 17, 300, 41] * 20]
    calls = []
    kernel = PT.paged_prefill
    monkeypatch.setattr(PT, "paged_prefill", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    out = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("PANTHEON_ATTN_KERNEL", switch)
        eng = Engine(path, devices=["cuda:0"], dtype="float32", kv_budget_bytes=4 << 20, prefill_chunk=32)
        for i, p in enumerate(prompts):
            eng.submit(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        out[switch] = drain(eng)
        assert bool(calls) == (switch == "1")
    assert out["0"] == out["1"]
