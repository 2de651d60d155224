"""Qwen3.5's Gated DeltaNet on CUDA through flash-linear-attention's Triton kernels (``fla``).

The same contracts as ``workers/layers/gated_delta.py``'s ``chunk_gated_delta_rule`` (prefill,
one sequence) and ``recurrent_gated_delta_step`` (decode, B sequences): raw q and k (the L2 norm
and the ``Dk**-0.5`` scale happen in the kernel, ``use_qk_l2norm_in_kernel``), the decay ``g`` in
log space and ``beta`` after its sigmoid, fp32 states ``[.., Hv, Dk, Dv]``. Key heads serve
consecutive value heads in both (FLA's ``i_hv // (HV // H)``, Qwen3.5's ``repeat_interleave``), so
q and k go in unrepeated.

Why: the torch chunked path is a few dozen small kernels per chunk of 64 tokens and the decode
step five passes over every sequence's state; FLA's kernels fuse them. Which is faster on a
given card is measured (``bench/gpu_check.py``), and ``PANTHEON_FLA=0`` keeps the torch path.

``fla`` (the ``fla-core`` wheel, pure Python over Triton) is imported only when a CUDA tensor
asks: a machine without CUDA never imports it, and a CUDA machine without it keeps the torch
path (``available``).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch


@functools.cache
def _ops() -> ModuleType | None:
    try:
        return importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # noqa: BLE001 - missing, or a Triton / torch it cannot work with: torch path
        return None


def available(x: torch.Tensor) -> bool:
    """Whether the FLA kernels take ``x``'s layer: a CUDA tensor, ``fla`` importable, and not
    switched off (``PANTHEON_FLA=0``, read at each call)."""
    if not x.is_cuda or os.environ.get("PANTHEON_FLA", "1") == "0":
        return False
    return _ops() is not None


def chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule`` for one sequence. q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta:
    [T, Hv]; state: [Hv, Dk, Dv] fp32 (not modified) -> out [T, Hv, Dv] in v's dtype, the
    state after the last token [Hv, Dk, Dv] fp32."""
    ops = _ops()
    assert ops is not None
    dt = v.dtype
    out, final = ops.chunk_gated_delta_rule(
        q[None].to(dt),  # [1, T, Hk, Dk]: q, k and v in one dtype, as the kernels take them
        k[None].to(dt),
        v[None],
        g[None].float(),  # [1, T, Hv]
        beta[None].to(dt),
        scale=q.shape[-1] ** -0.5,
        initial_state=state[None].float(),  # [1, Hv, Dk, Dv]
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0].to(dt), final[0].float()


def step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_gated_delta_step``: one token of B sequences. q, k: [B, Hk, Dk]; v: [B, Hv,
    Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv] fp32 (not modified) -> out [B, Hv, Dv] in
    v's dtype, the new states [B, Hv, Dk, Dv] fp32."""
    ops = _ops()
    assert ops is not None
    dt = v.dtype
    out, final = ops.fused_recurrent_gated_delta_rule(
        q[:, None].to(dt),  # [B, 1, Hk, Dk]: each sequence a batch row of one token
        k[:, None].to(dt),
        v[:, None],
        g=g[:, None].float(),  # [B, 1, Hv]
        beta=beta[:, None].to(dt),
        scale=q.shape[-1] ** -0.5,
        initial_state=state.float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0].to(dt), final.float()
