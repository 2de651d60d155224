"""Weight-only quantization of the linear layers, applied after load.

- ``Int8Linear``: each output row gets one scale (absmax / 127), so a [N, K] bf16 weight becomes
  an int8 [N, K] matrix plus N scales: about half the bytes, and decode on a CPU is bound by
  bytes read. The CPU path uses ``torch._weight_int8pack_mm`` (int8 weights, bf16 activations)
  when K (in-features) is a multiple of ``INT8_KERNEL_K``; elsewhere, and for other K, the weight
  is widened per call, which keeps the memory saving if not the speed.
- ``Int4Linear`` (CPU only): every 32 weights of a row get a scale and a zero (4-bit affine
  groups, what GGUF's Q4_0 / Q4_1 / Q4_K blocks are): about a quarter of bf16's bytes.
  Requantizing a 4-bit file's dequantized weights this way gives back its own levels, up to the
  scales' rounding. Run by our kernel (``workers/kernels/qlinear.py``: integer dot products
  against int8 activations, 1.5-1.9x torch's at one row) where it is built, else by torch's int4
  CPU kernel (``_weight_int4pack_mm_for_cpu``); each has its own packing, chosen at build.
- Both run ``qlinear``'s kernel where it is built (``Int8Linear`` reading its own layout), for
  every number of rows: a row's output depends on that row alone (see qlinear.py).
- ``QuantExperts``: a mixture of experts' stacked ``[E, N, K]`` matrices in the same layouts (int8
  rows, or int4 groups where the kernel takes the shape), quantized one expert at a time and
  stacked (``[E, N, K]`` int8 / ``[E, N, K/2]`` packed int4 and their scales), each expert's
  block contiguous: running expert ``e`` (``experts[e](x)``, the same kernels as the linears)
  reads only its own bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.core.sizing import INT4_GROUP, int4_fits
from workers.kernels import dequant as dequant_kernel
from workers.kernels import qlinear

# torch's int8 CPU kernel (2.13, AVX-512) reads K in steps of 16 with no tail: probed in
# subprocesses over K = 8..4000, it is right for every multiple of 16 (16 included) and for no other
# K: wrong sums (K = 8, 24, 40, 136, ...) or a segfault (K = 12, 31, 100). N and M do not matter.
INT8_KERNEL_K = 16


class Int8Linear(nn.Module):
    weight: torch.Tensor  # buffers, declared for the type checker (nn.Module's getattr is untyped)
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None):
        """``weight``: dense [N, K], or its int8 rows and scales already made (``int8_rows_of``)."""
        super().__init__()
        q, scale = int8_rows(weight) if isinstance(weight, torch.Tensor) else weight  # [N, K] int8, [N]
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.kernel = self.in_features % INT8_KERNEL_K == 0  # see INT8_KERNEL_K
        self.ours = q.device.type == "cpu" and qlinear.fits(self.in_features) and qlinear.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]
        if self.ours and x.device.type == "cpu":
            y = qlinear.q8_linear_op(x, self.weight, self.scale)
        elif self.kernel and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            y = torch._weight_int8pack_mm(x, self.weight, self.scale)  # pyright: ignore[reportPrivateImportUsage]  # the int8 CPU kernel
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


def int4_pack(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit levels ``q`` [N, K] (0..15) with each group's ``scale`` and lowest value ``lo``
    [N, K/32] (a weight is ``lo + q * scale``) -> (the int4 kernel's packed weight [N, K/2] uint8,
    its ``scales_zeros`` [K/32, N, 2] bf16). The kernel dequantizes ``(q - 8) * scale + zero``."""
    zero = lo + 8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()


def _affine_groups(
    weight: torch.Tensor, stored: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] weight in 4-bit affine groups of 32, each group's lowest and highest value its
    first and last level: (levels [N, G, 32] 0..15 as floats, scale [N, G], lowest [N, G]).
    ``stored``: the dtype the scale and lowest value are kept in, rounded to it before the levels
    are fitted (so the levels fit what a kernel will read)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)  # [N, G, 32]
    lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    if stored is not None:
        scale, lo = scale.to(stored).float(), lo.to(stored).float()
    return torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15), scale, lo


def _grid_fit(w: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``on_grid``'s fit of groups w [R, 32]: (levels [R, 32], step [R], lowest [R], all fit)."""
    lo = w.amin(dim=1)
    span = w.amax(dim=1) - lo
    # a constant group is level 0 (step 1) as it is
    step = torch.where(span > 0, span / 15, torch.ones_like(span))
    q = (w - lo[:, None]).div_(step[:, None])
    fit = (q - q.round()).abs_().amax(dim=1) <= tol  # L = 15 on every group at once
    q.round_()
    todo = torch.nonzero(~fit).flatten()
    for levels in range(14, 0, -1):  # the rest on the groups left, each on a coarser grid
        if todo.numel() == 0:
            break
        d = span[todo] / levels
        wq = (w[todo] - lo[todo, None]) / d[:, None]
        r = torch.round(wq)
        ok = ((wq - r).abs() <= tol).all(dim=1)
        q[todo[ok]], step[todo[ok]] = r[ok], d[ok]
        todo = todo[~ok]
    return q, step, lo, todo.numel() == 0


GRID_TOL = 1e-3  # a value within this many steps of a level is on it (``on_grid``)


def on_grid(
    weight: torch.Tensor, tol: float = GRID_TOL, sample: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Whether every group of 32 of a [N, K] weight lies on a 4-bit affine grid already (a
    4-bit file's dequantized levels: Q4_0, Q4_1, Q4_K), and the grid: (levels [N, G, 32] 0..15
    as floats, step [N, G], lowest value [N, G]); None when some group does not (a Q5_K / Q6_K /
    Q8_0 tensor, or float weights).

    A group's values are ``lo + q * step`` with q spanning some L <= 15 levels between its
    lowest and highest value (Q4_K's fitted scales need not use levels 0 and 15, so the min/max
    fit of ``_affine_groups`` would move their values): L = 15, 14, ... 1 are tried, each on the
    groups no larger L fitted, and a group fits when every value is within ``tol`` of a step of
    its level. Any L that fits represents the values exactly (a finer grid than the file's own
    when it divides it). ``sample`` groups spread over the weight are tried first: a tensor off
    the grid is told from them without 15 passes over all of it."""
    n, k = weight.shape
    g = k // INT4_GROUP
    w = weight.detach().float().reshape(n * g, INT4_GROUP)  # [N*G, 32]
    # one native pass a group where the kernel builds (the same levels; the torch ops pass over
    # the whole weight ~8 times, then again over the groups left: 2.3 s of a Q4_K_M 0.8B's load)
    fit = dequant_kernel.grid_fit if dequant_kernel.available() else _grid_fit
    if w.shape[0] > sample and not fit(w[:: w.shape[0] // sample], tol)[3]:
        return None
    q, step, lo, fits = fit(w, tol)
    if not fits:
        return None
    return q.view(n, g, INT4_GROUP), step.view(n, g), lo.view(n, g)


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight in 4-bit affine groups of 32 (``_affine_groups``): ``int4_pack``'s
    (packed weight, scales_zeros), torch's int4 kernel's layout."""
    q, scale, lo = _affine_groups(weight)
    return int4_pack(q.reshape(weight.shape), scale, lo)


def grid_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A [N, K] weight whose every group of 32 lies on a 4-bit grid (``on_grid``: a 4-bit file's
    levels) in our kernel's layout (``q4_groups``'); None when some group does not. One native
    pass, fit and packing, where the kernel builds and the weight is fp32 (the int4 path's)."""
    if _packs_natively(weight):
        return dequant_kernel.q4_groups(weight.detach(), GRID_TOL)
    grid = on_grid(weight)
    return None if grid is None else _q4_pack(*grid)


def q4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight in 4-bit affine groups of 32 (its own grid where it is on one,
    ``grid_groups``: a 4-bit file's levels, its scales and minima rounded to fp16; else
    ``_affine_groups``, fitted to fp16 scales) in our kernel's layout
    (workers/kernels/qmatmul.c): (qs [N, K/2] uint8, byte j of a group holding level j low and
    level j + 16 high; dm [N, 2, K/32] fp16, the groups' scales, then minima)."""
    packed = grid_groups(weight)
    if packed is not None:
        return packed
    if _packs_natively(weight):
        return dequant_kernel.q4_affine(weight.detach())  # the same fit, one native pass
    return _q4_pack(*_affine_groups(weight, torch.float16))


def _packs_natively(weight: torch.Tensor) -> bool:
    """Whether the kernel fits and packs ``weight``: built, and an fp32 weight on the CPU (the
    int4 path's)."""
    return dequant_kernel.available() and weight.device.type == "cpu" and weight.dtype == torch.float32


def _q4_pack(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels q [N, G, 32] (0..15, as floats), scale and lowest value [N, G] -> ``q4_groups``'
    (qs, dm)."""
    n, g, _ = q.shape
    q = q.to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return qs.reshape(n, g * 16).contiguous(), torch.stack([scale, lo], dim=1).half().contiguous()


_ROWS_VALUES = 1 << 16  # fp32 values a chunk of int8_rows works on (256 KB: in L2)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight as int8 rows (one scale a row, absmax / 127), as ``Int8Linear`` holds it:
    (int8 [N, K], scales [N] in the weight's dtype). In chunks of rows: the whole weight in fp32
    at once is 4 bytes a weight more at a load's peak (1 GB for a 248k-token head), and six
    passes over it from memory instead of from the cache (a 0.8B model's load spent 4.4 s here)."""
    w = weight.detach()
    if (
        dequant_kernel.available()
        and w.device.type == "cpu"
        and w.dtype in (torch.float32, torch.bfloat16)
        and w.is_contiguous()
    ):
        q, scale = dequant_kernel.int8_rows(w)  # one native pass, the same rows and scales
        return q, scale.to(w.dtype)
    return int8_rows_of(lambda a, b: w[a:b], w.shape[0], w.shape[1], w.dtype, w.device)


def int8_rows_of(
    rows: Callable[[int, int], torch.Tensor], n: int, k: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_rows`` of a [n, k] weight of ``dtype`` that exists a run of rows at a time:
    ``rows(a, b)`` gives rows [a, b) (a token table held as its blocks unpacks them then, and the
    whole table in its dtype is never made)."""
    q = torch.empty(n, k, dtype=torch.int8, device=device)
    scale = torch.empty(n, dtype=torch.float32, device=device)
    step = max(1, _ROWS_VALUES // max(1, k))
    for r in range(0, n, step):
        c = rows(r, min(n, r + step)).float()  # [rows, K] (the weight itself when it is fp32: not written)
        s = c.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [rows]
        q[r : r + step] = torch.round(c / s[:, None]).clamp_(-127, 127)
        scale[r : r + step] = s
    return q, scale.to(dtype)


class Int4Linear(nn.Module):
    """A linear layer in 4-bit groups of 32, in our kernel's packing (``ours``) or torch's."""

    weight: torch.Tensor  # [N, K/2] uint8: two 4-bit levels a byte, in the kernel's packing
    scales_zeros: torch.Tensor  # torch's: [K/32, N, 2] bf16, each group's scale and zero
    scales_mins: torch.Tensor  # ours: [N, 2, K/32] fp16, each row's group scales, then minima
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """``packed``: the weight in our kernel's layout (``grid_groups``), when the caller has it."""
        super().__init__()
        n, k = weight.shape
        if not int4_fits(n, k):
            raise ValueError(f"int4 needs N % 16 == 0 and K % {INT4_GROUP} == 0, got [{n}, {k}]")
        self.ours = qlinear.fits(k) and qlinear.available()
        if self.ours:
            qs, dm = packed if packed is not None else q4_groups(weight)
            self.register_buffer("weight", qs)
            self.register_buffer("scales_mins", dm)
        else:
            qs, scales = int4_groups(weight.to(torch.bfloat16))
            self.register_buffer("weight", qs)
            self.register_buffer("scales_zeros", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] bf16 -> [M, N]
        if not self.ours:  # torch's kernel takes bf16 scales and activations alike (16-bit scales
            # whatever the path's dtype: what sizing books)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.weight, INT4_GROUP, self.scales_zeros
            ).to(x.dtype)
        else:
            y = qlinear.q4_linear_op(x, self.weight, self.scales_mins)
        return y if self.bias is None else y + self.bias


def replace_linears(
    module: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
) -> None:
    """Swap every ``nn.Linear`` under ``module`` for ``make(weight, bias)``, in place (here, not
    in ``cpu_paths``, which imports this module: no import cycle)."""
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, make(sub.weight, sub.bias))


def quantize_int8(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` inside the decoder layers in place (the LM head stays).

    Used on CUDA dies; CPU dies reach the same layout through ``cpu_paths`` ("int8").
    """
    for layer in cast("Iterable[nn.Module]", model.layers):
        replace_linears(layer, Int8Linear)  # in the weights' own dtype


# A [N, K] weight -> the int4 kernel's (packed weight, scales_zeros): ``int4_groups``, or
# ``workers.mxfp4.int4_from_fp4`` (its grid fitted to FP4's levels: the former holding of MXFP4
# experts, bench/mxfp4_experts.py's baseline; they are held as MXFP4 now)
Int4Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class QuantExperts(nn.Module):
    """``E`` stacked ``[N, K]`` matrices (a mixture of experts' gate_up or down) quantized as the
    CPU paths' linears are: int8 rows (``Int8Linear``'s), or int4 groups (``Int4Linear``'s kernel)
    when ``layout`` is "int4" and the kernel takes ``[N, K]`` (else int8 rows, as the int4 path's
    linears). One expert is quantized at a time into the stack (``put``), so a load holds one
    expert's float copy at most beside it; ``fill=False``: the stacks made empty, for a loader
    that puts each expert's pieces as they arrive (``weights`` then gives only the shape, dtype
    and device: ``loader._experts_on_arrival``). ``experts[e](x)``: x [M, K] (bf16 on CPU) ->
    [M, N], reading only expert ``e``'s block. Where our kernel is built (``ours``), int4 groups
    in its layout (``q4_groups``: a 4-bit file's own grid kept) and int8 rows both go through
    it, and ``stack()`` hands the whole stack to ``qlinear.experts`` (a MoE layer's experts in
    one call)."""

    # torch's int8 CPU kernel sums wrongly (or crashes) unless K is a multiple of 16 (torch 2.13:
    # K = 24, 40 wrong, 100 a segfault); other K widen the expert's int8 rows per call
    INT8_KERNEL_K = 16
    weight: torch.Tensor  # [E, N, K] int8 | [E, N, K/2] uint8 (int4, the kernel's packing)
    # [E, N] (int8 rows, the weights' dtype) | int4: [E, N, 2, K/32] fp16 (ours) or
    # [E, K/32, N, 2] bf16 (torch's)
    scales: torch.Tensor

    def __init__(
        self, weights: torch.Tensor, layout: str, int4: Int4Quantizer = int4_groups, fill: bool = True
    ):
        super().__init__()
        if layout not in ("int8", "int4"):
            raise ValueError(f"experts are quantized to int8 or int4, not {layout!r}")
        e, n, k = weights.shape
        self.int4 = layout == "int4" and int4_fits(n, k)
        # our kernel (not for another int4 quantizer: bench/mxfp4_experts.py's fitted baseline)
        self.ours = qlinear.fits(k) and qlinear.available() and (not self.int4 or int4 is int4_groups)
        self.quantizer = int4
        self.num_experts, self.out_features, self.in_features = e, n, k
        # int4 groups in our layout (fp16 scales, the file's grid where it has one), or from bf16
        # for torch's kernel (bf16 scales: 16-bit whatever the path's dtype, as sizing books
        # them); int8 rows keep a scale in the weights' dtype
        dev, g = weights.device, k // INT4_GROUP
        if self.int4 and self.ours:
            weight = torch.empty(e, n, k // 2, dtype=torch.uint8, device=dev)
            scales = torch.empty(e, n, 2, g, dtype=torch.float16, device=dev)
        elif self.int4:
            weight = torch.empty(e, n, k // 2, dtype=torch.uint8, device=dev)
            scales = torch.empty(e, g, n, 2, dtype=torch.bfloat16, device=dev)
        else:
            weight = torch.empty(e, n, k, dtype=torch.int8, device=dev)
            scales = torch.empty(e, n, dtype=weights.dtype, device=dev)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        if fill:
            for i in range(e):
                self.put(i, 0, weights[i])

    @property
    def takes_rows(self) -> bool:
        """Whether ``put`` takes an expert a run of rows at a time: int8 rows (a scale a row) and
        our int4 groups (32 values of one row) do; torch's int4 packing takes whole matrices."""
        return not self.int4 or self.ours

    def put(self, e: int, row: int, w: torch.Tensor) -> None:
        """Rows ``[row, row + r)`` of expert ``e``'s matrix, from ``w`` [r, K] in the weights'
        dtype, quantized into the stack (a run of rows gets the levels and scales its whole
        matrix would: every layout here is per row, and a 4-bit grid is found per group)."""
        r = w.shape[0]
        if not self.takes_rows:  # torch's int4 packing (scales [K/32, N, 2]): a whole matrix
            if (row, r) != (0, self.out_features):
                raise ValueError("torch's int4 packing takes an expert's whole matrix")
            self.weight[e], self.scales[e] = self.quantizer(w.to(torch.bfloat16))
            return
        q, s = q4_groups(w) if self.int4 else int8_rows(w)
        self.weight[e, row : row + r], self.scales[e, row : row + r] = q, s

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, e: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: self.mm(e, x)

    def mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ expert ``e``'s [N, K]^T -> [M, N]."""
        if self.ours and x.device.type == "cpu":
            if self.int4:
                return qlinear.q4_linear_op(x, self.weight[e], self.scales[e])
            return qlinear.q8_linear_op(x, self.weight[e], self.scales[e])
        if self.int4:  # bf16 activations, as its scales (the fp32 int4 path widens the result)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.weight[e], INT4_GROUP, self.scales[e]
            )
            return y.to(x.dtype)
        if (
            x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and self.in_features % self.INT8_KERNEL_K == 0
        ):
            return torch._weight_int8pack_mm(x, self.weight[e], self.scales[e])  # pyright: ignore[reportPrivateImportUsage]  # the int8 CPU kernel
        return F.linear(x, self.weight[e].to(x.dtype)) * self.scales[e].to(x.dtype)

    def stack(self) -> qlinear.Stack | None:
        """The stack as ``qlinear.experts`` takes it, when our kernel holds it."""
        if not self.ours:
            return None
        return qlinear.Stack("int4" if self.int4 else "int8", self.weight, self.scales)

    def expert_bytes(self) -> int:
        """Bytes of one expert's matrix as held (its levels and scales)."""
        return (
            self.weight[0].numel() * self.weight.element_size()
            + self.scales[0].numel() * self.scales.element_size()
        )
