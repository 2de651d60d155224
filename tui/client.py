"""The HTTP source: an httpx client of the router's admin API.

``RouterClient.updates()`` polls ``GET /admin/state`` every ``interval`` seconds (or, with
``sse=True``, follows ``GET /admin/events`` and falls back to polling when the router lacks it),
yields each decoded ``Snapshot`` and a ``Link`` whenever the connection state changes, and
reconnects with exponential backoff for ever: a router restart shows as disconnected, then
connected again. Everything is ``async`` on the App's event loop (run from a Textual worker), so
no request ever blocks the UI.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import httpx
import msgspec

from pantheon.snapshot import Event, Snapshot, decode_snapshot
from tui.source import CONNECTED, CONNECTING, DISCONNECTED, Link, RouterError, Update

# A load blocks until the model is ready (minutes for a big one), an unload until it is drained.
LOAD_TIMEOUT = httpx.Timeout(5.0, read=None)
UNLOAD_TIMEOUT = httpx.Timeout(5.0, read=600.0)


class Backoff:
    """Reconnect delays: ``initial``, doubling, capped at ``cap``; ``reset`` after a success."""

    def __init__(self, initial: float = 0.5, cap: float = 10.0, factor: float = 2.0):
        self.initial, self.cap, self.factor = initial, cap, factor
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * self.factor)
        return delay

    def reset(self) -> None:
        self._next = self.initial


def error_text(resp: httpx.Response) -> str:
    """The router's message from an OpenAI-format error body, else the start of the body."""
    try:
        body = resp.json()
        msg = body["error"]["message"]
        if isinstance(msg, str) and msg:
            return msg
    except (ValueError, KeyError, TypeError):
        pass
    text = resp.text.strip()
    return text[:300] if text else f"HTTP {resp.status_code} {resp.reason_phrase}"


def describe(exc: BaseException) -> str:
    """A one-line reason for a transport failure (httpx's messages can be empty)."""
    if isinstance(exc, RouterError):
        return exc.message
    msg = str(exc).strip()
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


async def parse_sse(lines: AsyncIterable[str]) -> AsyncIterator[tuple[str, str]]:
    """Server-Sent Events framing -> ``(event name, data)``; comments and ids are ignored."""
    event, data = "", []
    async for line in lines:
        if line == "":
            if data:
                yield event or "message", "\n".join(data)
            event, data = "", []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
    if data:
        yield event or "message", "\n".join(data)


def decode_sse(event: str, data: str) -> Update | None:
    """One SSE message of ``/admin/events`` -> a Snapshot or an Event (unknown kinds: None)."""
    try:
        if event in ("snapshot", "state"):
            return decode_snapshot(data)
        if event == "event":
            return msgspec.json.decode(data, type=Event)
        if event == "message":  # unnamed: tell the two apart by shape
            obj = json.loads(data)
            if isinstance(obj, dict) and "started_at" in obj:
                return msgspec.convert(obj, Snapshot)
            if isinstance(obj, dict) and "kind" in obj:
                return msgspec.convert(obj, Event)
    except (msgspec.MsgspecError, ValueError):
        return None
    return None


class RouterClient:
    """The dashboard's real ``Source``: the router at ``url`` over HTTP (see the module doc)."""

    def __init__(
        self,
        url: str,
        admin_key: str | None = None,
        *,
        interval: float = 1.0,
        sse: bool = False,
        backoff: Backoff | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.interval = max(0.05, interval)
        self.sse = sse
        self.backoff = backoff or Backoff(cap=max(10.0, self.interval))
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        # A poll that takes longer than a few intervals counts as a lost router.
        poll = max(2.0, 3 * self.interval)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            transport=transport,
            timeout=httpx.Timeout(poll, connect=min(poll, 3.0)),
        )

    async def fetch_state(self) -> Snapshot:
        """One ``GET /admin/state``; raises ``RouterError`` (HTTP error) or an httpx error."""
        resp = await self._http.get("/admin/state")
        if resp.status_code != 200:
            raise RouterError(f"/admin/state: {resp.status_code} {error_text(resp)}", resp.status_code)
        try:
            return decode_snapshot(resp.content)
        except msgspec.MsgspecError as e:
            raise RouterError(f"/admin/state: bad snapshot: {e}") from None

    async def updates(self) -> AsyncIterator[Update]:
        link: Link | None = None
        error: str | None = None
        while True:
            if link is None or link.state == DISCONNECTED:
                link = Link(CONNECTING, error)
                yield link
            try:
                if self.sse:
                    async for item in self._follow_events():
                        if link.state != CONNECTED:
                            link = Link(CONNECTED)
                            yield link
                        self.backoff.reset()
                        yield item
                    if self.sse:  # the stream ended: the router went away or restarted
                        raise RouterError("the event stream ended")
                    continue  # the router has no /admin/events: poll instead
                started = time.monotonic()
                snap = await self.fetch_state()
                if link.state != CONNECTED:
                    link = Link(CONNECTED)
                    yield link
                self.backoff.reset()
                yield snap
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
            except (httpx.HTTPError, RouterError, OSError) as e:
                error = describe(e)
                delay = self.backoff.next()
                link = Link(DISCONNECTED, error, delay)
                yield link
                await asyncio.sleep(delay)

    async def _follow_events(self) -> AsyncIterator[Update]:
        timeout = httpx.Timeout(max(30.0, 5 * self.interval), connect=3.0)
        # The router sends a snapshot every ``interval`` seconds, events as they happen.
        async with self._http.stream(
            "GET",
            "/admin/events",
            timeout=timeout,
            params={"interval": f"{self.interval:g}"},
            headers={"Accept": "text/event-stream"},
        ) as resp:
            if resp.status_code == 404:
                self.sse = False
                return
            if resp.status_code != 200:
                await resp.aread()
                raise RouterError(f"/admin/events: {resp.status_code} {error_text(resp)}", resp.status_code)
            async for event, data in parse_sse(resp.aiter_lines()):
                item = decode_sse(event, data)
                if item is not None:
                    yield item

    async def _post(self, route: str, body: dict[str, Any], timeout: httpx.Timeout) -> dict:
        try:
            resp = await self._http.post(route, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise RouterError(f"cannot reach the router: {describe(e)}") from None
        if resp.status_code >= 300:
            raise RouterError(error_text(resp), resp.status_code)
        try:
            out = resp.json()
        except ValueError:
            out = None
        return out if isinstance(out, dict) else {}

    async def load(
        self, path: str, name: str | None, dies: list[str], quantize: bool, kv_cache_dtype: str = "auto"
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"path": path, "dies": dies, "quantize": quantize}
        if name:
            body["name"] = name
        if kv_cache_dtype != "auto":  # absent: the router's --kv-cache-dtype
            body["kv_cache_dtype"] = kv_cache_dtype
        return await self._post("/admin/models/load", body, LOAD_TIMEOUT)

    async def unload(self, target: str) -> dict[str, Any]:
        return await self._post("/admin/models/unload", {"instance": target}, UNLOAD_TIMEOUT)

    async def aclose(self) -> None:
        await self._http.aclose()
