"""Per-request token streams: what ``WorkerPool.submit`` hands back.

A ``RequestStream`` is fed by the pool's reader task (``push``, ``end_with``) and read by one
consumer (``async for``, ``next_batch``). Its queue is unbounded on purpose: the reader serves
every request of every worker, so a slow HTTP client must never hold it up.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from pantheon.core import protocol as p

END = object()
"""Queued into a stream to end it without a finish token (an abort)."""


class RequestStream:
    """Async iterator over ``TokenOut`` for one request; ends after the TokenOut whose finish is set.

    Raises ``RequestRejectedError(kind, reason)`` if the worker rejected the request and
    ``WorkerDied`` if its worker died. Made by ``WorkerPool.submit``; ``on_abort(stream)`` is the
    pool's part of ``abort``: forget the stream and tell the worker.
    """

    def __init__(self, die: str, request_id: str, instance: str, on_abort: Callable[[RequestStream], None]):
        self.die = die
        self.request_id = request_id
        self.instance = instance
        self._on_abort = on_abort
        self._items: collections.deque = collections.deque()  # TokenOut | PoolError | END
        self._ready = asyncio.Event()
        self._open = True  # the worker may still send for it (registered with the pool)
        self._done = False  # the consumer has seen the end

    # ---- fed by the pool's reader

    def push(self, item) -> None:
        """Queue a token (or, through ``end_with``, the end)."""
        self._items.append(item)
        self._ready.set()

    def end_with(self, item) -> None:
        """The last item this stream gets: a finish token, an error or ``END``."""
        self._open = False
        self.push(item)

    def end_here(self) -> None:
        """End the stream on this side: drop what has not been read, then stop."""
        self._items.clear()
        self.end_with(END)

    # ---- read by the consumer

    def __aiter__(self) -> RequestStream:
        return self

    async def _wait(self) -> None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()

    def _take_end(self, item) -> None:
        """Consume an item that ends the stream: raise it if it is an error."""
        self._done = True
        if isinstance(item, BaseException):
            raise item

    async def __anext__(self) -> p.TokenOut:
        if self._done:
            raise StopAsyncIteration
        await self._wait()
        item = self._items.popleft()
        if isinstance(item, p.TokenOut):
            self._done = item.finish is not None
            return item
        self._take_end(item)
        raise StopAsyncIteration

    async def next_batch(self) -> list[p.TokenOut]:
        """Wait for at least one token, then return every token that has arrived.

        Returns ``[]`` once the stream has ended; raises like ``__anext__``. An error that
        arrived behind some tokens is raised on the next call, after those tokens.
        """
        if self._done:
            return []
        await self._wait()
        out: list[p.TokenOut] = []
        while self._items and not self._done:
            item = self._items[0]
            if isinstance(item, p.TokenOut):
                self._items.popleft()
                out.append(item)
                self._done = item.finish is not None
            elif out:
                break
            else:
                self._items.popleft()
                self._take_end(item)
        return out

    async def result(self) -> p.EmbedOut | p.TokenOut | None:
        """An embedding's answer: its ``EmbedOut`` (a ``TokenOut`` when the worker ended it
        otherwise, None when it was aborted here). Raises like ``__anext__``."""
        await self._wait()
        item = self._items.popleft()
        self._done = True
        if isinstance(item, BaseException):
            raise item
        return item if isinstance(item, (p.EmbedOut, p.TokenOut)) else None

    def abort(self) -> None:
        """Stop the request. Idempotent; sends ``Abort`` unless the request already ended."""
        if not self._open:
            return
        self.end_here()
        self._on_abort(self)
