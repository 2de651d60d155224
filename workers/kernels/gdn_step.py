"""Typed wrapper of the gated-delta decode step kernel (``gated_delta.c``): each sequence's
recurrent state updated in place, in the slots' pool, in one read and one write of it (torch's
ops take three reads and two writes: ``workers/layers/gated_delta.py``).

``recurrent_gated_delta_step`` calls it on the CPU when ``available()`` (built, and not switched
off with ``PANTHEON_GDN_KERNEL=0``, read at each call); inside a ``torch.compile`` trace through
the custom op ``pantheon::gdn_step`` (which mutates the pool).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from workers.kernels.build import load

_P = ctypes.c_void_p
_L = ctypes.c_int64


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    return load(
        "gated_delta",
        "gated-delta step kernel unavailable, decode keeps torch's ops",
        {
            "gd_step": (ctypes.c_int, [_P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, ctypes.c_int]),
            "gd_max_dv": (ctypes.c_int, None),
        },
    )


@torch.compiler.assume_constant_result
def _built() -> bool:
    """The kernel is built and loaded (a constant to a ``torch.compile`` trace: no graph break
    on the build's file checks)."""
    return _load()[0] is not None


MAX_DV = 1024  # gated_delta.c's MAX_DV (its stack buffers); checked against it at load in _step


def available() -> bool:
    """Built, and not switched off (``PANTHEON_GDN_KERNEL=0``)."""
    return os.environ.get("PANTHEON_GDN_KERNEL", "1") != "0" and _built()


def fits(pool: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel takes this pool (CPU, contiguous fp32 [S, H, Dk, Dv]) and these values."""
    return (
        pool.device.type == "cpu"
        and pool.dtype == torch.float32
        and pool.dim() == 4
        and pool.is_contiguous()
        and v.shape[-1] <= MAX_DV
    )


def step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token for each of B sequences: q, k [B, H, Dk] fp32 (normalised, one head per value
    head), v [B, H, Dv], g, beta [B, H]; ``pool`` [S, H, Dk, Dv] fp32 (``fits``), sequence b's
    state slot ``slots[b]`` (int64 [B]; None: slot b), updated in place. Returns out [B, H, Dv]
    fp32 (q^T of each new state)."""
    if torch.compiler.is_compiling():
        return torch.ops.pantheon.gdn_step(q, k, v, g, beta, pool, slots)
    return _step(q, k, v, g, beta, pool, slots)


def _step(q, k, v, g, beta, pool, slots) -> torch.Tensor:
    lib = _load()[0]
    assert lib is not None and lib.gd_max_dv() == MAX_DV, "callers check available() first"
    b, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    s = None if slots is None else slots.to(torch.int64).contiguous()
    if (s is None and pool.shape[0] < b) or (
        s is not None and (s.numel() != b or (b and not 0 <= int(s.min()) <= int(s.max()) < pool.shape[0]))
    ):
        raise ValueError(f"gated-delta step: {b} sequences, pool of {pool.shape[0]} slots, slots {s}")
    out = torch.empty(b, h, dv, dtype=torch.float32)
    rc = lib.gd_step(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        g.data_ptr(),
        beta.data_ptr(),
        pool.data_ptr(),
        None if s is None else s.data_ptr(),
        out.data_ptr(),
        b,
        h,
        dk,
        dv,
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(
            f"gated-delta step kernel refused q {tuple(q.shape)}, v {tuple(v.shape)} (code {rc})"
        )
    return out


@torch.library.custom_op("pantheon::gdn_step", mutates_args=("pool",))
def _gdn_step_custom(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    return _step(q, k, v, g, beta, pool, slots)


@_gdn_step_custom.register_fake
def _(q, k, v, g, beta, pool, slots) -> torch.Tensor:
    return v.new_empty(v.shape, dtype=torch.float32)
