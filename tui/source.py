"""What the dashboard reads from: the ``Source`` interface, the link status and a fixed source.

The App is given its source in its constructor (``PantheonApp(source=...)``). The real one is
``tui.client.RouterClient`` (HTTP); ``StaticSource`` replays fixed items and is what the snapshot
and binding tests use, so they need no network and no clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from pantheon.snapshot import Event, Snapshot

CONNECTING, CONNECTED, DISCONNECTED = "connecting", "connected", "disconnected"


@dataclass(frozen=True)
class Link:
    """The state of the connection to the router, as the header shows it."""

    state: str  # connecting | connected | disconnected
    error: str | None = None  # the last failure, kept while reconnecting
    retry_in: float | None = None  # seconds until the next attempt (disconnected)


# One item of a source's feed: a whole snapshot, a single event (SSE), or a link change.
Update = Snapshot | Event | Link


class RouterError(Exception):
    """A failed admin call: the router's own error text when it sent one, else the transport's."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


class Source(Protocol):
    """A feed of updates plus the two admin actions; every method runs on the App's loop."""

    url: str

    def updates(self) -> AsyncIterator[Update]:
        """Yield updates until cancelled (the real source never ends on its own)."""
        ...

    async def load(
        self, path: str, name: str | None, dies: list[str], quantize: bool, kv_cache_dtype: str = "auto"
    ) -> dict[str, Any]:
        """Load a model; returns the router's instance JSON, raises ``RouterError``.
        ``kv_cache_dtype`` "auto" sends none: the router's ``--kv-cache-dtype`` applies."""
        ...

    async def unload(self, target: str) -> dict[str, Any]:
        """Unload by instance id or name; returns when the router has drained it."""
        ...

    async def aclose(self) -> None: ...


class StaticSource:
    """A fixed feed: yields ``items`` in order, then ends; load and unload are scripted.

    ``load_error`` / ``unload_error`` make the calls fail with that router text; ``hold`` (an
    ``asyncio.Event``) makes them wait until it is set, so a test can see the progress state.
    Calls are recorded in ``calls``.
    """

    def __init__(
        self,
        items: Iterable[Update] = (),
        *,
        url: str = "http://router.test:8000",
        load_error: str | None = None,
        unload_error: str | None = None,
        hold: asyncio.Event | None = None,
    ):
        self.url = url
        self.items = list(items)
        self.load_error = load_error
        self.unload_error = unload_error
        self.hold = hold
        self.calls: list[tuple[str, Any]] = []
        self.closed = False

    async def updates(self) -> AsyncIterator[Update]:
        for item in self.items:
            yield item

    async def load(
        self, path: str, name: str | None, dies: list[str], quantize: bool, kv_cache_dtype: str = "auto"
    ) -> dict[str, Any]:
        call: dict[str, Any] = {"path": path, "name": name, "dies": dies, "quantize": quantize}
        if kv_cache_dtype != "auto":  # recorded as the real client sends it: only when not auto
            call["kv_cache_dtype"] = kv_cache_dtype
        self.calls.append(("load", call))
        if self.hold is not None:
            await self.hold.wait()
        if self.load_error:
            raise RouterError(self.load_error, 404)
        return {
            "status": "loaded",
            "name": name or path.rstrip("/").rsplit("/", 1)[-1],
            "instance": f"{name}#9",
            "dies": dies,
        }

    async def unload(self, target: str) -> dict[str, Any]:
        self.calls.append(("unload", target))
        if self.hold is not None:
            await self.hold.wait()
        if self.unload_error:
            raise RouterError(self.unload_error, 409)
        return {"status": "unloaded", "instances": [target]}

    async def aclose(self) -> None:
        self.closed = True
