"""The engine's cache tensors, one entry per decoder layer, built from the layers' cache specs
(``pantheon.core.description``):

- ``KVCache``: an attention layer's paged K and V, ``[num_blocks * block_size, KV, D]`` each; the
  block manager (``workers/block_manager.py``) says which rows each sequence holds. Under a
  quantized KV cache type (``--kv-cache-dtype``: ``pantheon/core/kv_types.py``) K and/or V are
  ``QuantRows`` (``workers/layers/kv_quant.py``): the same rows in llama.cpp's q8_0 / q4_0 blocks
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
- ``SharedCache``: a KV-shared layer's (Gemma 4): the cache of the layer whose K/V it reads, no
  tensor of its own (its bytes are that layer's, counted there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pantheon.core.description import AttentionCache, ModelDescription, RecurrentState, SharedKV
from pantheon.core.kv_types import KvCacheTypes, width_problem
from workers.layers.kv_quant import KvRows, QuantRows


@dataclass
class KVCache:
    k: KvRows  # [rows, KV, D] (or its quantized rows)
    v: KvRows

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes if isinstance(t, QuantRows) else t.numel() * t.element_size() for t in (self.k, self.v)
        )


@dataclass
class StateCache:
    tensors: dict[str, torch.Tensor]  # name -> [slots + 1, *shape]
    checkpoints: dict[str, torch.Tensor]  # name -> [checkpoints, *shape]
    # The last step's verify rows (speculation): name -> [rows, runs, *shape], the state after
    # each row of each verifying sequence (run j in column ``verified_cols[j]``), written by the
    # layer, read by ``ModelRunner.keep_verified`` (the slots' own states stay as they were
    # before the rows until the engine knows what was accepted).
    verified: dict[str, torch.Tensor] = field(default_factory=dict)
    verified_cols: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        ts = list(self.tensors.values()) + list(self.checkpoints.values())
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class SharedCache:
    """A layer reading layer ``layer``'s K and V: ``source`` is that layer's cache."""

    layer: int
    source: KVCache | StateCache

    @property
    def nbytes(self) -> int:
        return 0  # the source's bytes


LayerCache = KVCache | StateCache | SharedCache


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
        c = spec.cache
        if isinstance(c, AttentionCache) and c.window:

            def ring(
                n: int, c: AttentionCache = c, w: int = c.window, dev: torch.device = dev
            ) -> dict[str, torch.Tensor]:
                shape = (n, w, c.kv_heads, c.head_dim)
                return {x: torch.zeros(shape, dtype=dtype, device=dev) for x in ("k", "v")}

            out.append(StateCache(ring(num_slots + 1), ring(checkpoints)))
        elif isinstance(c, AttentionCache):
            shape = (rows, c.kv_heads, c.head_dim)

            def rows_of(kind: str, shape: tuple[int, int, int] = shape, dev: torch.device = dev) -> KvRows:
                if kind == "auto":
                    return torch.zeros(shape, dtype=dtype, device=dev)
                return QuantRows.empty(kind, *shape, device=dev)

            out.append(KVCache(rows_of(kv_types.k), rows_of(kv_types.v)))
        elif isinstance(c, RecurrentState):

            def pool(n: int, c: RecurrentState = c, dev: torch.device = dev) -> dict[str, torch.Tensor]:
                return {
                    t.name: torch.zeros(
                        (n, *t.shape), dtype=torch.float32 if t.dtype == "float32" else dtype, device=dev
                    )
                    for t in c.tensors
                }

            out.append(StateCache(pool(num_slots + 1), pool(checkpoints)))
        elif isinstance(c, SharedKV):
            src = out[c.layer]  # an earlier layer: built already
            assert not isinstance(src, SharedCache), "a shared layer reads a layer with its own cache"
            out.append(SharedCache(c.layer, src))
        else:  # pragma: no cover - a new spec kind needs its cache here
            raise TypeError(f"no cache for {c!r}")
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
        for spec in desc.layers:
            c = spec.cache
            if isinstance(c, AttentionCache) and not c.window:
                why = width_problem(kind, c.head_dim)
                if why:
                    raise ValueError(f"KV cache type {kind} cannot hold this model's cache: {why}")


def kv_block_bytes(
    desc: ModelDescription, block_size: int, dtype: torch.dtype, kv_types: KvCacheTypes = KvCacheTypes()
) -> int:
    """Bytes one KV block takes over all paged attention layers (K and V), as ``kv_types``
    stores them (the sliding layers' rings are states, at the compute dtype)."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    if not kv_types.quantized:
        return block_size * desc.kv_bytes_per_token(dtype_bytes)
    per_token = sum(
        kv_types.token_bytes(s.cache.kv_heads, s.cache.head_dim, dtype_bytes)
        for s in desc.layers
        if isinstance(s.cache, AttentionCache) and not s.cache.window
    )
    return block_size * per_token


def state_bytes(desc: ModelDescription, states: int, dtype: torch.dtype) -> int:
    """Bytes of ``states`` recurrent states (slots, scratch and checkpoints alike)."""
    return states * desc.state_bytes_per_slot(torch.empty((), dtype=dtype).element_size())
