"""Paged attention on a CUDA die, in Triton: decode rows (flash-decoding, ``paged_decode``) and
prefill chunks (flash attention, ``paged_prefill``) attend to the paged KV pool where it lies,
with no per-step copy of their context (the torch paths gather every cached K/V row of every
row or chunk into a dense tensor, per layer and step).

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

``paged_prefill`` is what ``attention.prefill_kernel`` calls for a CUDA step's prefill chunks
(``paged_attention`` and ``sinks.paged_sink_attention``) when every chunk is a plain paged one
(its block ids known, no mask, no window's view): all of them in one launch, one program per
(KV head, query tile), a tile being ``block_m`` positions of one chunk x the group's query heads
(``prefill_config``); a small table of tiles (``prefill_tiles``) is cut on the host once per
step (``StepBatch.prefill_tiles``) and reused by every layer. Prefill steps are not captured in
CUDA graphs, so host-side metadata costs one small copy a step and nothing else.

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

from workers.kernels.kv_quant import KvRows

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


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: the kernels run in Triton's interpreter, on CPU tensors (tests)."""
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
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
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


# --- prefill ---------------------------------------------------------------------------------------


class PrefillSpan(NamedTuple):
    """One prefill chunk of a step's flat batch: its query rows ``[start, end)`` in q, its
    sequence's first position ``p0`` (the context cached before the chunk; the chunk's queries
    are positions p0 .. p0 + end - start - 1, their K/V already in the pool), and its block ids
    ``blocks`` ([nb] ints, a CPU tensor or a list, at least ceil((p0 + end - start) / block size)
    of them: position p in pool row ``blocks[p // bs] * bs + p % bs``)."""

    start: int
    end: int
    p0: int
    blocks: torch.Tensor | list[int]


class PrefillTiles(NamedTuple):
    """A step's prefill chunks cut into query tiles, on q's device (``prefill_tiles``): ``tiles``
    [n, 5] int32 (the chunk's first row in the batch, the tile's first query in its chunk, the
    chunk's length, its p0, its index in ``table``), the heaviest tiles (most keys) first;
    ``table`` [chunks, nb] int32 the chunks' block ids (padded with 0); ``block_m`` the query
    positions of a tile. Built once per step and reused by every layer of the same shape."""

    tiles: torch.Tensor
    table: torch.Tensor
    block_m: int


class PrefillConfig(NamedTuple):
    rows: int  # rows of a query tile (positions x the group's heads), a power of two
    block_m: int  # query positions of a tile: rows // G
    block_n: int  # key positions of a tile
    warps: int


def prefill_config(g: int, d: int, dtype: torch.dtype) -> PrefillConfig:
    """The prefill kernel's tiling for groups of ``g`` query heads, head width ``d``, ``dtype``:
    query tiles of 128 rows (64 at D = 256, and for fp32 at D = 128: the [rows, D] fp32 q, its
    accumulator and the scores stay in registers), each ``rows // g`` positions x the group's
    ``g`` heads, so each K/V tile read serves the whole group; key tiles of 64 positions (32 at
    D = 256)."""
    rows = 64 if d > 128 or (d == 128 and dtype == torch.float32) else 128
    rows = max(rows, triton_next_pow2(g))
    # 8 warps: with 4 a thread's share of q, the accumulator and the scores spills to local
    # memory (ptxas for sm_90, tests/helpers/triton_aot.py: a 768-byte stack frame at SmolLM2's
    # D 64 in bf16, 40 bytes with 8 warps; 1544 against 72 at D 128)
    warps = 8
    return PrefillConfig(rows, rows // g, 32 if d > 128 else 64, warps)


def prefill_tiles(spans: list[PrefillSpan], block_m: int, device: torch.device) -> PrefillTiles:
    """``spans`` cut into tiles of ``block_m`` query positions (``PrefillTiles``); one H2D copy."""
    tiles: list[tuple[int, int, int, int, int]] = []
    nb = max(1, max((len(s.blocks) for s in spans), default=1))
    table = torch.zeros(len(spans), nb, dtype=torch.int32)
    for i, s in enumerate(spans):
        n = s.end - s.start
        assert n >= 1 and s.p0 >= 0
        blocks = s.blocks if isinstance(s.blocks, torch.Tensor) else torch.tensor(s.blocks, dtype=torch.long)
        table[i, : len(blocks)] = blocks
        tiles += [(s.start, q, n, s.p0, i) for q in range(0, n, block_m)]
    # The tiles with most keys first (a tile's work is its last position): the short ones fill
    # the device's tail.
    tiles.sort(key=lambda t: -(t[3] + min(t[1] + block_m, t[2])))
    meta = torch.cat((torch.tensor(tiles, dtype=torch.int32).view(-1), table.view(-1)))
    # One copy, no stream sync: from pageable memory, cudaMemcpyAsync stages the bytes before it
    # returns, so ``meta`` may go at once.
    meta = meta.to(device, non_blocking=True)
    n_t = len(tiles) * 5
    return PrefillTiles(meta[:n_t].view(-1, 5), meta[n_t:].view(len(spans), nb), block_m)


def paged_prefill(
    q: torch.Tensor,
    k_cache: KvRows,
    v_cache: KvRows,
    spans: list[PrefillSpan],
    block_size: int,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of the prefill chunks ``spans`` of a flat batch over the paged pool, read
    where it lies (flash attention: no copy of their context). q: [N, H, D] pre-scaled (fp32 /
    bf16 / fp16), the chunks' rows among its N; k_cache, v_cache: [rows, KV, D] pools of q's
    dtype, holding every position of each chunk (its own included); sinks: [H] or None ->
    ``out`` ([N, H, D], q's dtype, last dim contiguous; a new tensor if None) with each chunk's
    rows written and the others left as they were. The query at position p attends to keys
    0 .. p of its sequence, in fp32 (exp2 online softmax), rounded once to q's dtype.
    ``tiles``: ``prefill_tiles(spans, prefill_config(...).block_m, q.device)`` built earlier
    (once per step); built here if None. The caller checks ``available()`` and ``reads(...)``."""
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)  # (``reads``)
    jit = _jit()
    _n, h, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    cfg = prefill_config(g, d, q.dtype)
    if tiles is None:
        tiles = prefill_tiles(spans, cfg.block_m, q.device)
    assert tiles.block_m == cfg.block_m, "tiles cut for another shape"
    qc = q if q.stride(-1) == 1 else q.contiguous()
    o = torch.empty_like(qc) if out is None else out
    assert o.shape == q.shape and o.dtype == q.dtype and o.stride(-1) == 1
    n_tiles = tiles.tiles.shape[0]
    if n_tiles == 0:
        return o
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    jit.prefill[(kv, n_tiles)](
        qc, k_cache, v_cache, tiles.table, tiles.tiles, sinks.contiguous() if sinks is not None else tiles.tiles, o,
        qc.stride(0), qc.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), tiles.table.stride(0), o.stride(0), o.stride(1),
        G=g, ROWS=cfg.rows, BLOCK_M=cfg.block_m, D=d, BS=block_size, BLOCK_N=cfg.block_n,
        HAS_SINKS=sinks is not None, PRECISION=precision,
        num_warps=cfg.warps, num_stages=2,
    )  # fmt: skip
    return o
