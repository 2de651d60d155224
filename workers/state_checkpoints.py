"""Which recurrent-state checkpoints the engine keeps, under which prefix hashes. No torch.

A hybrid model (Qwen3.5: linear-attention layers with a recurrent state per sequence) cannot
rebuild a sequence's state from cached KV blocks: the state after token t summarises every token
before it. So the prefix cache keeps, beside the KV blocks, copies of every recurrent layer's
state at some block boundaries ("checkpoints"), filed under the hash of the block they end (the
same hash as the KV block: it covers every token before the boundary and the cache salt). A new
request restores the longest prefix whose KV blocks *and* boundary checkpoint are both cached.

Which boundaries are checkpointed (the engine decides, ``workers/engine.py``): the last block
boundary of each prompt, as its prefill passes it (the scheduler ends a chunk there), and, while
a sequence decodes, the newest boundary it has passed (replacing its previous one), so the next
turn of a conversation finds the state after the previous answer. Checkpoints are slots of a
fixed pool (``capacity``, a load setting: their memory is booked), evicted least recently used.
"""

from __future__ import annotations

from collections import OrderedDict


class CheckpointIndex:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._free = list(range(capacity - 1, -1, -1))
        self.hits = 0  # restores
        self.saved = 0  # checkpoints written

    @property
    def num_used(self) -> int:
        return len(self._by_hash)

    def has(self, h: bytes) -> bool:
        return h in self._by_hash

    def get(self, h: bytes) -> int | None:
        """The pool index holding the state under ``h`` (now the most recently used), or None."""
        i = self._by_hash.get(h)
        if i is not None:
            self._by_hash.move_to_end(h)
        return i

    def put(self, h: bytes) -> int | None:
        """A pool index to write the state under ``h`` into, evicting the least recently used
        checkpoint when full; None when ``h`` is already kept (nothing to write) or the pool has
        no room at all."""
        if self.capacity == 0 or h in self._by_hash:
            if h in self._by_hash:
                self._by_hash.move_to_end(h)
            return None
        if self._free:
            i = self._free.pop()
        else:
            _, i = self._by_hash.popitem(last=False)
        self._by_hash[h] = i
        self.saved += 1
        return i

    def drop(self, h: bytes) -> None:
        """Forget the checkpoint under ``h`` (if kept); its slot of the pool is free again."""
        i = self._by_hash.pop(h, None)
        if i is not None:
            self._free.append(i)

    def reset(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))
        self._by_hash.clear()
