"""Typed wrapper of the GGUF dequantization kernel (``dequant.c``): a tensor's blocks -> float32 in
one native pass (``workers/gguf_blocks.py``'s ``dequantize`` calls it; its torch ops per chunk of
blocks are the fallback without a C compiler, or with ``PANTHEON_DEQUANT_KERNEL=0``, and the
values this is held to, bit for bit)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from workers.kernels.build import load

# dequant.c's type codes, in its enum's order
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    return load(
        "dequant",
        "GGUF dequantization kernel unavailable, loads unpack blocks with torch's ops",
        {
            "dq_blocks": (
                ctypes.c_int,
                [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int],
            ),
            "dq_int8_rows": (
                ctypes.c_int,
                [
                    ctypes.c_void_p,
                    ctypes.c_int,
                    ctypes.c_int64,
                    ctypes.c_int64,
                    *[ctypes.c_void_p] * 2,
                    ctypes.c_int,
                ],
            ),
            "dq_int8_rows_blocks": (
                ctypes.c_int,
                [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
                + [ctypes.c_void_p] * 2
                + [ctypes.c_int],
            ),
            "dq_grid_fit": (
                ctypes.c_int,
                [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, *[ctypes.c_void_p] * 3, ctypes.c_int],
            ),
            "dq_q4_pack": (
                ctypes.c_int,
                [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
                + [ctypes.c_void_p] * 2
                + [ctypes.c_int],
            ),
        },
    )


def available() -> bool:
    """Built, and not switched off (``PANTHEON_DEQUANT_KERNEL=0``, read at each call)."""
    return os.environ.get("PANTHEON_DEQUANT_KERNEL", "1") != "0" and _load()[0] is not None


def takes(type_name: str) -> bool:
    """``available()``, and ``type_name`` one of the block formats it unpacks (``TYPES``)."""
    return type_name in TYPES and available()


def blocks(raw: torch.Tensor, type_name: str, out: torch.Tensor) -> None:
    """Fill ``out`` ([n, block] float32, contiguous) from ``raw`` ([n, block bytes] uint8, the
    file's bytes) for a type of ``TYPES``; callers check ``available()`` first."""
    lib = _load()[0]
    assert lib is not None, "callers check available() first"
    if raw.dtype != torch.uint8 or out.dtype != torch.float32 or raw.shape[0] != out.shape[0]:
        raise ValueError(
            f"dequantize {type_name}: {raw.dtype} {tuple(raw.shape)} into {out.dtype} {tuple(out.shape)}"
        )
    if not (raw.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"dequantize {type_name}: the bytes and the output must be contiguous")
    rc = lib.dq_blocks(
        TYPES.index(type_name), raw.data_ptr(), raw.shape[0], out.data_ptr(), torch.get_num_threads()
    )
    if rc:
        raise ValueError(f"dequantize kernel refused {type_name} (code {rc})")


def grid_fit(w: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``workers.quant._grid_fit`` in one native pass a group (the same levels, steps and
    minima): groups w [R, 32] float32 -> (levels [R, 32], step [R], lowest [R], all fit)."""
    lib = _load()[0]
    assert lib is not None, "callers check available() first"
    w = w.float().contiguous()
    if w.dim() != 2 or w.shape[1] != 32:
        raise ValueError(f"grid fit takes groups [R, 32], got {tuple(w.shape)}")
    r = w.shape[0]
    q, step, lo = torch.empty(r, 32), torch.empty(r), torch.empty(r)
    fits = lib.dq_grid_fit(
        w.data_ptr(), r, tol, q.data_ptr(), step.data_ptr(), lo.data_ptr(), torch.get_num_threads()
    )
    return q, step, lo, bool(fits)


def q4_groups(w: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``workers.quant.q4_groups`` of a weight on 4-bit grids in one native pass (``grid_fit``'s
    fit, then the kernel's packing): w [N, K] float32 -> (qs [N, K/2] uint8, dm [N, 2, K/32]
    fp16), the same bytes; None when some group is on no grid."""
    return _q4_pack(w, tol, affine=False)


def q4_affine(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``workers.quant.q4_groups`` of a weight off the 4-bit grids (``_affine_groups``' min/max fit
    to fp16 scales) in one native pass: w [N, K] float32 -> (qs, dm), the same bytes."""
    packed = _q4_pack(w, 0.0, affine=True)
    assert packed is not None  # (every group has a min/max grid)
    return packed


def _q4_pack(w: torch.Tensor, tol: float, affine: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    lib = _load()[0]
    assert lib is not None, "callers check available() first"
    w = w.float().contiguous()
    n, k = w.shape
    qs = torch.empty(n, k // 2, dtype=torch.uint8)
    dm = torch.empty(n, 2, k // 32, dtype=torch.float16)
    rc = lib.dq_q4_pack(
        w.data_ptr(), n, k, tol, int(affine), qs.data_ptr(), dm.data_ptr(), torch.get_num_threads()
    )
    if rc == 2:
        raise ValueError(f"int4 groups take [N, K] with K in 32s, got {tuple(w.shape)}")
    return (qs, dm) if rc == 1 else None


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``workers.quant.int8_rows``'s int8 rows and fp32 scales of ``w`` ([N, K] fp32 or bf16,
    contiguous, on the CPU), in one native pass (the same values); callers check
    ``available()`` first."""
    lib = _load()[0]
    assert lib is not None, "callers check available() first"
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous():
        raise ValueError(f"int8 rows of {w.dtype} {tuple(w.shape)}: a contiguous fp32 / bf16 [N, K] weight")
    n, k = w.shape
    q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float32)
    kind = 1 if w.dtype == torch.bfloat16 else 0
    rc = lib.dq_int8_rows(w.data_ptr(), kind, n, k, q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"int8 rows kernel refused {w.dtype} {tuple(w.shape)} (code {rc})")
    return q, scale


def int8_rows_blocks(
    raw: torch.Tensor, type_name: str, k: int, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 rows and fp32 scales of a GGUF tensor held as its blocks (``raw`` [N, K / block,
    block bytes] uint8, contiguous), each row unpacked as ``blocks`` unpacks it (then rounded to
    bf16 when ``bf16``: the values a bf16 model's dense copy would hold); callers check
    ``available()`` first."""
    lib = _load()[0]
    assert lib is not None, "callers check available() first"
    if raw.dtype != torch.uint8 or raw.dim() != 3 or not raw.is_contiguous():
        raise ValueError(
            f"int8 rows of {type_name} blocks {raw.dtype} {tuple(raw.shape)}: contiguous [N, B, bytes] uint8"
        )
    n = raw.shape[0]
    q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float32)
    rc = lib.dq_int8_rows_blocks(
        TYPES.index(type_name),
        raw.data_ptr(),
        n,
        k,
        int(bf16),
        q.data_ptr(),
        scale.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"int8 rows kernel refused {type_name} blocks {tuple(raw.shape)} (code {rc})")
    return q, scale
