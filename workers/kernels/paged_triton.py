"""Paged decode attention on a CUDA die, in Triton: decode rows attend to the paged KV pool where
it lies (flash-decoding), with no per-step copy of their context (the torch path gathers every
cached K/V row of every row into a dense tensor, per layer and step).

``paged_decode`` is what ``workers/layers/attention.py``'s ``decode_attention`` calls for a CUDA
step when ``available()`` and ``reads(...)``; anything else keeps the torch path (quantized rows
among them). ``PANTHEON_ATTN_KERNEL=0`` forces the torch path, as for the CPU kernel
(``paged.py``; read at each call).

Same semantics as ``paged.paged_decode``; how it runs (``paged_triton_jit``): each row's context
is cut into partitions of ``part`` positions; one program per (row, KV head, partition) reads
its positions' K/V once for the group's ``G`` query heads (``tl.dot`` on [G_PAD, D] queries,
the group padded to 16 rows: tensor cores, and decode is bound by the K/V bytes, so the padding
costs no time) and writes a partial (output, log-sum-exp); a second kernel merges a row's
partials and the head's sink. The partition count comes from shapes only (batch, KV heads, the
table's width, the block size, the device's SM count), never from the lengths' values: no host
sync, so a CUDA graph can hold the call; programs past a row's length do nothing.

Triton is imported lazily (``_jit``): importing this module, as attention.py does on every die,
never imports it, and the CPU engine never calls anything that does. Under ``TRITON_INTERPRET=1``
the kernels also take CPU tensors (the tests drive them through Triton's interpreter).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import NamedTuple

import torch

from workers.layers.kv_quant import KvRows

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_D, MAX_D = 16, 256  # head widths: powers of two (tl.arange), 16 at least (tl.dot's K and N)
MAX_G = 64  # query heads per KV head: the group's [G_PAD, D] fp32 accumulator lives in registers
MIN_PART = 128  # positions of a partition at least: below it a program's fixed costs (its q,
# its partial's store and merge) weigh on a read of a few KB
PROGRAMS_PER_SM = 4  # partitions are cut so that a step has ~this many programs per SM
_INTERPRETER_SMS = 4  # what the CPU "device" counts as SMs under the interpreter


class Scratch(NamedTuple):
    """The partials between the two kernels, for ``n`` partitions: ``o`` [B, H, n, D] fp32 (each
    partition's normalized output), ``lse`` [B, H, n] fp32 (its log2-sum-exp2). A caller that
    preallocates (a CUDA graph) sizes them with ``split`` and ``scratch``; a larger ``n`` is fine."""

    o: torch.Tensor
    lse: torch.Tensor


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton() -> tuple[ModuleType | None, str]:
    """Triton, or why not (imported once, at the first CUDA step that asks)."""
    try:
        return importlib.import_module("triton"), ""
    except Exception as e:  # not installed, or broken (a wheel without its CUDA pieces)
        return None, f"triton not importable ({type(e).__name__}: {e})"


def _jit() -> ModuleType:
    """The kernels' module (importing it imports triton)."""
    return importlib.import_module("workers.kernels.paged_triton_jit")


def available() -> bool:
    """Triton imports and the kernel is not switched off (``PANTHEON_ATTN_KERNEL=0``)."""
    return os.environ.get("PANTHEON_ATTN_KERNEL", "1") != "0" and _triton()[0] is not None


def describe() -> str:
    """How decode attention runs on a CUDA die: ``triton: VERSION`` or ``torch: why``."""
    if os.environ.get("PANTHEON_ATTN_KERNEL", "1") == "0":
        return "torch: PANTHEON_ATTN_KERNEL=0"
    mod, why = _triton()
    return f"triton: {mod.__version__}" if mod is not None else f"torch: {why}"


def reads(q: torch.Tensor, k_cache: KvRows, v_cache: KvRows) -> bool:
    """Whether the kernel takes these: q on CUDA (or the CPU under ``TRITON_INTERPRET=1``),
    plain contiguous fp32 / bf16 / fp16 pools of q's dtype on q's device (quantized rows keep the
    torch path), a head width that is a power of two in 16..256, at most ``MAX_G`` query heads
    per KV head."""
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _interpreting()):
        return False
    if q.dim() != 3 or q.dtype not in _DTYPES:
        return False
    for c in (k_cache, v_cache):
        if type(c) is not torch.Tensor or c.dim() != 3 or c.dtype != q.dtype or c.device != q.device:
            return False
        if not c.is_contiguous():
            return False
    rows, kv, d = k_cache.shape
    h = q.shape[1]
    if v_cache.shape != k_cache.shape or q.shape[2] != d or kv == 0 or h % kv or h // kv > MAX_G:
        return False
    return MIN_D <= d <= MAX_D and d & (d - 1) == 0


def _block_n(d: int) -> int:
    """Positions per tile: [BLOCK_N, D] K and V tiles of 16 KB at D = 128 (bf16); half as many
    positions at D = 256, so that two pipeline stages of both stay well inside shared memory."""
    return 32 if d > 128 else 64


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split(bsz: int, kv: int, nb: int, block_size: int, d: int, device: torch.device) -> tuple[int, int]:
    """(positions per partition, partitions per row) for ``bsz`` rows of ``kv`` KV heads over
    block tables of ``nb`` blocks of ``block_size``: enough programs to fill the device
    (``PROGRAMS_PER_SM`` a SM) when the batch alone does not, partitions of ``MIN_PART``
    positions at least, whole tiles. From shapes only: a CUDA graph captured at a batch and
    table width replays with the same split."""
    t = max(1, nb * block_size)  # the longest a row can be
    tile = _block_n(d)
    want = -(-_sms(device) * PROGRAMS_PER_SM // max(1, bsz * kv))  # partitions per row wanted
    part = max(MIN_PART, -(-t // want))
    part = -(-part // tile) * tile
    return part, -(-t // part)


def scratch(bsz: int, h: int, d: int, n_parts: int, device: torch.device) -> Scratch:
    """Uninitialized partials for ``n_parts`` partitions (the kernels write before they read)."""
    return Scratch(
        torch.empty(bsz, h, n_parts, d, dtype=torch.float32, device=device),
        torch.empty(bsz, h, n_parts, dtype=torch.float32, device=device),
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: KvRows,
    v_cache: KvRows,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scratch_: Scratch | None = None,
    part: int | None = None,
) -> torch.Tensor:
    """Attention of each decode row over its own positions. q: [B, H, D] pre-scaled (fp32 / bf16
    / fp16); k_cache, v_cache: [rows, KV, D] pools of q's dtype; block_table: [B, nb] int32 /
    int64 (position p of row b in pool row ``block_table[b, p // block_size] * block_size + p %
    block_size``); lens: [B] int32 / int64, each >= 1 (row b reads positions < lens[b]); sinks:
    [H] or None -> [B, H, D] in q's dtype (``out`` if given: [B, H, D], q's dtype, last dim
    contiguous), accumulated in fp32. ``scratch_``: preallocated partials (``scratch``);
    ``part``: positions per partition (a multiple of the tile, 64 positions, 32 at D = 256;
    default ``split``'s). The caller checks ``available()`` and ``reads(...)`` first."""
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)  # (``reads``)
    jit = _jit()
    bsz, h, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    qc = q if q.stride(-1) == 1 else q.contiguous()  # (a no-op for the runner's q)
    tab = block_table if block_table.dtype in (torch.int32, torch.int64) else block_table.long()
    if tab.stride(-1) != 1:
        tab = tab.contiguous()
    ln = lens.contiguous()
    tile = _block_n(d)
    if part is None:
        part, n_parts = split(bsz, kv, tab.shape[1], block_size, d, q.device)
    else:
        assert part > 0 and part % tile == 0, f"a partition is whole tiles of {tile} positions"
        n_parts = -(-max(1, tab.shape[1] * block_size) // part)
    sc = scratch(bsz, h, d, n_parts, q.device) if scratch_ is None else scratch_
    assert sc.o.shape[:2] == (bsz, h) and sc.o.shape[2] >= n_parts and sc.o.shape[3] == d
    assert sc.lse.shape[:2] == (bsz, h) and sc.lse.shape[2] >= n_parts
    assert sc.o.stride(-1) == 1 and sc.o.dtype == sc.lse.dtype == torch.float32
    o = torch.empty_like(qc) if out is None else out
    assert o.shape == q.shape and o.dtype == q.dtype and o.stride(-1) == 1
    # The group padded to a power of two, 16 at least: tl.dot's smallest tile is 16 rows
    # (mma.sync m16n8k16); the pad rows are zero queries whose results are not stored.
    g_pad = max(16, triton_next_pow2(g))
    # fp32 pools: exact fp32 products (tl.dot's default on CUDA is TF32, 10-bit mantissas)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # 4 warps hold a [16, 128] fp32 accumulator and [64, 128] tiles comfortably; 8 at D = 256
    warps = 8 if d > 128 else 4
    jit.partials[(bsz, kv, n_parts)](
        qc, k_cache, v_cache, tab, ln, sc.o, sc.lse,
        qc.stride(0), qc.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), tab.stride(0),
        sc.o.stride(0), sc.o.stride(1), sc.o.stride(2), sc.lse.stride(0), sc.lse.stride(1),
        part,
        G=g, G_PAD=g_pad, D=d, BS=block_size, BLOCK_N=tile, PRECISION=precision,
        num_warps=warps, num_stages=2,
    )  # fmt: skip
    has_sinks = sinks is not None
    jit.merge[(bsz, h)](
        sc.o, sc.lse, ln, sinks.contiguous() if sinks is not None else ln, o,
        sc.o.stride(0), sc.o.stride(1), sc.o.stride(2), sc.lse.stride(0), sc.lse.stride(1),
        o.stride(0), o.stride(1),
        part,
        D=d, HAS_SINKS=has_sinks,
        num_warps=1 if d <= 128 else 2,
    )  # fmt: skip
    return o


def triton_next_pow2(n: int) -> int:
    """The least power of two >= n (``triton.next_power_of_2``, without importing triton)."""
    return 1 << max(0, n - 1).bit_length()
