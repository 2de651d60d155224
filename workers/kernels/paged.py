"""Typed wrapper of the paged decode-attention kernel (``paged_decode.c``): decode rows attend
to the paged KV pool where it lies, with no per-step copy of their context.

``paged_decode`` is what ``workers/layers/attention.py``'s ``decode_attention`` calls on the CPU
when ``available()`` and both caches are of a kind the kernel ``reads``; anything else keeps the
torch path. ``PANTHEON_ATTN_KERNEL=0`` forces the torch path (read at each call: tests switch it).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from workers.kernels.build import load
from workers.kernels.kv_quant import KvRows, QuantRows

# The kernel's element kinds (paged_decode.c's enum)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_QUANT = {"q8_0": 3, "q4_0": 4}  # fp8_e4m3 is CUDA-only: the torch path reads it
MAX_G, MAX_D = 32, 512  # the kernel's stack buffers: query heads per KV head, head width
# Positions x KV heads of a step below which the kernel runs on the calling thread alone: a
# parallel region's start and join cost more than they save under this. bench/paged_kernel.py
# --threshold, 2-core Xeon (AVX-512), bf16, SmolLM2's 3 KV heads x 64, batch 1, host load ~8:
# serial / 2 threads 0.0115 / 0.0127 ms at 48, 0.0163 / 0.0155 at 192, 0.0234 / 0.0213 at 384,
# 0.0597 / 0.0461 at 1536. The break-even is ~200; 512 leaves room for a loaded host, where a
# parallel region also waits for a descheduled thread.
MIN_PARALLEL = 512

_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_int64


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    args = [_P, _I, _P, _P, _I, _P, _P, _I, _P, _I, _L, _P, _I, _L, _L, _L, _L, _L, _P, _P, _I, _L]
    return load(
        "paged_decode",
        "paged decode kernel unavailable, attention keeps its torch path",
        {"pd_paged_decode": (_I, args), "pd_omp_max_threads": (_I, None)},
    )


def status() -> str:
    """Where the kernel came from (``built``/``cached`` + path), or why it is not there."""
    return _load()[1]


def describe() -> str:
    """How decode attention runs in this process: ``kernel: built|cached PATH`` or ``torch: why``
    (shown in ``/admin/dies``). Switched off, the kernel is not built."""
    if os.environ.get("PANTHEON_ATTN_KERNEL", "1") == "0":
        return "torch: PANTHEON_ATTN_KERNEL=0"
    lib, why = _load()
    return f"kernel: {why}" if lib is not None else f"torch: {why}"


def library() -> ctypes.CDLL | None:
    return _load()[0]


def available() -> bool:
    """The kernel is built and not switched off (``PANTHEON_ATTN_KERNEL=0``)."""
    return os.environ.get("PANTHEON_ATTN_KERNEL", "1") != "0" and _load()[0] is not None


def _kind(cache: KvRows) -> int | None:
    if isinstance(cache, QuantRows):
        return _QUANT.get(cache.kind)
    return _DTYPES.get(cache.dtype)


def reads(q: torch.Tensor, k_cache: KvRows, v_cache: KvRows) -> bool:
    """Whether the kernel takes these: CPU tensors, pools of a kind it reads, contiguous,
    head shapes its buffers hold."""
    rows, kv, d = k_cache.shape
    h = q.shape[1]
    if q.device.type != "cpu" or q.dtype not in _DTYPES or h % kv or h // kv > MAX_G:
        return False
    if d % 16 or d > MAX_D or _kind(k_cache) is None or _kind(v_cache) is None:
        return False
    for c in (k_cache, v_cache):
        parts = (c.data, c.scales) if isinstance(c, QuantRows) else (c,)
        if c.device.type != "cpu" or not all(t.is_contiguous() for t in parts):
            return False
    return True


def _ptrs(cache: KvRows) -> tuple[int, int | None, int]:
    if isinstance(cache, QuantRows):
        return cache.data.data_ptr(), cache.scales.data_ptr(), _QUANT[cache.kind]
    return cache.data_ptr(), None, _DTYPES[cache.dtype]


def paged_decode(
    q: torch.Tensor,
    k_cache: KvRows,
    v_cache: KvRows,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each decode row over its own positions. q: [B, H, D] pre-scaled (fp32 / bf16
    / fp16); k_cache, v_cache: [rows, KV, D] pools (or ``QuantRows``); block_table: [B, nb]
    int64/int32 (position p of row b in pool row ``block_table[b, p // block_size] *
    block_size + p % block_size``); lens: [B] int64/int32 (row b reads positions < lens[b]);
    sinks: [H] or None -> [B, H, D] in q's dtype. The caller checks ``available()`` and
    ``reads(...)`` first."""
    lib = library()
    assert lib is not None
    half = q.dtype == torch.float16  # the kernel's q and output: fp32 or bf16
    qc = (q.float() if half else q).contiguous()
    o = torch.empty_like(qc) if out is None or half else out
    bsz, h, d = qc.shape
    tab = block_table if block_table.dtype in (torch.int32, torch.int64) else block_table.long()
    tab, ln = tab.contiguous(), lens.contiguous()
    sk = None if sinks is None else sinks.float().contiguous()
    kp, ks, kk = _ptrs(k_cache)
    vp, vs, vk = _ptrs(v_cache)
    rc = lib.pd_paged_decode(
        qc.data_ptr(), _DTYPES[qc.dtype], kp, ks, kk, vp, vs, vk,
        tab.data_ptr(), int(tab.dtype == torch.int32), tab.shape[1],
        ln.data_ptr(), int(ln.dtype == torch.int32),
        bsz, h, k_cache.shape[1], d, block_size,
        None if sk is None else sk.data_ptr(), o.data_ptr(),
        torch.get_num_threads(), MIN_PARALLEL,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"paged decode kernel refused its arguments (code {rc})")
    if half:
        o = o.half() if out is None else out.copy_(o)
    return o
