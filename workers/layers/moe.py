"""A mixture-of-experts MLP: router -> top-k experts (SwiGLU, weights stacked ``[E, ...]``) ->
weighted sum, plus an optional shared expert behind a sigmoid gate (Qwen3.5-MoE's).

The experts' gated activation (``GLU``) is ``silu(gate) * up`` unless a family says otherwise:
gpt-oss's ``ClampedSwiGLU`` (gate clamped above at ``limit``, up to +-``limit``,
``(up + 1) * gate * sigmoid(alpha * gate)``); gpt-oss's experts also have biases
(``expert_bias``: ``gate_up_bias [E, 2I]``, ``down_bias [E, H]``), added after each product.

Routing (``route``), the variants the families need:

- ``softmax``: softmax over all experts' logits, then the top k, renormalised to sum to 1 when
  ``norm_topk_prob`` (Qwen3-MoE, Qwen3.5-MoE, as transformers' ``Qwen3MoeTopKRouter``);
- ``topk_softmax``: the top k logits, then a softmax over those k (gpt-oss, Mixtral);
- a router bias (gpt-oss) is the router linear's own bias.

The experts' weights are stacked parameters (``gate_up [E, 2I, H]``: gate rows then up rows per
expert; ``down [E, H, I]``), each expert's block contiguous, so running one expert reads only its
own bytes. ``experts_forward`` groups the step's (token, expert) assignments by expert: sorted
once, then one matrix product per *active* expert over its group of tokens (CPU, and CUDA
without a grouped GEMM), or one ``torch._grouped_mm`` over all groups (CUDA, bf16, when this
torch has it and the shapes are aligned). A decode step of one token thus reads ``top_k``
experts, not ``E``: the point of a mixture of experts.

The router (``Router``) stays dense in the model's dtype on every path, as llama.cpp keeps
``ffn_gate_inp`` in F32: its logits pick each token's experts, and int8 rows' rounding moved a
near-tied top-k choice (a different expert, not a slightly different sum). The shared expert is
``nn.Linear``\\ s, laid out by the CPU paths like any other linear. The experts are prepacked for oneDNN one by one on the packed paths (``MoE.lay_out``: the
same bytes, and plain bf16 ``F.linear`` at one row is ~4x slower than a prepacked one on AVX-512
hosts). On the int8 / int4 paths they are quantized as those paths' linears are (``MoE.quantize``,
``workers.quant.QuantExperts``: int8 rows, or int4 groups of 32 where the kernel takes the shape,
stacked ``[E, ...]``, run by the same kernels), so a step reads only its experts' quantized bytes
(``per_expert_bytes``, what ``Engine.step_read_bytes`` counts); the per-token weighted sum is the
same reduction whichever layout ran the experts. Experts stored as MXFP4 (gpt-oss, ``mxfp4``) are
held as they ship on every CPU path (``workers.mxfp4.MxExperts``, filled by the loader expert by
expert: no bf16 copy of them ever exists) and run by the MXFP4 kernel, exact against the
dequantized weights; the CPU paths' ``lay_out`` / ``quantize`` leave them so. CUDA dies dequantize
them into the stacked weights after the load (``unpack_mxfp4``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import qlinear
from workers.layers.mlp import GatedMLP
from workers.mxfp4 import MxExperts
from workers.quant import Int4Quantizer, QuantExperts, int4_groups

ROUTINGS = ("softmax", "topk_softmax")


class ExpertMats(Protocol):
    """``E`` matrices, one per expert, as a CPU path holds them: ``mats[e](x [M, K]) -> [M, N]``
    (an ``nn.ModuleList`` of prepacked linears, or ``workers.quant.QuantExperts``' stacks)."""

    def __len__(self) -> int: ...

    def __getitem__(self, e: int, /) -> Callable[[torch.Tensor], torch.Tensor]: ...


class GLU(Protocol):
    """An expert's gated activation: ``[M, 2I]`` (gate columns, then up columns) -> ``[M, I]``."""

    def __call__(self, gu: torch.Tensor) -> torch.Tensor: ...


def silu_glu(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` (Qwen3-MoE, Qwen3.5-MoE, Mixtral)."""
    inter = gu.shape[-1] // 2
    return F.silu(gu[:, :inter]) * gu[:, inter:]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation (transformers' ``GptOssExperts._apply_gate``): the gate
    clamped above at ``limit``, up clamped to +-``limit``, ``(up + 1) * gate * sigmoid(alpha *
    gate)``. (The checkpoints interleave gate and up columns; the loader de-interleaves them into
    the stacked gate-then-up layout.)"""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gu: torch.Tensor) -> torch.Tensor:
        inter = gu.shape[-1] // 2
        gate = gu[:, :inter].clamp(max=self.limit)
        up = gu[:, inter:].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# torch's grouped GEMM (private, CUDA bf16; this torch also runs it on CPU): None where absent
_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(torch, "_grouped_mm", None)


def route(
    logits: torch.Tensor, top_k: int, routing: str = "softmax", norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] float32, expert ids [N, k] int64)."""
    if routing == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if routing == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    raise ValueError(f"unknown routing {routing!r} (known: {', '.join(ROUTINGS)})")


class Groups:
    """A step's (token, expert) assignments grouped by expert: ``order`` sorts the flattened
    ``[N * k]`` assignments by expert (stable: tokens in order within a group), ``tokens[i]`` is
    the token of sorted assignment ``i``, ``ends`` the cumulative group ends over all ``E``
    experts (int32, what a grouped GEMM takes), ``counts`` each expert's group size."""

    def __init__(self, ids: torch.Tensor, num_experts: int):
        k = ids.shape[1]
        flat = ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.tokens = self.order // k
        # (not bincount: on CUDA it reads the ids' max back to the host, which a CUDA graph's
        # capture refuses; a scatter-add into E counters never leaves the device)
        self.counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        self.ends = torch.cumsum(self.counts, 0).to(torch.int32)

    def active(self) -> list[tuple[int, int, int]]:
        """(expert, start, end) in the sorted assignments of each expert with tokens (one host
        sync: the loop below needs the counts on the host)."""
        counts = self.counts.tolist()
        out, start = [], 0
        for e, c in enumerate(counts):
            if c:
                out.append((e, start, start + c))
                start += c
        return out


def _grouped_mm_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these: CUDA, bf16, rows of 16-byte multiples."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and _GROUPED_MM is not None
        and gate_up.shape[1] % 8 == 0
        and gate_up.shape[2] % 8 == 0
        and down.shape[2] % 8 == 0
    )


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    grouped_mm: bool | None = None,
    stats: list[int] | None = None,
    laid_out: tuple[ExpertMats, ExpertMats] | None = None,
    glu: GLU = silu_glu,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for every token n.

    x: [N, H]; weights: [N, k] (float32); ids: [N, k]; gate_up: [E, 2I, H]; down: [E, H, I].
    ``grouped_mm``: force the grouped GEMM on or off (None: when ``_grouped_mm_ok``).
    The sum is accumulated in float32 and returned in x's dtype. ``stats``: the count of active
    experts is appended (the per-expert loop only: a benchmark's bytes read per step).
    ``laid_out``: each expert's gate_up and down as a CPU path laid them out (``MoE.lay_out``,
    ``MoE.quantize``), used in place of the stacked weights. ``glu``: the experts' gated activation (SwiGLU);
    ``gate_up_bias`` [E, 2I], ``down_bias`` [E, H]: the experts' biases, when they have them."""
    n, h = x.shape
    e = gate_up.shape[0]
    if laid_out is not None:
        e = len(laid_out[0])
    k = ids.shape[1]
    g = Groups(ids, e)
    xs = x[g.tokens]  # [N k, H], grouped by expert
    use_grouped = laid_out is None and (
        _grouped_mm_ok(x, gate_up, down) if grouped_mm is None else grouped_mm
    )
    if use_grouped:
        assert _GROUPED_MM is not None, "this torch has no grouped GEMM"
        gu = _GROUPED_MM(xs, gate_up.transpose(1, 2), offs=g.ends)  # [N k, 2I]
        expert = ids.reshape(-1)[g.order]  # each sorted row's expert
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[expert]
        ys = _GROUPED_MM(glu(gu), down.transpose(1, 2), offs=g.ends)  # [N k, H]
        if down_bias is not None:
            ys = ys + down_bias[expert]
    else:
        ys = torch.empty(xs.shape[0], h, dtype=x.dtype, device=x.device)
        active = g.active()
        if stats is not None:
            stats.append(len(active))
        for ex, s, t in active:
            gb = None if gate_up_bias is None else gate_up_bias[ex]
            db = None if down_bias is None else down_bias[ex]
            if laid_out is not None:  # prepacked or quantized, without biases: added here
                gu = laid_out[0][ex](xs[s:t])
                y = laid_out[1][ex](glu(gu if gb is None else gu + gb))
                ys[s:t] = y if db is None else y + db
                continue
            gu = F.linear(xs[s:t], gate_up[ex], gb)  # [c, 2I]
            ys[s:t] = F.linear(glu(gu), down[ex], db)
    # back to token order, then each token's k outputs weighted and summed in its own slot order
    # (a plain reduction: the same sum whatever else is in the batch, and no scatter, whose
    # threads stall on a busy host)
    per_token = ys[torch.argsort(g.order)].view(n, k, h).float()
    return (per_token * weights.unsqueeze(-1)).sum(1).to(x.dtype)


class Router(nn.Module):
    """A mixture of experts' router: logits [M, E] = x [M, H] @ weight^T (+ bias, gpt-oss's). Not an
    ``nn.Linear``, so that the CPU paths' layouts (``quant.replace_linears``) leave it dense."""

    def __init__(self, hidden: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MoE(nn.Module):
    """Router, stacked routed experts (with biases when ``expert_bias``, activated by ``glu``),
    optional shared expert with its sigmoid gate.

    ``forward(x [N, H]) -> [N, H]``."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        routing: str = "softmax",
        router_bias: bool = False,
        shared_inter: int = 0,
        expert_bias: bool = False,
        glu: GLU = silu_glu,
        mxfp4: bool = False,
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r} (known: {', '.join(ROUTINGS)})")
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        self.routing, self.norm_topk_prob = routing, norm_topk_prob
        self.gate = Router(hidden, num_experts, bias=router_bias)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter))
        # the experts' biases (gpt-oss), in the stacked layout: gate then up, per expert
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * inter)) if expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden)) if expert_bias else None
        self.glu = glu
        self.shared_expert = GatedMLP(hidden, shared_inter) if shared_inter else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_inter else None
        self.stats: list[int] | None = None  # set to a list to collect active-expert counts
        # each expert's matrices as a CPU path lays them out (oneDNN-prepacked, or quantized
        # stacks), when it does
        self.laid_out: tuple[ExpertMats, ExpertMats] | None = None
        # (activation, alpha, limit) when qlinear.experts runs the experts (MoE._hold)
        self.kernel_glu: tuple[str, float, float] | None = None
        self._matrix_bytes = 0  # one expert's gate_up and down as laid out (0: the stacked ones)
        self.receiving: str | None = None  # the layout a load fills the stacks in (``receive``)
        self.mxfp4 = mxfp4  # the experts held in MXFP4 (MxExperts), the stacked weights empty
        if mxfp4:
            gu, dn = MxExperts(num_experts, 2 * inter, hidden), MxExperts(num_experts, hidden, inter)
            self.gate_up_laid_out, self.down_laid_out = gu, dn  # registered: the loader fills them
            self._hold((gu, dn))
            self._matrix_bytes = gu.expert_bytes() + dn.expert_bytes()
            self._drop_stacked()

    def per_expert_bytes(self) -> int:
        """Bytes of one routed expert's weights (gate, up and down, and biases) as held: what a
        step reads for each expert it runs."""
        biases = 0
        if self.gate_up_bias is not None and self.down_bias is not None:
            biases = (
                self.gate_up_bias[0].numel() + self.down_bias[0].numel()
            ) * self.down_bias.element_size()
        if self._matrix_bytes:
            return self._matrix_bytes + biases
        return (
            self.gate_up[0].numel() * self.gate_up.element_size()
            + self.down[0].numel() * self.down.element_size()
            + biases
        )

    def lay_out(self, make: Callable[[torch.Tensor], nn.Module]) -> None:
        """Hold each expert's gate_up and down as ``make(weight)`` builds them (a CPU path's
        prepacked linear), one expert at a time, and let the stacked weights go (the same bytes,
        once). MXFP4 experts stay as they are (exact, and fewer bytes than any other layout)."""
        if self.mxfp4:
            return
        self._matrix_bytes = (
            self.gate_up[0].numel() * self.gate_up.element_size()
            + self.down[0].numel() * self.down.element_size()
        )
        gu = nn.ModuleList(make(self.gate_up[e]) for e in range(self.num_experts))
        dn = nn.ModuleList(make(self.down[e]) for e in range(self.num_experts))
        self.gate_up_laid_out, self.down_laid_out = gu, dn  # registered: counted as the model's weights
        self._hold((cast(ExpertMats, gu), cast(ExpertMats, dn)))
        self._drop_stacked()

    def quantize(self, layout: str, int4: Int4Quantizer = int4_groups) -> None:
        """Hold the experts quantized as the int8 / int4 CPU paths' linears (``QuantExperts``:
        int8 rows, or int4 groups made by ``int4``, in stacks), one expert at a time, and let the
        stacked weights go. The biases stay as they are; MXFP4 experts stay MXFP4 (``lay_out``).
        Experts ``receive``d in ``layout`` are held as their stacks were filled."""
        if self.mxfp4:
            return
        if self.receiving is not None:
            if self.receiving != layout:
                raise ValueError(f"experts received as {self.receiving} cannot be held as {layout}")
            gu, dn = cast(QuantExperts, self.gate_up_laid_out), cast(QuantExperts, self.down_laid_out)
            self.receiving = None
        else:
            gu = QuantExperts(self.gate_up.detach(), layout, int4)
            dn = QuantExperts(self.down.detach(), layout, int4)
        self._matrix_bytes = gu.expert_bytes() + dn.expert_bytes()
        self.gate_up_laid_out, self.down_laid_out = gu, dn  # registered: counted as the model's weights
        self._hold((gu, dn))
        self._drop_stacked()

    def receive(self, layout: str) -> tuple[QuantExperts, QuantExperts] | None:
        """Empty int8 / int4 stacks (``quantize``'s) for a load to fill an expert's rows at a time
        as the checkpoint's pieces arrive (``QuantExperts.put``: ``loader._experts_on_arrival``),
        the stacked weights let go now: they are never made in the load's dtype (2.4 GB a
        Qwen3-30B-A3B layer in fp32). ``quantize(layout)`` then holds them. None, and nothing
        changed, where the stacks take no runs of rows (torch's int4 packing) or the experts are
        MXFP4 (held as they ship)."""
        if self.mxfp4:
            return None
        gu = QuantExperts(self.gate_up, layout, fill=False)
        dn = QuantExperts(self.down, layout, fill=False)
        if not (gu.takes_rows and dn.takes_rows):
            return None
        self.gate_up_laid_out, self.down_laid_out = gu, dn
        self.receiving = layout
        self._drop_stacked()
        return gu, dn

    def unpack_mxfp4(self, dtype: torch.dtype) -> None:
        """MXFP4 experts dequantized (exactly) into the stacked weights in ``dtype``, one expert at a
        time: where no MXFP4 kernel reads them (a CUDA die's grouped GEMM), or to lay them out as
        a path's linears (bench/mxfp4_experts.py's baselines)."""
        if not self.mxfp4:
            return
        gu, dn = cast(MxExperts, self.gate_up_laid_out), cast(MxExperts, self.down_laid_out)
        self.gate_up = nn.Parameter(gu.dequantized(dtype), requires_grad=False)
        self.down = nn.Parameter(dn.dequantized(dtype), requires_grad=False)
        del self.gate_up_laid_out, self.down_laid_out
        self._hold(None)
        self._matrix_bytes, self.mxfp4 = 0, False

    def _drop_stacked(self) -> None:
        empty = torch.empty(0, *self.gate_up.shape[1:], dtype=self.gate_up.dtype, device=self.gate_up.device)
        self.gate_up = nn.Parameter(empty, requires_grad=False)
        self.down = nn.Parameter(
            torch.empty(0, *self.down.shape[1:], dtype=self.down.dtype, device=self.down.device),
            requires_grad=False,
        )

    def _hold(self, laid_out: tuple[ExpertMats, ExpertMats] | None) -> None:
        """Hold the experts as ``laid_out`` (None: the stacked weights), and settle once whether
        the kernel runs them (``kernel_glu``; not at each step: a compiled step reads the
        attribute). The stacks themselves are read at each call (``_stacks``): a load or ``.to()``
        replaces the tensors they hold."""
        self.laid_out = laid_out
        self.kernel_glu = self._kernel_glu()

    def _kernel_glu(self) -> tuple[str, float, float] | None:
        """The activation as ``qlinear.experts`` takes it (every expert in one call), when our
        kernel holds both stacks in one kind, the activations are met as they are (the
        fp32-activation kernels: ``PANTHEON_LINEAR_ACTIVATIONS=fp32``, the default) and the
        activation is one it knows."""
        stacks = self._stacks()
        if stacks is None or qlinear.activations() != "fp32" or stacks[0].kind != stacks[1].kind:
            return None
        if self.glu is silu_glu:
            return "silu", 0.0, 0.0
        if isinstance(self.glu, ClampedSwiGLU):
            return "clamped", self.glu.alpha, self.glu.limit
        return None

    def _stacks(self) -> tuple[qlinear.Stack, qlinear.Stack] | None:
        """The experts' stacks as the kernel takes them, as the module holds them now."""
        if self.laid_out is None:
            return None
        gu, dn = self.laid_out
        if not isinstance(gu, (QuantExperts, MxExperts)) or not isinstance(dn, (QuantExperts, MxExperts)):
            return None
        a, b = gu.stack(), dn.stack()
        return None if a is None or b is None else (a, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.routing, self.norm_topk_prob)
        fused = self._stacks() if self.kernel_glu is not None and x.device.type == "cpu" else None
        if fused is not None and self.kernel_glu is not None:
            gu, dn = fused
            glu, alpha, limit = self.kernel_glu
            if self.stats is not None:  # a benchmark's count of the experts a step reads
                self.stats.append(int(ids.unique().numel()))
            out = qlinear.experts_op(
                x, ids, weights, gu, dn, glu, alpha, limit, self.gate_up_bias, self.down_bias
            )
        else:
            out = experts_forward(
                x,
                weights,
                ids,
                self.gate_up,
                self.down,
                stats=self.stats,
                laid_out=self.laid_out,
                glu=self.glu,
                gate_up_bias=self.gate_up_bias,
                down_bias=self.down_bias,
            )
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def unread_expert_bytes(model: nn.Module, rows: int = 1) -> int:
    """Bytes of routed experts a decode step of ``rows`` tokens leaves unread: every MoE layer
    reads at most ``rows * top_k`` of its experts (fewer when tokens share one)."""
    total = 0
    for m in model.modules():
        if isinstance(m, MoE):
            total += max(0, m.num_experts - rows * m.top_k) * m.per_expert_bytes()
    return total
