"""The engine's cache tensors, one entry per decoder layer, built from the layers' cache specs
(``pantheon.core.description``):

- ``KVCache``: an attention layer's paged K and V, ``[num_blocks * block_size, KV, D]`` each; the
  block manager (``workers/block_manager.py``) says which rows each sequence holds. Under a
  quantized KV cache type (``--kv-cache-dtype``: ``pantheon/core/kv_types.py``) K and/or V are
  ``QuantRows`` (``workers/kernels/kv_quant.py``): the same rows in llama.cpp's q8_0 / q4_0 blocks
  (or fp8 on CUDA), taking exactly the bytes the router books per token;
- ``StateCache``: a recurrent layer's state pool, one state per slot (``[slots + 1, ...]``: the
  last one is scratch for prompt logits computed outside the scheduler), on that layer's device,
  and its prefix cache's checkpoints (``[checkpoints, ...]``, ``workers/state_checkpoints.py``).
  A slot's state is overwritten from zero when a sequence starts in it, so nothing needs clearing
  when a sequence leaves. A sliding-window attention layer's cache is such a state too: a ring of
  its ``window`` positions' K and V per slot (``"k"``, ``"v"``: ``[slots + 1, window, KV, D]``;
  position p in row ``p % window``), checkpointed like a recurrent state, and never cleared (a
  query reads only positions its own sequence wrote: ``workers/layers/sliding.py``). Rings stay
  at the compute dtype under a quantized KV type: they are bounded by the window whatever the
  context (what quantizing saves grows with the context, and a paged pool is where it grows),
  the router sizes them as states at the compute dtype, and their prefix-cache checkpoints are
  plain copies;
  A ring is a ``RingCache``: a ``StateCache`` that also attends;
- ``SharedCache``: a KV-shared layer's (Gemma 4): the cache of the layer whose K/V it reads, no
  tensor of its own (its bytes are that layer's, counted there).

Each is built by its spec's kind (``CacheSpec.make`` calls ``_Maker``'s method for it) and answers
for itself (``LayerCache``): its pool's and its states' bytes, its step view (a ring reads its
window's), its attention over what it holds, and its states' saves and restores, so the runner,
the graphs and the layers never ask which kind a cache is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pantheon.core.description import (
    FullAttention,
    ModelDescription,
    RecurrentState,
    SharedKV,
    SlidingWindow,
)
from pantheon.core.kv_types import KvCacheTypes
from workers.kernels.kv_quant import KvRows, QuantRows
from workers.layers.attention import StepBatch, paged_attention
from workers.layers.sinks import paged_sink_attention, ring_sink_attention
from workers.layers.sliding import ring_attention, ring_write_prefills

# the per-slot tensors of a state, by name: [slots + 1, *shape] (or [checkpoints, *shape])
States = dict[str, torch.Tensor]


class LayerCache:
    """What one layer keeps between steps. Defaults: nothing paged, no per-slot state."""

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the paged K/V pool (what the KV budget pays for)."""
        return 0

    @property
    def state_nbytes(self) -> int:
        """Bytes of the per-slot states and their checkpoints."""
        return 0

    @property
    def pool(self) -> KVCache | None:
        """The paged K/V pool this layer writes (the fused decode call and the graphs read it)."""
        return None

    def slot_states(self) -> States:
        """The per-slot state tensors, [slots + 1, *shape] each (none unless a state)."""
        return {}

    def view(self, b: StepBatch) -> StepBatch:
        """The step as this layer's attention reads it (a ring: its window's view)."""
        return b

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: StepBatch,
        sinks: torch.Tensor | None = None,
        write_prefills: bool = True,
    ) -> torch.Tensor:
        """Write the step's K/V where this cache keeps them and attend: q [N, H, D] (pre-scaled),
        k, v [N, KV, D] -> [N, H, D]; ``sinks`` [H]: gpt-oss's per-head sink logits.
        ``write_prefills=False``: a ring leaves the prefill chunks' K/V for ``write_prefills``
        (later layers of the step read the ring too); a paged pool is addressed by position, so
        it always writes."""
        raise TypeError(f"{type(self).__name__} holds no K/V to attend to")

    def write_prefills(self, k: torch.Tensor, v: torch.Tensor, b: StepBatch) -> None:
        """The prefill chunks' K/V an ``attend(write_prefills=False)`` left out (a ring's)."""

    def save_state(self, slot: int, checkpoint: int) -> None:
        """Copy ``slot``'s state into prefix-cache ``checkpoint`` (nothing without a state)."""

    def load_state(self, slot: int, checkpoint: int) -> None:
        """Restore ``slot``'s state from prefix-cache ``checkpoint``."""

    def copy_verified(self, run: int, row: int, into_checkpoints: bool, index: int) -> None:
        """The state after row ``row`` of the step's verify run ``run`` into entry ``index`` of
        the slots' pool (or the checkpoints'), when this layer kept its verify rows' states."""


@dataclass
class KVCache(LayerCache):
    k: KvRows  # [rows, KV, D] (or its quantized rows)
    v: KvRows

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes if isinstance(t, QuantRows) else t.numel() * t.element_size() for t in (self.k, self.v)
        )

    @property
    def kv_nbytes(self) -> int:
        return self.nbytes

    @property
    def pool(self) -> KVCache | None:
        return self

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: StepBatch,
        sinks: torch.Tensor | None = None,
        write_prefills: bool = True,
    ) -> torch.Tensor:
        if sinks is not None:
            return paged_sink_attention(q, k, v, b, self.k, self.v, sinks)
        return paged_attention(q, k, v, b, self.k, self.v)


@dataclass
class StateCache(LayerCache):
    tensors: States  # name -> [slots + 1, *shape]
    checkpoints: States  # name -> [checkpoints, *shape]
    # The last step's verify rows (speculation): name -> [rows, runs, *shape], the state after
    # each row of each verifying sequence (run j in column ``verified_cols[j]``), written by the
    # layer, read by ``copy_verified`` (the slots' own states stay as they were before the rows
    # until the engine knows what was accepted).
    verified: States = field(default_factory=dict)
    verified_cols: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        ts = list(self.tensors.values()) + list(self.checkpoints.values())
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def state_nbytes(self) -> int:
        return self.nbytes

    def slot_states(self) -> States:
        return self.tensors

    def save_state(self, slot: int, checkpoint: int) -> None:
        for name, t in self.tensors.items():
            self.checkpoints[name][checkpoint].copy_(t[slot])

    def load_state(self, slot: int, checkpoint: int) -> None:
        for name, t in self.tensors.items():
            t[slot].copy_(self.checkpoints[name][checkpoint])

    def copy_verified(self, run: int, row: int, into_checkpoints: bool, index: int) -> None:
        if not self.verified:
            return
        col = self.verified_cols[run]
        for name, t in (self.checkpoints if into_checkpoints else self.tensors).items():
            t[index].copy_(self.verified[name][row, col])


@dataclass
class RingCache(StateCache):
    """A sliding-window layer's rings (``"k"``, ``"v"``: [slots + 1, window, KV, D]): a state
    that attends over its window (``workers/layers/sliding.py``)."""

    window: int = 0

    def view(self, b: StepBatch) -> StepBatch:
        return b.windows[self.window]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: StepBatch,
        sinks: torch.Tensor | None = None,
        write_prefills: bool = True,
    ) -> torch.Tensor:
        k_ring, v_ring = self.tensors["k"], self.tensors["v"]
        if sinks is not None:
            return ring_sink_attention(q, k, v, b, k_ring, v_ring, sinks)
        return ring_attention(q, k, v, b, k_ring, v_ring, write_prefills=write_prefills)

    def write_prefills(self, k: torch.Tensor, v: torch.Tensor, b: StepBatch) -> None:
        ring_write_prefills(k, v, b, self.tensors["k"], self.tensors["v"])


@dataclass
class SharedCache(LayerCache):
    """A layer reading layer ``layer``'s K and V: ``source`` is that layer's cache (its bytes are
    the source's, counted there)."""

    layer: int
    source: LayerCache

    def view(self, b: StepBatch) -> StepBatch:
        return self.source.view(b)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: StepBatch,
        sinks: torch.Tensor | None = None,
        write_prefills: bool = True,
    ) -> torch.Tensor:
        return self.source.attend(q, k, v, b, sinks, write_prefills)


@dataclass
class _Maker:
    """Builds each kind's cache (``CacheSpec.make``) for one layer on ``dev``."""

    dev: torch.device
    dtype: torch.dtype
    rows: int  # paged K/V rows
    num_slots: int
    checkpoints: int
    kv_types: KvCacheTypes
    built: list[LayerCache]  # the layers before this one (a shared layer reads one of them)

    def full(self, spec: FullAttention) -> LayerCache:
        shape = (self.rows, spec.kv_heads, spec.head_dim)

        def rows_of(kind: str) -> KvRows:
            if kind == "auto":
                return torch.zeros(shape, dtype=self.dtype, device=self.dev)
            return QuantRows.empty(kind, *shape, device=self.dev)

        return KVCache(rows_of(self.kv_types.k), rows_of(self.kv_types.v))

    def sliding(self, spec: SlidingWindow) -> LayerCache:
        def ring(n: int) -> States:
            shape = (n, spec.window, spec.kv_heads, spec.head_dim)
            return {x: torch.zeros(shape, dtype=self.dtype, device=self.dev) for x in ("k", "v")}

        return RingCache(ring(self.num_slots + 1), ring(self.checkpoints), window=spec.window)

    def recurrent(self, spec: RecurrentState) -> LayerCache:
        def pool(n: int) -> States:
            return {
                t.name: torch.zeros(
                    (n, *t.shape),
                    dtype=torch.float32 if t.dtype == "float32" else self.dtype,
                    device=self.dev,
                )
                for t in spec.tensors
            }

        return StateCache(pool(self.num_slots + 1), pool(self.checkpoints))

    def shared(self, spec: SharedKV) -> LayerCache:
        return SharedCache(spec.layer, self.built[spec.layer])  # an earlier layer: built already


def make_caches(
    desc: ModelDescription,
    layer_devices: list[torch.device],
    rows: int,
    num_slots: int,
    dtype: torch.dtype,
    checkpoints: int = 0,
    kv_types: KvCacheTypes = KvCacheTypes(),
) -> list[LayerCache]:
    """Every layer's cache on its device: ``rows`` KV rows (K and V as ``kv_types``),
    ``num_slots`` (+1 scratch) states and ``checkpoints`` state checkpoints."""
    check_kv_types(desc, kv_types, layer_devices)
    out: list[LayerCache] = []
    for spec, dev in zip(desc.layers, layer_devices):
        out.append(spec.cache.make(_Maker(dev, dtype, rows, num_slots, checkpoints, kv_types, out)))
    return out


def check_kv_types(desc: ModelDescription, kv_types: KvCacheTypes, devices: list[torch.device]) -> None:
    """Refuse KV cache types this model or these devices cannot hold (ValueError, saying why)."""
    if not kv_types.quantized:
        return
    for kind in (kv_types.k, kv_types.v):
        if kind == "fp8_e4m3":
            other = sorted({d.type for d in devices if d.type != "cuda"})
            if other:
                raise ValueError(
                    f"KV cache type fp8_e4m3 needs CUDA dies (this model has layers on {', '.join(other)}): "
                    "use q8_0 or q4_0 here"
                )
        why = desc.kv_types_problem(KvCacheTypes(kind, kind))
        if why:
            raise ValueError(f"KV cache type {kind} cannot hold this model's cache: {why}")


def kv_block_bytes(
    desc: ModelDescription, block_size: int, dtype: torch.dtype, kv_types: KvCacheTypes = KvCacheTypes()
) -> int:
    """Bytes one KV block takes over all paged attention layers (K and V), as ``kv_types``
    stores them (the sliding layers' rings are states, at the compute dtype)."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    return block_size * desc.kv_bytes_per_token(dtype_bytes, kv_types if kv_types.quantized else None)


def state_bytes(desc: ModelDescription, states: int, dtype: torch.dtype) -> int:
    """Bytes of ``states`` recurrent states (slots, scratch and checkpoints alike)."""
    return states * desc.state_bytes_per_slot(torch.empty((), dtype=dtype).element_size())
