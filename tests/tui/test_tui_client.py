"""The TUI's HTTP client: polling, SSE, admin calls, error texts, backoff and reconnection.

Most tests use ``httpx.MockTransport``; the restart tests run a tiny HTTP server on a loopback
port (real sockets), stop it and start it again on the same port, with the client and with the
whole App watching.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from test_tui_app import FIXTURES, fixture, plain, table_ids

from pantheon.snapshot import Event, Snapshot
from tui.client import Backoff, RouterClient, decode_sse, error_text, parse_sse
from tui.source import CONNECTED, CONNECTING, DISCONNECTED, Link, RouterError
from tui.widgets.header import StatusHeader

pytestmark = pytest.mark.timeout(60)
STATE = (FIXTURES / "normal.json").read_bytes()
STATE_LINE = json.dumps(json.loads(STATE))  # one line, as an SSE data field carries it


def oa_error(status: int, message: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"error": {"message": message, "param": None, "type": "invalid_request_error", "code": None}},
    )


async def take(agen, n: int) -> list:
    out = []
    async for item in agen:
        out.append(item)
        if len(out) == n:
            break
    return out


def test_backoff_doubles_to_the_cap_and_resets():
    b = Backoff(initial=0.5, cap=4.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    b.reset()
    assert b.next() == 0.5


def test_error_text():
    assert error_text(oa_error(404, "no model folder at '/x'")) == "no model folder at '/x'"
    assert error_text(httpx.Response(502, text="bad gateway\n")) == "bad gateway"
    assert error_text(httpx.Response(503)) == "HTTP 503 Service Unavailable"


async def test_sse_framing_and_decoding():
    async def lines():
        for line in [
            ": keep-alive",
            "event: snapshot",
            f"data: {STATE_LINE}",
            "",
            "event: event",
            'data: {"ts": 5.0, "kind": "loaded",',
            'data: "message": "m"}',
            "",
            "event: other",
            "data: {}",
            "",
            "data: not json",
            "",
        ]:
            yield line

    got = [(e, d) async for e, d in parse_sse(lines())]
    assert [e for e, _ in got] == ["snapshot", "event", "other", "message"]
    items = [decode_sse(e, d) for e, d in got]
    assert isinstance(items[0], Snapshot) and items[0] == fixture("normal")
    assert items[1] == Event(ts=5.0, kind="loaded", message="m")
    assert items[2] is None and items[3] is None
    assert decode_sse("message", STATE_LINE) == fixture("normal")


async def test_polls_with_the_admin_key_and_reconnects_after_errors():
    seen: list[httpx.Request] = []
    answers = iter(
        [
            httpx.Response(200, content=STATE),
            httpx.ConnectError("refused"),
            oa_error(404, "no route GET /admin/state"),
            httpx.Response(200, content=STATE),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client = RouterClient(
        "http://r.test:9/",
        "sekrit",
        interval=0.01,
        backoff=Backoff(0.01, 0.02),
        transport=httpx.MockTransport(handler),
    )
    items = await take(client.updates(), 9)
    await client.aclose()
    kinds = [i.state if isinstance(i, Link) else type(i).__name__ for i in items]
    assert kinds == [
        CONNECTING,
        CONNECTED,
        "Snapshot",
        DISCONNECTED,
        CONNECTING,
        DISCONNECTED,
        CONNECTING,
        CONNECTED,
        "Snapshot",
    ]
    assert items[3].error == "ConnectError: refused" and items[3].retry_in == 0.01
    assert items[5].error == "/admin/state: 404 no route GET /admin/state"
    assert items[6].error == items[5].error  # kept on screen while reconnecting
    assert seen and all(r.headers["authorization"] == "Bearer sekrit" for r in seen)
    assert {r.url.path for r in seen} == {"/admin/state"}


async def test_bad_snapshot_is_a_disconnect_with_the_reason():
    client = RouterClient(
        "http://r.test",
        interval=0.01,
        backoff=Backoff(0.01, 0.01),
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=[1])),
    )
    items = await take(client.updates(), 2)
    await client.aclose()
    assert items[1].state == DISCONNECTED and "bad snapshot" in items[1].error


async def test_sse_mode_follows_events_and_falls_back_to_polling():
    def sse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/events":
            ev = json.dumps({"ts": 1.0, "kind": "loaded", "message": "x"})
            body = f"event: snapshot\ndata: {STATE_LINE}\n\nevent: event\ndata: {ev}\n\n"
            return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(500)

    client = RouterClient(
        "http://r.test",
        interval=0.01,
        sse=True,
        backoff=Backoff(0.01, 0.01),
        transport=httpx.MockTransport(sse),
    )
    items = await take(client.updates(), 5)
    await client.aclose()
    assert [type(i).__name__ for i in items] == ["Link", "Link", "Snapshot", "Event", "Link"]
    assert items[4].state == DISCONNECTED and "event stream ended" in items[4].error

    def no_events(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/events":
            return oa_error(404, "no route GET /admin/events")
        return httpx.Response(200, content=STATE)

    client = RouterClient("http://r.test", interval=0.01, sse=True, transport=httpx.MockTransport(no_events))
    items = await take(client.updates(), 3)
    await client.aclose()
    assert [getattr(i, "state", "snap") for i in items] == [CONNECTING, CONNECTED, "snap"]
    assert client.sse is False


async def test_load_and_unload_bodies_and_errors():
    seen: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if body.get("path") == "/nope":
            return oa_error(404, "no model folder at '/nope' (it needs a config.json)")
        return httpx.Response(200, json={"status": "ok", "instance": "t#1"})

    client = RouterClient("http://r.test", transport=httpx.MockTransport(handler))
    assert (await client.load("/m", "t", ["cpu:0"], True))["instance"] == "t#1"
    assert (await client.load("/m", None, [], False))["status"] == "ok"
    await client.load("/m", None, [], False, "q4_0")  # a KV cache type other than auto is sent
    await client.load("/m", None, [], False, "auto")  # auto is not: the router's default applies
    with pytest.raises(RouterError) as err:
        await client.load("/nope", None, [], False)
    assert err.value.status == 404 and err.value.message.startswith("no model folder at")
    await client.unload("t#1")
    await client.aclose()
    assert seen[:4] == [
        ("/admin/models/load", {"path": "/m", "name": "t", "dies": ["cpu:0"], "quantize": True}),
        ("/admin/models/load", {"path": "/m", "dies": [], "quantize": False}),
        ("/admin/models/load", {"path": "/m", "dies": [], "quantize": False, "kv_cache_dtype": "q4_0"}),
        ("/admin/models/load", {"path": "/m", "dies": [], "quantize": False}),
    ]
    assert seen[-1] == ("/admin/models/unload", {"instance": "t#1"})


async def test_admin_call_to_a_dead_router_says_so():
    client = RouterClient(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RouterError, match="cannot reach the router: ConnectError"):
        await client.unload("x#1")
    await client.aclose()


# ------------------------------------------------------------ a real socket, restarted


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TinyRouter:
    """Answers ``GET /admin/state`` with a fixed body over real HTTP/1.1 (keep-alive). ``stop``
    also drops open connections, as a router that exits does."""

    def __init__(self, body: bytes = STATE):
        self.body = body
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode()
                ok = line.startswith("GET /admin/state ")
                body = self.body if ok else b'{"error": {"message": "no route"}}'
                status = "200 OK" if ok else "404 Not Found"
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


async def test_client_survives_a_router_restart():
    router = TinyRouter()
    await router.start()
    client = RouterClient(router.url, interval=0.02, backoff=Backoff(0.02, 0.05))
    states: list[str] = []
    phase = "up"  # up -> down (stopped) -> back (restarted)
    try:
        feed = client.updates()
        async for item in feed:
            states.append(item.state if isinstance(item, Link) else "snap")
            if phase == "up" and states.count("snap") == 2:
                await router.stop()
                phase = "down"
            elif phase == "down" and states.count(DISCONNECTED) == 2:  # two failed tries
                await router.start()
                phase = "back"
            elif phase == "back" and states[-1] == "snap":
                break
        await feed.aclose()
    finally:
        await client.aclose()
        if router.serving:
            await router.stop()
    first_down = states.index(DISCONNECTED)
    assert states[:4] == [CONNECTING, CONNECTED, "snap", "snap"]
    assert states[first_down : first_down + 2] == [DISCONNECTED, CONNECTING]
    assert states[-2:] == [CONNECTED, "snap"]


async def test_dashboard_shows_the_restart():
    from tui.app import PantheonApp

    router = TinyRouter()
    await router.start()
    client = RouterClient(router.url, interval=0.05, backoff=Backoff(0.05, 0.1))
    app = PantheonApp(client, sample_every=None, blink=False)
    app.animation_level = "none"

    async def wait_for(state: str) -> None:
        for _ in range(200):
            await asyncio.sleep(0.02)
            if app.link.state == state:
                return
        raise AssertionError(f"never {state}: {app.link}")

    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(CONNECTED)
            await pilot.pause()
            assert len(table_ids(app)) == 3
            await router.stop()
            await wait_for(DISCONNECTED)
            await pilot.pause()
            header = plain(app.query_one(StatusHeader))
            # ConnectError, or a read error when the poll was on a kept-alive connection.
            assert "disconnected" in header and app.link.error and app.link.error in header
            assert len(table_ids(app)) == 3  # the last data stays
            await router.start()
            await wait_for(CONNECTED)
            await pilot.pause()
            assert "connected" in plain(app.query_one(StatusHeader))
            assert app.link.error is None
    finally:
        if router.serving:
            await router.stop()
