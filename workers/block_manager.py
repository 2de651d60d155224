"""The KV cache pool's bookkeeping: free blocks, who holds which, and the prefix cache. No torch.

A block holds ``block_size`` consecutive token positions of one sequence; a sequence's block
table lists its blocks in position order, so token position p lives in row
``table[p // block_size] * block_size + p % block_size`` of every layer's cache tensor.

Prefix cache: once a block is full and computed, it is filed under a hash of its tokens, of
every token before it (the parent block's hash) and of the request's cache salt. A later
sequence whose leading blocks hash the same shares those blocks instead of recomputing them
(reference counted; shared blocks are full, so nobody writes into them). A block nobody holds
but that still carries a hash is kept, least recently used first out, until its room is
needed: a finished turn's blocks stay resident for the next turn of its conversation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


def block_hash(parent: bytes | None, tokens: list[int], salt: str | None) -> bytes:
    """Content hash of one full block. 128-bit BLAKE2b, so a collision is not a practical risk."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update((salt or "").encode() + b"\0")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_cache: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_cache = enable_cache
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.hits = 0  # blocks reused
        self.queries = 0  # blocks looked up

    # ------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take (cached ones are evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks kept only for the prefix cache."""
        return len(self._lru)

    def blocks_for(self, n_tokens: int) -> int:
        """How many blocks hold ``n_tokens`` positions."""
        return -(-n_tokens // self.block_size)

    # ------------------------------------------------------------ allocation

    def ensure(self, table: list[int], n_tokens: int) -> bool:
        """Grow ``table`` in place to hold ``n_tokens`` positions.

        All or nothing: when the pool lacks blocks, ``table`` is left as it was and False is
        returned, so a failed grow never leaves a sequence half-allocated.
        """
        need = self.blocks_for(n_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            table.append(self._take())
        return True

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._lru.popitem(last=False)  # evict the least recently used cached block
            h = self._hash[b]
            assert h is not None  # a cached block has its hash
            del self._by_hash[h]
            self._hash[b] = None
        self._ref[b] = 1
        return b

    def free(self, table: list[int]) -> None:
        """Release every block of ``table`` and empty it. The tail goes first, so that on
        eviction a conversation loses its newest blocks before the prefix others share."""
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        table.clear()

    def row(self, table: list[int], pos: int) -> int:
        """The cache row of token position ``pos``."""
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ------------------------------------------------------------ prefix cache

    def match(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on the cached blocks of the longest prefix of ``hashes``."""
        if not self.enable_cache:
            return []
        out: list[int] = []
        self.queries += len(hashes)
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
            out.append(b)
        self.hits += len(out)
        return out

    def register(self, block: int, h: bytes) -> None:
        """File a full, computed block under its hash (a twin already filed wins)."""
        if self.enable_cache and h not in self._by_hash and self._hash[block] is None:
            self._hash[block] = h
            self._by_hash[h] = block

    def reset_cache(self) -> None:
        """Forget every cached prefix; blocks in use keep their contents but lose their hash."""
        for b in self._lru:
            self._free.append(b)
        self._lru.clear()
        for b in self._by_hash.values():
            self._hash[b] = None
        self._by_hash.clear()
