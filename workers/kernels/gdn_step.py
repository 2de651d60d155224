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

from workers.kernels.build import FLOAT_KINDS, load

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
            "gd_decode": (
                ctypes.c_int,
                [*[_P] * 9, *[ctypes.c_int] * 4, *[_L] * 7, ctypes.c_float, ctypes.c_int],
            ),
            "gd_runs": (
                ctypes.c_int,
                [*[_P] * 10, *[ctypes.c_int] * 4, *[_L] * 7, ctypes.c_float, ctypes.c_int],
            ),
        },
    )


_BUILT: bool | None = None  # whether the kernel built and loaded, settled at the first ask


def _built() -> bool:
    """The kernel is built and loaded. Settled once, at the first call (eager: the layers ask
    before any step runs); a ``torch.compile`` trace then reads a constant global, with no graph
    break on the build's file checks. (``torch.compiler.assume_constant_result`` did the same,
    and importing it brought in ``torch._dynamo`` at the model's load: 1.5 s of a Qwen3.5 load
    on a 2-core Zen 5, where a compiled step imports it later, in the background.)"""
    global _BUILT
    if _BUILT is None:
        _BUILT = _load()[0] is not None
    return _BUILT


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
    if slots is None and pool.shape[0] < b:
        raise ValueError(f"gated-delta step: {b} sequences, pool of {pool.shape[0]} slots")
    s = None if slots is None else _slots(slots, b, pool, "gated-delta step")
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


def _slots(slots: torch.Tensor, b: int, pool: torch.Tensor, what: str) -> torch.Tensor:
    """``slots`` as the kernels read them (int64, contiguous), checked: one a sequence, each a slot
    of ``pool`` [S, ...] (the C code indexes the pool with them unchecked)."""
    s = slots.to(torch.int64).contiguous()
    if s.numel() != b or (b and not 0 <= int(s.min()) <= int(s.max()) < pool.shape[0]):
        raise ValueError(f"{what}: {b} sequences, pool of {pool.shape[0]} slots, slots {s}")
    return s


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


# ---------------------------------------------------------------- the whole decode step

MAX_TAPS = 16  # gated_delta.c's GD_MAX_K


def decode_fits(proj: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, dk: int, dv: int) -> bool:
    """``decode`` takes these: CPU tensors, in_proj rows and the conv pool contiguous in fp32 or
    bf16, the state pool contiguous fp32, heads the stack buffers hold, not inside a trace."""
    return (
        not torch.compiler.is_compiling()
        and available()
        and proj.device.type == "cpu"
        and proj.dtype in FLOAT_KINDS
        and conv.dtype == proj.dtype
        and proj.is_contiguous()
        and conv.is_contiguous()
        and conv.shape[-1] + 1 <= MAX_TAPS
        and ssm.dtype == torch.float32
        and ssm.is_contiguous()
        and dk <= MAX_DV
        and dv <= MAX_DV
    )


def decode(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
    heads: tuple[int, int, int, int],
    eps: float,
    runs: list[tuple[int, int, bool]] | None = None,
) -> torch.Tensor:
    """Everything a Qwen3.5 linear-attention layer does to its rows between in_proj and
    out_proj (``gated_delta.c``): ``proj`` [N, P] the in_proj rows (``decode_fits``),
    ``conv_weight`` [C, K], ``conv`` [S, C, K-1] and ``ssm`` [S, Hv, Dk, Dv] the slots' pools,
    updated in place; ``heads`` (Hk, Hv, Dk, Dv). Without ``runs``: N decode rows, row b of the
    sequence in slot ``slots[b]`` (gd_decode). With ``runs``: sequence b's rows are ``runs[b]`` =
    (first row, rows, fresh), its consecutive tokens from its slot's states (zeros first when
    fresh), each row as a decode step (gd_runs: a prefill chunk's result is the token-by-token
    decode's, to the bit); the runs must not overlap, and rows of no run are left unwritten.
    Returns the gated-norm output [N, Hv * Dv] in proj's dtype, what out_proj takes."""
    lib = _load()[0]
    assert lib is not None, "callers check decode_fits() first"
    hk, hv, dk, dv = heads
    n = proj.shape[0]
    b = n if runs is None else len(runs)
    c, taps = conv_weight.shape
    # each in its own kind where the kernel reads it (read as fp32 there, as the torch path
    # widens them): no conversion on the step's path for a model's fp32 or bf16 parameters
    w, nw = (
        t.contiguous() if t.dtype in FLOAT_KINDS else t.float().contiguous()
        for t in (conv_weight, norm_weight)
    )
    a, dt = a_log, dt_bias
    if a.dtype != dt.dtype or a.dtype not in FLOAT_KINDS:
        a, dt = a.float(), dt.float()
    a, dt = a.contiguous(), dt.contiguous()
    s = _slots(slots, b, ssm, "gated-delta decode")
    out = torch.empty(n, hv * dv, dtype=proj.dtype)
    args = [proj.data_ptr(), w.data_ptr(), conv.data_ptr(), a.data_ptr(), dt.data_ptr(), nw.data_ptr()]
    args += [ssm.data_ptr(), s.data_ptr()]
    if runs is not None:  # the C code indexes proj and out by them unchecked
        if any(r0 < 0 or r < 0 or r0 + r > n for r0, r, _ in runs):
            raise ValueError(f"gated-delta runs {runs} outside {n} rows")
        table = torch.tensor([[r0, r, int(fresh)] for r0, r, fresh in runs], dtype=torch.int64)
        args.append(table.data_ptr())
    args += [out.data_ptr(), FLOAT_KINDS[proj.dtype], FLOAT_KINDS[w.dtype], FLOAT_KINDS[a.dtype]]
    args += [FLOAT_KINDS[nw.dtype], b, c, taps, hk, hv, dk, dv, eps, torch.get_num_threads()]
    rc = (lib.gd_decode if runs is None else lib.gd_runs)(*args)
    if rc:
        raise ValueError(f"gated-delta decode kernel refused proj {tuple(proj.shape)} (code {rc})")
    return out
