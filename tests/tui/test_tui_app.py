"""Pilot tests of the dashboard against a fixed fake source: every binding (the modals are in
test_tui_modals.py).

The App gets a ``StaticSource`` (fixed snapshots from tests/tui/tui_fixtures), a fixed clock and UTC
event times; tests feed further snapshots with ``app.receive`` (what the feed worker calls).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import msgspec
import pytest
from rich.text import Text

from pantheon.snapshot import Event, Snapshot, decode_snapshot
from tui.app import KEYS, PantheonApp
from tui.history import History
from tui.screens import HelpScreen
from tui.source import Link, StaticSource
from tui.widgets.catalog import CatalogPanel
from tui.widgets.dies import DiesPanel
from tui.widgets.events import EventLog
from tui.widgets.filter import FilterBar
from tui.widgets.header import StatusHeader
from tui.widgets.instances import InstancesTable
from tui.widgets.queue import QueuePanel, Throughput
from tui.widgets.slots import SlotGrid

FIXTURES = Path(__file__).parent / "tui_fixtures"
SIZE = (160, 48)
pytestmark = pytest.mark.timeout(60)


def fixture(name: str) -> Snapshot:
    return decode_snapshot((FIXTURES / f"{name}.json").read_bytes())


class FakeClock:
    """A clock the test moves by hand (the header's "data age" reads it)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_app(
    items=None, *, source: StaticSource | None = None, history: History | None = None, **kw
) -> PantheonApp:
    """The dashboard, deterministic: fixed clock, UTC, no sampling timer, no blink."""
    if source is None:
        source = StaticSource([Link("connected"), fixture("normal")] if items is None else items)
    kw.setdefault("clock", FakeClock())
    app = PantheonApp(source, tz=datetime.UTC, sample_every=None, blink=False, history=history, **kw)
    app.animation_level = "none"
    return app


async def settle(app: PantheonApp, pilot) -> None:
    """Let the feed worker drain the fixed source and the widgets take the data."""
    await app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


def plain(widget) -> str:
    out = widget.render()
    return out.plain if isinstance(out, Text) else str(out)


def table_ids(app: PantheonApp) -> list[str]:
    return [str(row.key.value) for row in app.query_one(InstancesTable).ordered_rows]


async def test_one_snapshot_object_is_pushed_to_every_panel():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        snap = app.snapshot
        assert snap is not None and snap is app.latest
        for panel in (DiesPanel, InstancesTable, QueuePanel, CatalogPanel, Throughput):
            assert app.query_one(panel).snapshot is snap
        assert app.query_one(StatusHeader).pressure == snap.pressure
        assert table_ids(app) == ["llama#2", "qwen3#3", "tiny#1"]  # sorted by instance
        assert "connected" in plain(app.query_one(StatusHeader))
        assert "http://router.test:8000" in plain(app.query_one(StatusHeader))


async def test_selection_drives_the_slot_grid_and_follows_the_instance():
    app = make_app()
    async with app.run_test(size=(100, 40)) as pilot:  # narrow: the grid shows the selected
        await settle(app, pilot)
        assert app.selected == "llama#2"
        await pilot.press("down", "down")
        await pilot.pause()
        assert app.selected == "tiny#1"
        grid = plain(app.query_one(SlotGrid))
        assert "tiny#1" in grid and "llama#2" not in grid
        assert "decode 137 tok" in grid and "prefill" in grid and "warm chat-7" in grid
        # A refresh that reorders nothing keeps the cursor on the same instance.
        app.receive(msgspec.structs.replace(fixture("normal"), ts=1.0))
        await pilot.pause()
        assert app.selected == "tiny#1"
        table = app.query_one(InstancesTable)
        assert table.ordered_rows[table.cursor_row].key.value == "tiny#1"


async def test_wide_grid_shows_every_instance_and_marks_the_selected():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        grid = plain(app.query_one(SlotGrid))
        assert all(i in grid for i in ("llama#2", "qwen3#3", "tiny#1"))
        assert "▶ llama#2" in grid and "loading" in grid


async def test_the_catalog_panel_lists_every_model_and_counts_the_expiry_down():
    clock = FakeClock()
    app = make_app(clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        lines = plain(app.query_one(CatalogPanel)).splitlines()
        # loaded, loading, failed, then unloaded; the router's order within each
        assert [line.split()[1] for line in lines] == ["tiny", "llama", "qwen3", "broken", "alpha", "smollm2"]
        by = {line.split()[1]: line for line in lines}
        assert "loaded" in by["tiny"] and "expires 2m05s" in by["tiny"] and "/models/tiny" in by["tiny"]
        assert "pinned" in by["llama"] and "aka llama3" in by["llama"]
        assert "failed" in by["broken"] and "not a GGUF file" in by["broken"]
        assert "keep 10m00s" in by["alpha"] and "keep forever" in by["smollm2"]
        clock.t += 65  # no new snapshot: each redraw (every second) counts down from when it came
        await pilot.pause()
        assert "expires 1m00s" in plain(app.query_one(CatalogPanel))
        app.receive(fixture("normal"))  # the router's figure again
        await pilot.pause()
        assert "expires 2m05s" in plain(app.query_one(CatalogPanel))


async def test_a_short_catalog_panel_says_how_many_more_there_are():
    app = make_app([Link("connected"), fixture("high_pressure")])
    async with app.run_test(size=(100, 40)) as pilot:  # narrow: the panel is 5 lines at most
        await settle(app, pilot)
        lines = plain(app.query_one(CatalogPanel)).splitlines()
        assert len(lines) == 5 and lines[-1] == "+4 more (l picks one to load)"
        assert "expires 12s" in lines[0] and "its worker on cpu:0 died" in lines[1]


async def test_sort_by_header_click_and_by_key():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        table = app.query_one(InstancesTable)
        # Click the WEIGHTS header: ascending, then again: descending.
        keys = list(table.columns)
        x = sum(table.columns[k].get_render_width(table) for k in keys[: keys.index("weights")])
        await pilot.click(InstancesTable, offset=(x + 3, 1))  # inside the border
        await pilot.pause()
        assert table.sort_column == "weights" and not table.sort_reverse
        assert table_ids(app) == ["tiny#1", "llama#2", "qwen3#3"]
        await pilot.click(InstancesTable, offset=(x + 3, 1))  # inside the border
        await pilot.pause()
        assert table.sort_reverse and table_ids(app) == ["qwen3#3", "llama#2", "tiny#1"]
        assert app.selected == "llama#2"  # the selection survived both sorts
        await pilot.press("s")  # next column: kv
        assert table.sort_column == "kv"


async def test_help_lists_every_binding():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        table = app.screen.query_one("#help-keys")
        rows = [[str(c) for c in table.get_row_at(n)] for n in range(table.row_count)]
        assert [r[1] for r in rows] == [b.description for b in KEYS]
        assert [r[0] for r in rows] == ["l", "u", "space", "/", "s", "?", "q"]
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


async def test_footer_and_palette_come_from_the_same_bindings():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        footer = {k.action: k for k in app.query("FooterKey")}
        assert {b.action for b in KEYS} <= set(footer)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert [b.description for b in KEYS] == titles[: len(KEYS)]
        assert all(b.id for b in KEYS) and len({b.id for b in KEYS}) == len(KEYS)
        # The palette runs the binding's action: ctrl+p, "Pause", Enter.
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Pause")
        await pilot.pause(0.3)  # the palette searches in the background
        await pilot.press("enter")
        await pilot.pause()
        assert app.paused


async def test_filter_by_name():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("slash")
        bar = app.query_one(FilterBar)
        assert bar.display and bar.has_focus
        await pilot.press("t", "i")
        await pilot.pause()
        assert table_ids(app) == ["tiny#1"] and app.selected == "tiny#1"
        assert "filter: ti" in plain(app.query_one(StatusHeader))
        await pilot.press("enter")  # keep the filter, back to the table
        await pilot.pause()
        assert app.query_one(InstancesTable).has_focus and table_ids(app) == ["tiny#1"]
        await pilot.press("q")  # not typed into the (unfocused) filter: but we quit below
        await pilot.pause()
        assert app.return_code == 0


async def test_filter_escape_clears():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("slash", "q", "w")  # keys go to the filter, "q" does not quit
        await pilot.pause()
        assert app.return_code is None and table_ids(app) == ["qwen3#3"]
        await pilot.press("escape")
        await pilot.pause()
        assert not app.query_one(FilterBar).display
        assert app.filter_text == "" and len(table_ids(app)) == 3


async def test_pause_freezes_the_display_and_resume_shows_the_latest():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        first = app.snapshot
        await pilot.press("space")
        await pilot.pause()
        assert app.paused and "PAUSED" in plain(app.query_one(StatusHeader))
        newer = fixture("empty")
        app.receive(newer)
        await pilot.pause()
        assert app.snapshot is first and len(table_ids(app)) == 3
        await pilot.press("space")
        await pilot.pause()
        assert app.snapshot is newer and table_ids(app) == []


async def test_data_age_and_disconnected_state():
    clock = FakeClock(50.0)
    app = make_app(
        [Link("connected"), fixture("normal"), Link("disconnected", "ConnectError: refused", 4.0)],
        clock=clock,
    )
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        clock.t += 75
        header = plain(app.query_one(StatusHeader))
        assert "disconnected" in header and "ConnectError: refused, retry in 4s" in header
        assert "data 1m15s" in header
        assert len(table_ids(app)) == 3  # the last data stays on screen


async def test_event_log_deduplicates():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        log = app.query_one(EventLog)
        snap = fixture("normal")
        assert len(log.events) == len(snap.events)
        app.receive(msgspec.structs.replace(snap, ts=snap.ts + 1))  # the same events again
        await pilot.pause()
        assert len(log.events) == len(snap.events)
        extra = Event(ts=snap.ts + 1, kind="reject_503", message="tiny: queue full")
        app.receive(msgspec.structs.replace(snap, events=[*snap.events[1:], extra]))
        await pilot.pause()
        assert len(log.events) == len(snap.events) + 1 and log.events[-1] == extra
        assert "reject_503" in plain(log)


async def test_readonly_greys_out_load_and_unload():
    app = make_app(readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.check_action("load", ()) is None and app.check_action("unload", ()) is None
        footer = {k.action: k for k in app.query("FooterKey")}
        assert footer["load"].has_class("-disabled") and footer["unload"].has_class("-disabled")
        assert not footer["pause"].has_class("-disabled")
        await pilot.press("l", "u")
        await pilot.pause()
        assert app.screen is app.screen_stack[0] and app.source.calls == []
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Load" not in titles and "Unload" not in titles and "Pause" in titles
        await pilot.press("question_mark")
        await pilot.pause()
        assert [enabled for *_, enabled in app.screen.rows][:2] == [False, False]


async def test_unload_needs_a_selection():
    app = make_app([Link("connected"), fixture("empty")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.selected is None and app.check_action("unload", ()) is None
        assert app.check_action("load", ()) is True


async def test_q_quits():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0
    assert app.source.closed
