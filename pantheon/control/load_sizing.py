"""What one load books on a set of dies: its weights, its KV pool and its state pools.

A ``LoadSizing`` is made once per load (phase 2 of ``lifecycle``) and asked for each die set
the placer tries. On a CPU die the worker picks its linear path at load, so the estimate books
the largest it may pick (phase 4 sizes with the real one). The KV pool holds the full context
(``mml``) when the dies' free memory less the weights and state pools, times ``--kv-fraction``,
holds it, else what that holds but never less than ``--admit-ctx`` tokens; ``--kv-budget``
fixes it instead. The state pools hold a state per slot, a scratch one and the prefix cache's
checkpoints (0 bytes for a model without recurrent layers).

Each die set's answer is decided once (booking it must not shrink the next answer), until
``clear()``: after an eviction the free memory changed, so the load is sized again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from pantheon.config.settings import ServeConfig
from pantheon.control.dies import Booking, DieManager, booking
from pantheon.core.description import ModelDescription
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.protocol import die_kind
from pantheon.core.sizing import Estimate, draft_head_bytes, estimate, state_pool_slots


@dataclass
class LoadSizing:
    shape: ModelDescription
    config: ServeConfig
    dies: DieManager
    quantize: bool
    mml: int  # the instance's max_model_len
    floor: int  # --admit-ctx (at most mml): the least KV pool, in tokens
    n_slots: int
    checkpoints: int  # the prefix cache's state checkpoints
    cpu_works: Mapping[str, dict[str, str]]  # die -> its worker's CPU paths (name -> why not, or "")
    kv_types: KvCacheTypes  # the KV cache's types: their real bytes per token are booked
    # a draft model for speculation (workers/draft.py), on the first die: its weights there, and
    # its KV pool, which has the model's block count, in the KV pool's bytes per token
    draft: ModelDescription | None = None
    # the draft is the model's own multi-token-prediction head (pantheon.core.description
    # .mtp_description): its embeddings and LM head are the model's, only its layer is added
    draft_is_head: bool = False
    _needs: dict[tuple[str, ...], dict[str, Booking]] = field(default_factory=dict)

    def estimate(self, first: str) -> Estimate:
        """The model's bytes with ``first`` as its first die (its kind picks the layouts), a
        draft's added: its weights to the first die's, its K/V per token to the first layer's
        (so the first die holds its pool, and a pool of N tokens holds both models' N rows, as
        the worker shares ``kv_budget_bytes`` between the two pools)."""
        own = self._estimate(self.shape, first)
        if self.draft is None:
            return own
        d = self._estimate(self.draft, first)
        kv = list(own.kv_layer_bytes)
        kv[0] += d.kv_per_token
        # the head: its layer, and the 4-bit LM head copy it drafts with; a model: all of it
        weights = sum(d.layer_bytes) + draft_head_bytes(self.shape) if self.draft_is_head else d.weights
        return dataclasses.replace(own, base=own.base + weights, kv_layer_bytes=tuple(kv))

    def _estimate(self, shape: ModelDescription, first: str) -> Estimate:
        return estimate(
            shape,
            dtype=self.config.dtype,
            quantize=self.quantize,
            cpu=die_kind(first) == "cpu",
            cpu_works=self.cpu_works.get(first),
            kv_types=self.kv_types,
        )

    def need(self, ds: tuple[str, ...]) -> dict[str, Booking]:
        """What the load books on ``ds`` (weights, KV pool, state pool), decided once per die set."""
        if ds not in self._needs:
            est = self.estimate(ds[0])
            state = state_pool_slots(self.n_slots, self.checkpoints) * est.state_per_slot
            kv = self.config.kv_budget or est.kv_for(
                context=self.mml, floor=self.floor, room_tokens=self.room_tokens(est, ds, state)
            )
            self._needs[ds] = booking(est, ds, kv=kv, state=state)
        return self._needs[ds]

    def kv_bytes(self, ds: tuple[str, ...]) -> int:
        """The KV pool alone, over ``ds``."""
        return sum(b[1] for b in self.need(ds).values())

    def room_tokens(self, est: Estimate, ds: tuple[str, ...], state: int) -> int:
        """KV tokens the dies can give this load: each die's free memory less its share of the
        weights and of the state pools, times the KV fraction, over its share of the pool."""
        full = booking(est, ds, kv=est.kv_pool(self.mml), state=state)
        tokens = self.mml
        for die_id, (w, kv, st) in full.items():
            d = self.dies.get(die_id)
            if d is None or not d.known or not kv:
                continue  # a CUDA die learns its size from its worker's Hello
            room = max(0, int((self.dies.free(d) - w - st) * self.config.kv_fraction))
            tokens = min(tokens, room * self.mml // kv)
        return tokens

    def clear(self) -> None:
        """The free memory changed (an eviction): size again."""
        self._needs.clear()
