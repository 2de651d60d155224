"""The dashboard shows a quantized KV cache's type beside its instance (issue 27), and nothing
for a full-width (``auto``) one, so the snapshots of today's dashboards stay as they are; the
load form's KV cache choice is sent as the load's ``kv_cache_dtype``, and only when not auto."""

from __future__ import annotations

import msgspec
import pytest
from test_tui_app import fixture, make_app, plain, settle
from textual.widgets import Input, OptionList, Select

from tui.screens import LoadScreen
from tui.widgets.slots import SlotGrid

pytestmark = pytest.mark.timeout(60)


async def test_the_slot_grid_names_a_quantized_kv_cache():
    snap = fixture("normal")
    insts = [
        msgspec.structs.replace(i, kv_cache_dtype="q8_0/q4_0") if i.id == "tiny#1" else i
        for i in snap.instances
    ]
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        grid = plain(app.query_one(SlotGrid))
        assert "KV " not in grid  # every instance of the fixture is auto
        app.receive(msgspec.structs.replace(snap, instances=insts, ts=1.0))
        await pilot.pause()
        app.query_one(SlotGrid).show_all = True
        await pilot.pause()
        lines = plain(app.query_one(SlotGrid)).splitlines()
        assert [ln for ln in lines if "KV q8_0/q4_0" in ln and "tiny#1" in ln]
        assert not [ln for ln in lines if "KV" in ln and "tiny#1" not in ln]


async def test_the_load_forms_kv_cache_choice_is_the_loads_kv_cache_dtype():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        form = app.screen
        assert isinstance(form, LoadScreen)
        kv = form.query_one("#kv-cache", Select)
        assert kv.value == "auto"  # nothing sent: the router's --kv-cache-dtype
        form.query_one("#path", Input).value = "/models/x"
        kv.focus()
        await pilot.press("enter")  # open the list: auto, q8_0, q4_0, in that order
        await pilot.pause()
        listed = kv.query_one(OptionList)
        prompts = [str(listed.get_option_at_index(n).prompt) for n in range(listed.option_count)]
        assert [p.split(":")[0] for p in prompts] == ["auto", "q8_0", "q4_0"]
        await pilot.press("down", "down", "enter")  # q4_0
        await pilot.pause()
        assert kv.value == "q4_0"
        await pilot.click("#do-load")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.source.calls == [
            (
                "load",
                {"path": "/models/x", "name": None, "dies": [], "quantize": False, "kv_cache_dtype": "q4_0"},
            )
        ]
        # a catalog pick sets it back to auto (the catalog names no KV cache type): none is sent
        await pilot.press("l")
        await pilot.pause()
        form = app.screen
        form.query_one("#kv-cache", Select).value = "q8_0"
        form.query_one("#catalog", Select).value = "alpha"
        await pilot.pause()
        assert form.query_one("#kv-cache", Select).value == "auto"
        await pilot.click("#do-load")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.source.calls[-1] == (
            "load",
            {"path": "/models/org/alpha", "name": "alpha", "dies": ["cpu:1"], "quantize": True},
        )


async def test_the_kv_cache_choice_is_disabled_while_loading():
    import asyncio

    from tui.source import Link, StaticSource

    hold = asyncio.Event()
    app = make_app(source=StaticSource([Link("connected"), fixture("normal")], hold=hold))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await pilot.pause()
        form = app.screen
        form.query_one("#path", Input).value = "/models/x"
        form.query_one("#kv-cache", Select).value = "q8_0"
        await pilot.click("#do-load")
        await pilot.pause()
        assert form.query_one("#kv-cache", Select).disabled  # what is loading cannot change
        hold.set()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.source.calls[-1][1]["kv_cache_dtype"] == "q8_0"
