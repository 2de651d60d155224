"""Pilot tests of the dashboard against a real ``pantheon serve`` (tiny model, one CPU die).

One router per module, on a free loopback port, with a ``--models-dir`` catalog holding one
model. Through the dashboard's own keys and modals: a failed load shows the router's error text;
the catalog's model picked in the load form appears in the table with its slots and in the
Models panel as loaded; streamed requests turn its slots busy; an unload through the
confirmation drains it away.

The router is started with tests/helpers/serve.py's ``Server``.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import pytest
from test_tui_app import plain, table_ids

from tui.app import PantheonApp
from tui.client import Backoff, RouterClient
from tui.screens import ConfirmScreen, LoadScreen
from tui.widgets.catalog import CatalogPanel
from tui.widgets.slots import SlotGrid

from helpers.serve import Server

NAME = "tui-tiny"  # the catalog's model, which the tests load through the modal
SIZE = (120, 40)
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def router(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("tui-serve")
    shutil.copytree(tiny_model, base / "models" / NAME)
    r = Server(
        ["--model", str(tiny_model), "--name", "base", "--dies", "cpu:0", "--cpu-dies", "1"]
        + ["--models-dir", str(base / "models")],
        base / "serve.log",
    )
    r.models = base / "models"  # type: ignore[attr-defined]
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def dashboard(router: Server, sse: bool = False) -> PantheonApp:
    client = RouterClient(router.url, interval=0.2, sse=sse, backoff=Backoff(0.1, 0.5))
    app = PantheonApp(client, sample_every=None, blink=False)
    app.animation_level = "none"
    return app


async def until(pilot, check, what: str, timeout: float = 30.0):
    """Poll ``check()`` (with UI turns in between) until it is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause(0.05)
        got = check()
        if got:
            return got
    raise AssertionError(f"timed out waiting for {what} (link: {pilot.app.link})")


def instance_named(app: PantheonApp, name: str):
    snap = app.snapshot
    return next((i for i in snap.instances if i.name == name), None) if snap else None


async def open_load_form(app, pilot):
    await until(pilot, lambda: app.snapshot is not None, "the first snapshot")
    await pilot.press("l")
    await until(pilot, lambda: isinstance(app.screen, LoadScreen), "the load form")


async def fill_load_form(app, pilot, path: str, name: str, dies: str):
    await open_load_form(app, pilot)
    for key, value in (("path", path), ("name", name), ("dies", dies)):
        app.screen.query_one(f"#{key}").value = value
    app.screen.query_one("#path").focus()
    await pilot.press("enter")


async def test_failed_load_shows_the_router_error(router):
    app = dashboard(router)
    async with app.run_test(size=SIZE) as pilot:
        missing = str(router.models / "nonexistent")
        await fill_load_form(app, pilot, missing, "nope", "cpu:0")
        error = await until(pilot, lambda: plain(app.screen.query_one("#load-error")), "the error text")
        assert f"no model folder at '{missing}'" in error
        assert isinstance(app.screen, LoadScreen) and not app.screen.running


async def test_sse_feed_brings_snapshots_and_events(router):
    app = dashboard(router, sse=True)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: instance_named(app, "base"), "a snapshot over SSE")
        assert app.source.sse  # the router has /admin/events: no fallback to polling
        log = app.query_one("EventLog")
        await until(pilot, lambda: any(e.kind == "loaded" for e in log.events), "the events")


def catalog_line(app: PantheonApp, name: str) -> str:
    return next((line for line in plain(app.query_one(CatalogPanel)).splitlines() if f" {name} " in line), "")


async def test_the_catalog_model_picked_in_the_load_form_loads(router):
    app = dashboard(router)
    async with app.run_test(size=SIZE) as pilot:
        await open_load_form(app, pilot)
        assert "unloaded" in catalog_line(app, NAME) and "loaded" in catalog_line(app, "base")
        await pilot.press("enter", "down", "enter")  # open the picker, its first model, pick it
        await until(pilot, lambda: app.screen.query_one("#name").value == NAME, "the form filled from it")
        await pilot.press("enter")  # Load (focused once a model is picked)
        await until(pilot, lambda: app.screen is app.screen_stack[0], "the form to close", 90)
        # Slots come with the worker's next stats, a moment after the instance itself.
        inst = await until(
            pilot,
            lambda: (i := instance_named(app, NAME)) and i.slots and i,
            "the new instance with its slots",
        )
        assert inst.state == "ready" and inst.dies == ["cpu:0"] and inst.path == str(router.models / NAME)
        assert inst.id in table_ids(app)
        line = await until(
            pilot,
            lambda: "unloaded" not in catalog_line(app, NAME) and catalog_line(app, NAME),
            "the Models panel to show it",
        )
        assert "loaded" in line and "no expiry" in line  # loaded by the admin API: stays
        grid = plain(app.query_one(SlotGrid))
        assert inst.id in grid and "#0" in grid and "idle" in grid


async def _stream(url: str, stop: asyncio.Event | None = None) -> int:
    """Stream chat completions (again and again until ``stop``; once without). Returns the SSE
    lines read; ends early when the router refuses a request (the model is draining)."""
    # ignore_eos and many tokens: a random tiny model may end at once, and a slot that is busy
    # for a few milliseconds can fall between two of the worker's Stats.
    body = {
        "model": NAME,
        "stream": True,
        "max_tokens": 1000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    lines = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while True:
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    return lines
                async for line in resp.aiter_lines():
                    lines += 1
                    await asyncio.sleep(0.002)  # a slowish reader
                    if line == "data: [DONE]":
                        break
            if stop is None or stop.is_set():
                return lines


def busy_slots(app: PantheonApp, name: str) -> int:
    inst = instance_named(app, name)
    return sum(s.state in ("prefill", "decode") for s in inst.slots) if inst else 0


async def test_streams_make_the_slots_busy(router):
    app = dashboard(router)
    stop = asyncio.Event()
    async with app.run_test(size=SIZE) as pilot:
        inst = await until(pilot, lambda: instance_named(app, NAME), "the loaded instance")
        table = app.query_one("InstancesTable")
        table.move_cursor(row=table_ids(app).index(inst.id))
        streams = [asyncio.create_task(_stream(router.url, stop)) for _ in range(3)]
        try:
            await until(pilot, lambda: busy_slots(app, NAME) >= 2, "two busy slots")
            await until(pilot, lambda: "decode" in plain(app.query_one(SlotGrid)), "decode in the slot grid")
            assert app.selected == inst.id
        finally:
            stop.set()
            await asyncio.gather(*streams, return_exceptions=True)


async def test_unload_through_the_confirmation_drains(router):
    app = dashboard(router)
    async with app.run_test(size=SIZE) as pilot:
        inst = await until(pilot, lambda: instance_named(app, NAME), "the loaded instance")
        table = app.query_one("InstancesTable")
        table.move_cursor(row=table_ids(app).index(inst.id))
        await until(pilot, lambda: app.selected == inst.id, "the selection")
        # The drain of a tiny model can be over before the next poll: record what was shown.
        shown: list[frozenset[str]] = []
        app.watch(app, "draining", lambda value: shown.append(value), init=False)
        stop = asyncio.Event()  # requests in flight: the router drains them first
        streams = [asyncio.create_task(_stream(router.url, stop)) for _ in range(2)]
        await until(pilot, lambda: busy_slots(app, NAME), "a busy slot")
        await pilot.press("u")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
        assert inst.id in app.screen.question
        await pilot.press("y")
        stop.set()
        await until(pilot, lambda: instance_named(app, NAME) is None, "the instance to go")
        assert shown[0] == {inst.id} and shown[-1] == frozenset()  # draining, then gone
        assert all(n > 2 for n in await asyncio.gather(*streams))  # in flight: finished
        assert inst.id not in table_ids(app) and app.selected in table_ids(app)
        assert "base" in {i.name for i in app.snapshot.instances}


async def test_the_kv_cache_type_picked_in_the_load_form_reaches_the_router(
    router, model_factory, tiny_model
):
    """The form's KV cache choice is the load's kv_cache_dtype: a head the type cannot hold
    (the tiny preset's 16 values, q4_0 blocks are 32) is the router's refusal, shown in the
    form; on a model with 32-value heads the instance comes up with a q8_0 cache. (Both under
    --models-dir: loads by path are refused elsewhere; this module's last test, as they join
    the catalog that the others pick from.)"""
    narrow, wide = router.models / "tui-narrow", router.models / "tui-wide"
    shutil.copytree(tiny_model, narrow, dirs_exist_ok=True)
    shutil.copytree(model_factory("tiny", head_dim=32), wide, dirs_exist_ok=True)
    app = dashboard(router)
    async with app.run_test(size=SIZE) as pilot:
        await open_load_form(app, pilot)
        form = app.screen
        for key, value in (("path", str(narrow)), ("name", "tui-q4"), ("dies", "cpu:0")):
            form.query_one(f"#{key}").value = value
        form.query_one("#kv-cache").value = "q4_0"
        await pilot.click("#do-load")
        error = await until(pilot, lambda: plain(form.query_one("#load-error")), "the error text")
        assert "kv_cache_dtype 'q4_0'" in error and "16" in error, error
        form.query_one("#path").value, form.query_one("#name").value = str(wide), "tui-q8"
        form.query_one("#kv-cache").value = "q8_0"
        await pilot.click("#do-load")
        await until(pilot, lambda: app.screen is app.screen_stack[0], "the form to close", 90)
        inst = await until(pilot, lambda: instance_named(app, "tui-q8"), "the q8_0 instance")
        assert inst.kv_cache_dtype == "q8_0" and inst.path == str(wide)
        assert instance_named(app, "tui-q4") is None
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        r = await http.post("/admin/models/unload", json={"instance": "tui-q8"})
        assert r.status_code == 200, r.text
