"""A Llama-family decoder layer's pure decode step in one native call (``llama_layer.c``).

At one row a small model's layer is ~30 eager torch ops and four kernel calls, each op a few
microseconds of dispatch: more than the arithmetic between the linears (issue 28 §2). ``Native``
runs the whole layer in one ctypes call instead, with the linears and the attention still done
by their own kernels (``qmatmul.c``, ``paged_decode.c``), whose entry points the plan carries.

It takes (``Native.why`` / ``Native.__call__`` return None otherwise, and the layer runs its
torch code): linears in our quantized kernel's layouts (``Int4Linear`` / ``Int8Linear`` with
``ours``; their biases), Qwen3's per-head q/k norms, no sliding window, K and V pools on the
CPU of fp32 / bf16 rows or q8_0 / q4_0 ones (written quantized as ``kv_quant.quantize`` does),
a pure decode step (no prefill chunk; verify rows are decode rows) with its block tables and
lengths, fp32 or bf16 activations, not inside a ``torch.compile`` trace.
``PANTHEON_FUSED_LAYER=0`` keeps the torch path (read at each call: tests switch it).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

import torch
from torch import nn

from workers.cache import KVCache, LayerCache
from workers.kernels import paged, qlinear
from workers.kernels.build import FLOAT_KINDS, load
from workers.kernels.kv_quant import KvRows, QuantRows
from workers.layers.attention import StepBatch
from workers.quant import Int4Linear, Int8Linear

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I), ("skind", _I), ("a", _P), ("b", _P), ("bias", _P), ("n", _L), ("k", _L)]


class _Plan(ctypes.Structure):
    _fields_ = [
        ("hidden", _L), ("heads", _L), ("kv_heads", _L), ("head_dim", _L),
        ("eps_in", _F), ("eps_post", _F), ("norm_in", _P), ("norm_post", _P), ("norm_round", _I),
        ("qk_norm", _P), ("eps_qk", _F),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("q4", _P), ("q8", _P), ("attend", _P),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("rot_cos", _P), ("rot_sin", _P), ("rot_kind", _I), ("slots", _P),
        ("table", _P), ("table_i32", _I), ("nb", _L), ("lens", _P), ("lens_i32", _I),
        ("block_size", _L), ("min_parallel", _L),
    ]  # fmt: skip


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    return load(
        "llama_layer",
        "fused decode layer unavailable, layers keep their torch ops",
        {
            "ll_decode": (_I, [_P, _P, _P, _I, _P, _L, _P, _P, _I, _P, _P, _I, _I]),
            "ll_decode_layers": (_I, [_P, _L, _P, _P, _I, _L, _P, _P, _P, _P, _P, _P, _I]),
        },
    )


def available() -> bool:
    """Built (with the two kernels it calls), and not switched off (``PANTHEON_FUSED_LAYER=0``)."""
    return (
        os.environ.get("PANTHEON_FUSED_LAYER", "1") != "0"
        and qlinear.available()
        and paged.available()
        and _load()[0] is not None
    )


@dataclass(frozen=True)
class LayerParts:
    """What a Llama-family layer is made of, as the fused call reads it."""

    norm_in: torch.Tensor  # [hidden]
    eps_in: float
    qkv: nn.Module  # [H + 2 KV) * D, hidden]
    o: nn.Module  # [hidden, H * D]
    norm_post: torch.Tensor
    eps_post: float
    gate_up: nn.Module  # [2 I, hidden]: gate rows, then up rows
    down: nn.Module  # [hidden, I]
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: torch.Tensor | None = None  # [H + KV, D]: per-head q and k norm weights (Qwen3)
    eps_qk: float = 0.0


def _fn(lib: ctypes.CDLL, name: str) -> int | None:
    return ctypes.cast(getattr(lib, name), _P).value


class Native:
    """One layer's plan: built once (the weights are in place by then), called every decode
    step. ``why`` is None when the layer can run fused, else the reason it cannot."""

    def __init__(self, parts: LayerParts | str):
        self.why: str | None = None
        self._keep: list[torch.Tensor] = []  # fp32 copies the plan points at
        self._plan = _Plan()
        if isinstance(parts, str):
            self.why = parts
            return
        lib = _load()[0]
        qlib, plib = qlinear.library(), paged.library()
        if lib is None or qlib is None or plib is None:
            self.why = "a kernel is not built"
            return
        h, kv, d = parts.heads, parts.kv_heads, parts.head_dim
        if d % 16 or d > paged.MAX_D or h % kv or h // kv > paged.MAX_G:
            self.why = f"attention heads the kernel does not take ({h} x {d}, {kv} KV heads)"
            return
        lins = {}
        for name, mod in (
            ("qkv", parts.qkv),
            ("o", parts.o),
            ("gate_up", parts.gate_up),
            ("down", parts.down),
        ):
            lin = self._linear(mod)
            if lin is None:
                self.why = f"{name}: a {type(mod).__name__} not in our kernel's layout"
                return
            lins[name] = lin
        p = self._plan
        p.hidden, p.heads, p.kv_heads, p.head_dim = parts.norm_in.shape[0], h, kv, d
        p.eps_in, p.eps_post = parts.eps_in, parts.eps_post
        p.norm_in, p.norm_post = self._f32(parts.norm_in), self._f32(parts.norm_post)
        p.norm_round = 1
        if parts.qk_norm is not None:
            p.qk_norm, p.eps_qk = self._f32(parts.qk_norm), parts.eps_qk
        p.qkv, p.o, p.gate_up, p.down = lins["qkv"], lins["o"], lins["gate_up"], lins["down"]
        p.q4 = _fn(qlib, qlinear.q4_entry(qlib).__name__)
        p.q8 = _fn(qlib, qlinear.q8_entry(qlib).__name__)
        p.attend = _fn(plib, "pd_paged_decode")
        self._addr = ctypes.addressof(p)
        self._lib = lib

    def _f32(self, t: torch.Tensor) -> int:
        c = t.detach().float().contiguous()
        self._keep.append(c)
        return c.data_ptr()

    def _linear(self, mod: nn.Module) -> _Linear | None:
        bias = getattr(mod, "bias", None)
        lin = _Linear(bias=None if bias is None else self._f32(bias))
        if isinstance(mod, Int4Linear) and mod.ours:
            lin.kind, lin.a, lin.b = 4, mod.weight.data_ptr(), mod.scales_mins.data_ptr()
        elif isinstance(mod, Int8Linear) and mod.ours and mod.scale.dtype in FLOAT_KINDS:
            lin.kind, lin.skind = 8, FLOAT_KINDS[mod.scale.dtype]
            lin.a, lin.b = mod.weight.data_ptr(), mod.scale.data_ptr()
        else:
            return None
        lin.n, lin.k = mod.out_features, mod.in_features
        return lin

    def __call__(self, x: torch.Tensor, b: StepBatch, cache: LayerCache) -> torch.Tensor | None:
        """The layer's output (x plus both blocks) for this step, or None when the step is not
        one the fused call takes (the caller runs its torch code)."""
        if self.why is not None or not available():
            return None
        step = _step(b)  # the step's own checks, made once for all its layers
        pool = cache.pool
        if step is None or pool is None or not _takes(x, b, pool, self._plan):
            return None
        out = torch.empty_like(x)
        (kd, ks, kk), (vd, vs, vk) = _pool(pool.k), _pool(pool.v)
        rc = self._lib.ll_decode(
            self._addr, ctypes.addressof(step), x.data_ptr(), FLOAT_KINDS[x.dtype], out.data_ptr(), x.shape[0],
            kd, ks, kk, vd, vs, vk, torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise ValueError(f"fused decode layer refused its arguments (code {rc})")
        return out


class Layers:
    """Every layer of a model in one native call a decode step (``ll_decode_layers``): what each
    layer's own call costs in Python and ctypes (~20 us: 0.6 ms of SmolLM2's 30-layer step) paid
    once. The steps and pools it takes are those each layer's ``Native`` takes; the same kernel
    runs, so its output is the per-layer calls' to the bit. ``build`` gives one or None."""

    def __init__(self, natives: list[Native]):
        self._natives = natives  # kept: their plans and fp32 copies are what the call points at
        self._plans = (_P * len(natives))(*(n._addr for n in natives))
        self._plan = natives[0]._plan  # every layer's heads are its (``build``)
        self._lib = natives[0]._lib
        self._pools_of: tuple[int, ...] = ()  # ids of the K and V pools the arrays below point at
        self._held: list[KvRows] = []  # those pools (their ids stay theirs while held)
        self._arrays: tuple[ctypes.Array, ...] = ()

    @staticmethod
    def build(layers: Iterable[nn.Module]) -> Layers | None:
        """The call for these layers when every one runs fused (``why_not`` is None) with the
        same attention shape (one RoPE table serves them all); else None."""
        layers = list(layers)
        if not layers or why_not(layers) is not None:
            return None
        # why_not planned every layer, and each plan takes its layer
        ns = [cast(Native, cast(Fusable, layer).native) for layer in layers]
        shape = {(n._plan.heads, n._plan.kv_heads, n._plan.head_dim) for n in ns}
        return Layers(ns) if len(shape) == 1 else None

    def __call__(self, x: torch.Tensor, b: StepBatch, caches: list[LayerCache]) -> torch.Tensor | None:
        """x [N, hidden] through every layer for this step, or None when the step is not one the
        fused call takes (the caller runs the layers one by one)."""
        if not available():
            return None
        step = _step(b)
        if step is None or not _takes_rows(x, b, self._plan):
            return None
        arrays = self._pools(caches)
        if arrays is None:
            return None
        out = x.clone()  # in place from here: the caller's x stays as it was
        rc = self._lib.ll_decode_layers(
            self._plans, len(self._natives), ctypes.addressof(step), out.data_ptr(), FLOAT_KINDS[x.dtype],
            x.shape[0], *arrays, torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise ValueError(f"fused decode layers refused their arguments (code {rc})")
        return out

    def _pools(self, caches: list[LayerCache]) -> tuple[ctypes.Array, ...] | None:
        """The per-layer pool arrays of the call (data, scales, kind for K, then V), built again
        only when a pool changed; None when a layer's cache is not one the call writes."""
        kvs = [p for c in caches if (p := c.pool) is not None]
        if len(kvs) != len(self._natives) or len(caches) != len(kvs):
            return None
        key = tuple(id(pool) for c in kvs for pool in (c.k, c.v))
        if key == self._pools_of:
            return self._arrays
        if not all(_writes(c.k) and _writes(c.v) for c in kvs):
            return None
        n = len(kvs)
        cols: list[ctypes.Array] = []
        for side in ("k", "v"):
            pools = [_pool(getattr(c, side)) for c in kvs]
            cols += [
                (_P * n)(*(p[0] for p in pools)),
                (_P * n)(*(p[1] for p in pools)),
                (_I * n)(*(p[2] for p in pools)),
            ]
        self._pools_of, self._arrays = key, tuple(cols)
        self._held = [pool for c in kvs for pool in (c.k, c.v)]
        return self._arrays


@runtime_checkable
class Fusable(Protocol):
    """A layer that can run its decode steps as one native call (``workers/models/llama.py``'s)."""

    native: Native | None

    def parts(self) -> LayerParts | str: ...


def why_not(layers: Iterable[nn.Module]) -> str | None:
    """None when every layer of a model can run its decode steps fused (each planned now), else
    why the first that cannot does not."""
    if not available():
        return "the fused layer is off or not built"
    for i, layer in enumerate(layers):
        if not isinstance(layer, Fusable):
            return f"layer {i} is a {type(layer).__name__}"
        if layer.native is None:
            layer.native = Native(layer.parts())
        if layer.native.why is not None:
            return f"layer {i}: {layer.native.why}"
    return None


def _takes(x: torch.Tensor, b: StepBatch, pool: KVCache, plan: _Plan) -> bool:
    """This layer's part of a step ``_step`` took: its rows (``_takes_rows``) and its pools."""
    return _takes_rows(x, b, plan) and _writes(pool.k) and _writes(pool.v)


def _takes_rows(x: torch.Tensor, b: StepBatch, plan: _Plan) -> bool:
    """x [N, hidden] is what a fused call reads: the step's decode rows, contiguous fp32 / bf16
    on the CPU, with RoPE tables [N, H + KV, D] of the plan's heads."""
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in FLOAT_KINDS or not x.is_contiguous():
        return False
    rot = (x.shape[0], plan.heads + plan.kv_heads, plan.head_dim)
    return x.shape[0] == b.n_decode and b.rot_cos.shape == rot


_QUANT = {"q8_0": 3, "q4_0": 4}  # llama_layer.c's (and paged_decode.c's) kinds of quantized rows


def _writes(pool: KvRows) -> bool:
    """A K or V pool the fused call writes and reads: fp32 / bf16 rows, or q8_0 / q4_0 ones."""
    if isinstance(pool, QuantRows):
        parts = (pool.data, pool.scales)
        return pool.kind in _QUANT and all(t.device.type == "cpu" and t.is_contiguous() for t in parts)
    return pool.dtype in FLOAT_KINDS and pool.device.type == "cpu" and pool.is_contiguous()


def _pool(pool: KvRows) -> tuple[int, int | None, int]:
    """(data, scales or None, kind) of a pool ``_writes`` took."""
    if isinstance(pool, QuantRows):
        return pool.data.data_ptr(), pool.scales.data_ptr(), _QUANT[pool.kind]
    return pool.data_ptr(), None, FLOAT_KINDS[pool.dtype]


def kv_types_ok(k: str, v: str) -> bool:
    """KV cache types (``pantheon.core.kv_types``) whose pools the fused call takes."""
    return all(t == "auto" or t in _QUANT for t in (k, v))


# The step's part of the call, or None when the step is not one it takes: decided and built once
# for all layers of a step (the last step's kept)
_last: tuple[StepBatch, _Step | None, list[torch.Tensor]] | None = None


def _step(b: StepBatch) -> _Step | None:
    global _last
    if _last is None or _last[0] is not b:
        _last = (b, *_build_step(b))  # the tensors the step points at kept while it is the last
    return _last[1]


def _build_step(b: StepBatch) -> tuple[_Step | None, list[torch.Tensor]]:
    """A pure decode step (no prefill chunk; verify rows are decode rows) with its block tables
    and lengths, tables of kinds the call reads: its part of the call, and the tensors it points at."""
    if b.prefills or b.decode_lens is None or b.decode_blocks is None or b.block_size <= 0:
        return None, []
    keep = [
        t.contiguous() for t in (b.rot_cos, b.rot_sin, b.slot_mapping.long(), b.decode_blocks, b.decode_lens)
    ]
    cos, sin, slots, tab, lens = keep
    if cos.dtype not in FLOAT_KINDS or sin.dtype != cos.dtype or tab.dtype not in (torch.int32, torch.int64):
        return None, []
    if lens.dtype not in (torch.int32, torch.int64):
        return None, []
    s = _Step(
        rot_cos=cos.data_ptr(), rot_sin=sin.data_ptr(), rot_kind=FLOAT_KINDS[cos.dtype], slots=slots.data_ptr(),
        table=tab.data_ptr(), table_i32=int(tab.dtype == torch.int32), nb=tab.shape[1],
        lens=lens.data_ptr(), lens_i32=int(lens.dtype == torch.int32),
        block_size=b.block_size, min_parallel=paged.MIN_PARALLEL,
    )  # fmt: skip
    return s, keep
