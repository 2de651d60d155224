"""Typed wrapper of the quantized linear kernel (``qmatmul.c``): int4-group and int8-row weights
times activation rows, by integer dot products against int8 activations (VNNI / AVX2, a scalar
fallback), or for int4 against fp32 ones (the default) or bf16 ones (AVX512_BF16):
``PANTHEON_LINEAR_ACTIVATIONS``, ``activations()``.

``workers/quant.py``'s ``Int4Linear`` and ``Int8Linear`` call it on the CPU for every step,
decode rows and prefill chunks alike, when ``available()``: each output row depends on its own
input row only, so a request's tokens never depend on the rows beside it, on how its prompt was
chunked nor on what the prefix cache held (a float product of the dequantized weight for the
many rows of a prefill would be ~5x faster there, and round each row differently from its
decode step). ``PANTHEON_LINEAR_KERNEL=0`` keeps torch's kernels (read when a layer is built:
a loaded model keeps the layout it was built with).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from workers.kernels.build import FLOAT_KINDS, load

log = logging.getLogger("pantheon.worker")

GROUP = 32  # weights per int4 group, activations per int8 group (qmatmul.c's QK)

_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_int64


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    return load(
        "qmatmul",
        "quantized linear kernel unavailable, linears keep torch's kernels",
        {
            "qm_q4_linear": (_I, [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]),
            "qm_q8_linear": (_I, [_P, _I, _L, _L, _P, _P, _I, _L, _P, _I, _I]),
            "qm_q4_linear_bf16": (_I, [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]),
            "qm_q4_linear_f32": (_I, [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]),
            "qm_q8_linear_f32": (_I, [_P, _I, _L, _L, _P, _P, _I, _L, _P, _I, _I]),
            "qm_mxfp4_linear": (_I, [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]),
            "qm_experts": (
                _I,
                [_P, _I, _L, _L, _L, _I, _P, _P, _L, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I]
                + [ctypes.c_float, ctypes.c_float, _P, _I, _I],
            ),
            "qm_has_bf16": (_I, None),
            "qm_isa": (ctypes.c_char_p, None),
        },
    )


def library() -> ctypes.CDLL | None:
    return _load()[0]


def has_bf16() -> bool:
    """The build has the int4 x bf16 kernel (AVX512_BF16)."""
    lib = _load()[0]
    return lib is not None and bool(lib.qm_has_bf16())


ACTIVATIONS = ("fp32", "bf16", "int8")


@functools.cache
def activations() -> str:
    """How int4 linears meet their activations (``PANTHEON_LINEAR_ACTIVATIONS``):

    - ``fp32``, the default, every build: as they are, against the levels widened to fp32 (the
      dequantized weight's fp32 product up to the order of sums): the same answers on every
      host. Issue 40: rounding the activations (to int8 or bf16) is a step function, so two
      hosts' kernels, differing only in the order of their float sums, step differently, and a
      small model carries that to its logits: the default model's greedy answer to "What is the
      capital of France?" was Paris on one ISA and "L'Étoile" on another;
    - ``bf16`` (AVX512_BF16 builds; else fp32): rounded to bf16, vdpbf16ps;
    - ``int8``: quantized per group of 32, integer dot products, as llama.cpp's ``q4_1 x q8_1``:
      the fastest, and llama.cpp's answers (bench/qlinear.py, bench/linear_quality.py)."""
    want = os.environ.get("PANTHEON_LINEAR_ACTIVATIONS", "fp32").strip() or "fp32"
    if want not in ACTIVATIONS:
        log.warning("PANTHEON_LINEAR_ACTIVATIONS=%r is not one of %s: fp32", want, ", ".join(ACTIVATIONS))
        return "fp32"
    if want == "bf16" and not has_bf16():
        log.warning("PANTHEON_LINEAR_ACTIVATIONS=bf16: this build has no AVX512_BF16 kernel: fp32")
        return "fp32"
    return want


def q4_entry(lib: ctypes.CDLL, acts: str | None = None):
    """The kernel's int4 entry point for ``acts`` (default: ``activations()``)."""
    return {"fp32": lib.qm_q4_linear_f32, "bf16": lib.qm_q4_linear_bf16, "int8": lib.qm_q4_linear}[
        acts or activations()
    ]


def q8_entry(lib: ctypes.CDLL, acts: str | None = None):
    """The kernel's int8-row entry point for ``acts``: int8 activations only for "int8" (the
    bf16 kernel is int4's alone: int8 rows meet bf16 activations widened to fp32)."""
    return lib.qm_q8_linear if (acts or activations()) == "int8" else lib.qm_q8_linear_f32


def available() -> bool:
    """Built, and not switched off (``PANTHEON_LINEAR_KERNEL=0``)."""
    return os.environ.get("PANTHEON_LINEAR_KERNEL", "1") != "0" and _load()[0] is not None


def describe() -> str:
    """``kernel ISA, int4 x bf16|int8 activations: built|cached PATH`` or ``torch: why``
    (``/admin/dies``)."""
    if os.environ.get("PANTHEON_LINEAR_KERNEL", "1") == "0":
        return "torch: PANTHEON_LINEAR_KERNEL=0"
    lib, why = _load()
    if lib is None:
        return f"torch: {why}"
    return f"kernel {isa()}, int4 x {activations()} activations: {why}"


def isa() -> str:
    """The dot product the built kernel uses: avx512vnni | avxvnni | avx2 | scalar."""
    lib = _load()[0]
    return "none" if lib is None else lib.qm_isa().decode()


def _lib() -> ctypes.CDLL:
    lib = _load()[0]
    assert lib is not None, "callers check available() first"
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: contiguous fp32 or bf16 (another float dtype widened to fp32)."""
    return x.contiguous() if x.dtype in FLOAT_KINDS else x.float().contiguous()


def _matmul(
    fn: Callable[..., int], x: torch.Tensor, n: int, weights: tuple[int, ...], what: str
) -> torch.Tensor:
    """One of the kernel's entry points over x [M, K] (fp32 / bf16; others widened to fp32) ->
    [M, N] in that dtype; ``weights``: the entry point's arguments between K and N."""
    xr = _rows(x)
    m, k = xr.shape
    y = torch.empty(m, n, dtype=xr.dtype)
    rc = fn(
        xr.data_ptr(),
        FLOAT_KINDS[xr.dtype],
        m,
        k,
        *weights,
        n,
        y.data_ptr(),
        FLOAT_KINDS[y.dtype],
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"{what} linear kernel refused x {tuple(x.shape)}, W [{n}, {k}] (code {rc})")
    return y


def q4_linear(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, acts: str | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N]; W int4 groups (``workers.quant.q4_groups``). ``acts``: how the
    activations are met, "fp32" | "bf16" | "int8" (default: ``activations()``)."""
    fn = q4_entry(_lib(), acts)
    return _matmul(fn, x, qs.shape[0], (qs.data_ptr(), dm.data_ptr()), "int4")


def q8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, acts: str | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N]; W int8 rows w [N, K], scales ws [N] (fp32 / bf16); ``acts`` as
    ``q4_linear``'s."""
    s = ws if ws.dtype in FLOAT_KINDS else ws.float()
    fn = q8_entry(_lib(), acts)
    return _matmul(fn, x, w.shape[0], (w.data_ptr(), s.data_ptr(), FLOAT_KINDS[s.dtype]), "int8")


def mxfp4_linear(x: torch.Tensor, qs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N]; W in MXFP4 blocks of 32 (``workers.mxfp4``): qs [N, K/2] uint8
    (byte j of a block: value j's FP4 code low, j + 16's high), e [N, K/32] uint8 (each block's
    e8m0 exponent). The activations as they are (fp32; bf16 widened): the dequantized weight's
    product up to the order of the sums, on every build."""
    return _matmul(_lib().qm_mxfp4_linear, x, qs.shape[0], (qs.data_ptr(), e.data_ptr()), "MXFP4")


class Stack(NamedTuple):
    """``E`` experts' matrices ``[N, K]`` as one of the fp32-activation kernels holds them:
    ``kind`` "int4" (``a`` levels [E, N, K/2] uint8, ``b`` scales and minima [E, N, 2, K/32]
    fp16: ``q4_groups``'), "int8" (``a`` rows [E, N, K] int8, ``b`` scales [E, N] fp32 / bf16)
    or "mxfp4" (``a`` codes [E, N, K/2] uint8, ``b`` exponents [E, N, K/32] uint8)."""

    kind: str
    a: torch.Tensor
    b: torch.Tensor


_STACK_KINDS = {"int4": 6, "int8": 9, "mxfp4": 10}
GLUS = {"silu": 0, "clamped": 1}  # qmatmul.c's GLU_SILU, GLU_CLAMPED


def experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: Stack,
    down: Stack,
    glu: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A MoE layer's routed experts in one call (``qm_experts``): x [M, H] (fp32 / bf16), ids
    [M, k] (int64, each in [0, E)), weights [M, k] -> sum_j weights[m, j] * expert_{ids[m, j]}(x[m])
    [M, H] in x's dtype, each expert ``down @ glu(gate_up @ x + gate_up_bias) + down_bias`` with
    gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I] in the same kind, biases
    [E, 2I] / [E, H] or None. ``glu``: "silu" (silu(gate) * up) or "clamped" (gpt-oss's, with
    ``alpha`` and ``limit``). Everything between the matrices in fp32; the activations met as
    they are (the fp32-activation kernels'); an id out of range is refused (ValueError)."""
    if gate_up.kind != down.kind or gate_up.kind not in _STACK_KINDS:
        raise ValueError(f"experts in {gate_up.kind!r} and {down.kind!r}: one of {', '.join(_STACK_KINDS)}")
    for t in (gate_up.a, gate_up.b, down.a, down.b):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"experts kernel: its stacks are contiguous CPU tensors, got one on {t.device}")
    xr = _rows(x)
    m, h = xr.shape
    e, two_i = gate_up.a.shape[0], gate_up.a.shape[1]
    if down.a.shape[0] != e or down.a.shape[1] != h:
        raise ValueError(
            f"experts kernel: gate_up {tuple(gate_up.a.shape)} and down {tuple(down.a.shape)} for x {tuple(x.shape)}"
        )
    inter = two_i // 2
    k = ids.shape[1]
    ids_c = ids.to(torch.int64).contiguous()
    w_c = weights.float().contiguous()
    biases = [
        bias if bias is None or bias.dtype in FLOAT_KINDS else bias.float()
        for bias in (gate_up_bias, down_bias)
    ]
    bkinds = {FLOAT_KINDS[bias.dtype] for bias in biases if bias is not None}
    sb = gate_up.b if gate_up.kind != "int8" or gate_up.b.dtype in FLOAT_KINDS else gate_up.b.float()
    db = down.b if down.kind != "int8" or down.b.dtype in FLOAT_KINDS else down.b.float()
    skind = FLOAT_KINDS[sb.dtype] if gate_up.kind == "int8" else 0
    if len(bkinds) > 1 or (gate_up.kind == "int8" and db.dtype != sb.dtype):
        raise ValueError("the experts' biases (and int8 scales) must share one float kind")
    gb, dnb = (None if bias is None else bias.contiguous() for bias in biases)
    y = torch.empty(m, h, dtype=xr.dtype)
    rc = _lib().qm_experts(
        xr.data_ptr(),
        FLOAT_KINDS[xr.dtype],
        m,
        h,
        inter,
        k,
        ids_c.data_ptr(),
        w_c.data_ptr(),
        e,
        _STACK_KINDS[gate_up.kind],
        gate_up.a.data_ptr(),
        sb.data_ptr(),
        down.a.data_ptr(),
        db.data_ptr(),
        skind,
        None if gb is None else gb.data_ptr(),
        None if dnb is None else dnb.data_ptr(),
        bkinds.pop() if bkinds else 0,
        GLUS[glu],
        alpha,
        limit,
        y.data_ptr(),
        FLOAT_KINDS[y.dtype],
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(
            f"experts kernel refused x {tuple(x.shape)}, {e} experts of [{two_i}, {h}] / [{h}, {inter}]"
            f" in {gate_up.kind}, ids in [{int(ids.min())}, {int(ids.max())}] (code {rc})"
        )
    return y


def experts_op(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: Stack,
    down: Stack,
    glu: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``experts``, or inside a ``torch.compile`` trace the custom op that calls it."""
    if not torch.compiler.is_compiling():
        return experts(x, ids, weights, gate_up, down, glu, alpha, limit, gate_up_bias, down_bias)
    return torch.ops.pantheon.experts(
        x,
        ids,
        weights,
        gate_up.kind,
        gate_up.a,
        gate_up.b,
        down.a,
        down.b,
        glu,
        alpha,
        limit,
        gate_up_bias,
        down_bias,
    )


def _leading(
    op: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """``op`` (a kernel over [M, K] rows) over x [..., K] -> [..., N]; a 2-D x as it is (a view is
    a dispatch)."""
    if x.dim() == 2:
        return op(x, w, s)
    return op(x.reshape(-1, x.shape[-1]), w, s).view(*x.shape[:-1], w.shape[0])


def q4_linear_op(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """``q4_linear`` over x [..., K], or inside a ``torch.compile`` trace the custom op that calls
    it (the compiled decode step runs it as an opaque call; eager calls skip the dispatcher)."""
    return _leading(torch.ops.pantheon.q4_linear if torch.compiler.is_compiling() else q4_linear, x, qs, dm)


def q8_linear_op(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``q8_linear``, as ``q4_linear_op``."""
    return _leading(torch.ops.pantheon.q8_linear if torch.compiler.is_compiling() else q8_linear, x, w, ws)


def mxfp4_linear_op(x: torch.Tensor, qs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``mxfp4_linear``, as ``q4_linear_op``."""
    return _leading(
        torch.ops.pantheon.mxfp4_linear if torch.compiler.is_compiling() else mxfp4_linear, x, qs, e
    )


@torch.library.custom_op("pantheon::q4_linear", mutates_args=())
def _q4_linear_custom(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    return q4_linear(x, qs, dm)


@_q4_linear_custom.register_fake
def _(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qs.shape[0], dtype=x.dtype if x.dtype in FLOAT_KINDS else torch.float32)


@torch.library.custom_op("pantheon::q8_linear", mutates_args=())
def _q8_linear_custom(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return q8_linear(x, w, ws)


@_q8_linear_custom.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], dtype=x.dtype if x.dtype in FLOAT_KINDS else torch.float32)


@torch.library.custom_op("pantheon::mxfp4_linear", mutates_args=())
def _mxfp4_linear_custom(x: torch.Tensor, qs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return mxfp4_linear(x, qs, e)


@_mxfp4_linear_custom.register_fake
def _(x: torch.Tensor, qs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qs.shape[0], dtype=x.dtype if x.dtype in FLOAT_KINDS else torch.float32)


@torch.library.custom_op("pantheon::experts", mutates_args=())
def _experts_custom(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    kind: str,
    gu_a: torch.Tensor,
    gu_b: torch.Tensor,
    dn_a: torch.Tensor,
    dn_b: torch.Tensor,
    glu: str,
    alpha: float,
    limit: float,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> torch.Tensor:
    return experts(
        x,
        ids,
        weights,
        Stack(kind, gu_a, gu_b),
        Stack(kind, dn_a, dn_b),
        glu,
        alpha,
        limit,
        gate_up_bias,
        down_bias,
    )


@_experts_custom.register_fake
def _(
    x, ids, weights, kind, gu_a, gu_b, dn_a, dn_b, glu, alpha, limit, gate_up_bias, down_bias
) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], dtype=x.dtype if x.dtype in FLOAT_KINDS else torch.float32)


MAX_K = 32768  # qmatmul.c's MAX_G groups of 32: its per-thread scale buffer


def fits(k: int) -> bool:
    """In-features the kernel takes (whole groups of 32, at most ``MAX_K``)."""
    return GROUP <= k <= MAX_K and k % GROUP == 0
