"""Pilot tests of the dashboard's modals against a fixed fake source: the load form (the catalog
picker, validation, progress, the router's error text) and the unload confirmation (then the
drain)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from test_tui_app import SIZE, fixture, make_app, plain, settle, table_ids
from textual.notifications import Notify
from textual.widgets import Button, Checkbox, Input, OptionList, Select

from tui.screens import ConfirmScreen, LoadScreen
from tui.source import Link, StaticSource
from tui.widgets.instances import InstancesTable
from tui.widgets.slots import SlotGrid

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------ load modal


async def fill(pilot, app, path="", name="", dies="", quantize=False):
    screen = app.screen
    for key, value in (("path", path), ("name", name), ("dies", dies)):
        screen.query_one(f"#{key}").value = value
    if quantize:
        screen.query_one("#quantize").value = True
    screen.query_one("#path").focus()  # so that Enter submits from the field
    await pilot.pause()


async def test_load_form_validates_before_sending():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        assert isinstance(app.screen, LoadScreen)
        await pilot.click("#do-load")
        await pilot.pause()
        error = plain(app.screen.query_one("#load-error"))
        assert "path is required" in error
        assert app.screen.query_one("#path").has_class("-invalid")
        await fill(pilot, app, path="/models/x", dies="cpu:0,gpu1")
        await pilot.press("enter")  # Enter in the (focused) path field submits as well
        await pilot.pause()
        assert "bad die 'gpu1'" in plain(app.screen.query_one("#load-error"))
        assert app.source.calls == []
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]


def field(app, key: str) -> str:
    return app.screen.query_one(f"#{key}", Input).value


async def test_load_picks_an_unloaded_model_from_the_catalog():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        picker = app.screen.query_one("#catalog", Select)
        assert picker.has_focus  # a catalog to pick from: the picker comes first
        await pilot.press("enter")  # open the list
        await pilot.pause()
        listed = picker.query_one(OptionList)
        prompts = [str(listed.get_option_at_index(n).prompt) for n in range(listed.option_count)]
        # only the unloaded entries (not the loaded, loading or failed ones), in the router's order
        assert prompts[1:] == [
            "alpha (a)  /models/org/alpha",
            "smollm2  /models/smollm2-135m-instruct.Q8_0.gguf",
        ]
        await pilot.press("down", "enter")  # onto the first model, pick it
        await pilot.pause()
        assert picker.value == "alpha"
        assert (field(app, "path"), field(app, "name"), field(app, "dies")) == (
            "/models/org/alpha",
            "alpha",
            "cpu:1",
        )
        assert app.screen.query_one("#quantize", Checkbox).value  # as the entry is configured
        assert app.screen.query_one("#do-load", Button).has_focus
        await pilot.press("enter")  # Load
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.source.calls == [
            ("load", {"path": "/models/org/alpha", "name": "alpha", "dies": ["cpu:1"], "quantize": True})
        ]
        assert app.screen is app.screen_stack[0]


async def test_a_path_typed_over_a_pick_is_what_loads():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        picker = app.screen.query_one("#catalog", Select)
        picker.value = "smollm2"
        await pilot.pause()
        assert field(app, "path") == "/models/smollm2-135m-instruct.Q8_0.gguf"
        assert field(app, "dies") == "" and not app.screen.query_one("#quantize", Checkbox).value
        app.screen.query_one("#path", Input).focus()
        await pilot.press("end", *"-v2")
        await pilot.pause()
        assert picker.is_blank()  # the picker no longer names what is loaded
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        assert app.source.calls == [
            (
                "load",
                {
                    "path": "/models/smollm2-135m-instruct.Q8_0.gguf-v2",
                    "name": "smollm2",
                    "dies": [],
                    "quantize": False,
                },
            )
        ]


async def test_without_a_catalog_the_path_is_typed_at_once():
    app = make_app([Link("connected"), fixture("empty")])  # an older router sends no catalog
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        assert app.screen.query_one("#catalog", Select).disabled
        assert app.screen.query_one("#path", Input).has_focus
        await pilot.press(*"/m/x", "enter")
        await app.workers.wait_for_complete()
        assert app.source.calls == [("load", {"path": "/m/x", "name": None, "dies": [], "quantize": False})]


async def test_load_shows_progress_then_closes():
    hold = asyncio.Event()
    source = StaticSource([Link("connected"), fixture("normal")], hold=hold)
    app = make_app(source=source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        await fill(pilot, app, path="/models/tiny", name="tiny2", dies="cpu:0, 1", quantize=True)
        await pilot.press("enter")  # Enter in a field submits too
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, LoadScreen) and screen.running
        assert screen.query_one("#load-progress").display
        assert screen.query_one("#path").disabled
        assert source.calls == [
            ("load", {"path": "/models/tiny", "name": "tiny2", "dies": ["cpu:0", "1"], "quantize": True})
        ]
        hold.set()
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.screen is app.screen_stack[0]


async def test_failed_load_shows_the_router_error():
    msg = "no model folder at '/nope' (it needs a config.json)"
    app = make_app(source=StaticSource([Link("connected"), fixture("normal")], load_error=msg))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        await fill(pilot, app, path="/nope")
        await pilot.click("#do-load")
        await app.workers.wait_for_complete()
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, LoadScreen) and not screen.running  # open, for a fix
        assert msg in plain(screen.query_one("#load-error"))
        assert not screen.query_one("#path").disabled


# ------------------------------------------------------------ unload


async def test_unload_asks_then_drains_until_the_instance_is_gone():
    hold = asyncio.Event()
    source = StaticSource([Link("connected"), fixture("normal")], hold=hold)
    app = make_app(source=source)
    async with app.run_test(size=(100, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("down", "down")  # tiny#1
        await pilot.press("u")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and "tiny#1" in app.screen.question
        await pilot.press("n")
        await pilot.pause()
        assert app.screen is app.screen_stack[0] and source.calls == []
        await pilot.press("u")
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause()
        assert source.calls == [("unload", "tiny#1")]
        assert app.draining == {"tiny#1"}
        table = app.query_one(InstancesTable)
        assert str(table.get_cell("tiny#1", "state")) == "draining"
        assert "draining" in plain(app.query_one(SlotGrid))
        assert app.check_action("unload", ()) is None  # not twice
        hold.set()
        await pilot.pause()
        snap = fixture("normal")
        app.receive(msgspec.structs.replace(snap, instances=[i for i in snap.instances if i.id != "tiny#1"]))
        await pilot.pause()
        assert app.draining == frozenset() and "tiny#1" not in table_ids(app)
        for _ in range(20):  # the table's cursor event moves the selection a moment later
            if app.selected in table_ids(app):
                break
            await pilot.pause(0.05)
        assert app.selected in table_ids(app)


async def test_failed_unload_clears_draining_and_says_why():
    app = make_app(
        source=StaticSource([Link("connected"), fixture("normal")], unload_error="model 'llama#2' is loading")
    )
    messages = []
    async with app.run_test(size=SIZE, message_hook=messages.append) as pilot:
        await settle(app, pilot)
        await pilot.press("u")
        await pilot.pause()
        await pilot.press("y")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.draining == frozenset()
        notes = [m.notification.message for m in messages if isinstance(m, Notify)]
        assert any("model 'llama#2' is loading" in n for n in notes)


async def test_modal_keys_do_not_reach_the_dashboard():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("u")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("q", "space")  # neither quits nor pauses behind the dialog
        await pilot.pause()
        assert app.return_code is None and not app.paused
