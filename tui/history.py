"""Sampled series for the sparklines, on their own timebase.

The App samples the latest snapshot every ``sample_every`` seconds (one per second by default),
whatever the refresh interval is: a 5 s poll still draws a per-second line (each snapshot
repeated), and a fast poll does not make the line scroll faster.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pantheon.snapshot import Snapshot


class History:
    """The last ``size`` samples of tokens/s and total queue depth."""

    def __init__(self, size: int = 240, tokens: Iterable[float] = (), queue: Iterable[float] = ()):
        self.tokens: deque[float] = deque(tokens, maxlen=size)
        self.queue: deque[float] = deque(queue, maxlen=size)

    def sample(self, snap: Snapshot | None) -> None:
        if snap is None:
            return
        self.tokens.append(float(snap.throughput.tokens_per_s))
        self.queue.append(float(sum(q.depth for q in snap.queues)))
