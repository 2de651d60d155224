"""The KV cache pool's bookkeeping: which fixed-size blocks are free, which a sequence holds.

No torch here. A block holds ``block_size`` consecutive token positions of one sequence; a
sequence's block table lists its blocks in position order, so token position p lives in
row ``table[p // block_size] * block_size + p % block_size`` of every layer's cache tensor.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """A free list of block ids in ``[0, num_blocks)``."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """How many blocks hold ``n_tokens`` positions."""
        return -(-n_tokens // self.block_size)

    def ensure(self, table: list[int], n_tokens: int) -> bool:
        """Grow ``table`` in place to hold ``n_tokens`` positions.

        All or nothing: when the pool lacks blocks, ``table`` is left as it was and False is
        returned, so a failed grow never leaves a sequence half-allocated.
        """
        need = self.blocks_for(n_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, table: list[int]) -> None:
        """Return every block of ``table`` to the pool and empty it."""
        self._free.extend(table)
        table.clear()

    def row(self, table: list[int], pos: int) -> int:
        """The cache row of token position ``pos``."""
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
