"""Screenshots of the dashboard (pytest-textual-snapshot): the normal, empty, high-pressure and
disconnected states at 80x24 and 160x48, from the fixed snapshots in tests/tui/tui_fixtures, and
the load form with a model picked from the catalog.

These run in their own pytest process (textual issue 5788: after another test in the same
process has run an event loop, ``snap_compare`` can fail with "There is no current event loop"),
so the default run skips them:

    PANTHEON_SNAPSHOTS=1 python -m pytest tests/tui/test_tui_snapshots.py -p no:cacheprovider

Add ``--snapshot-update`` to rewrite the SVGs in tests/tui/__snapshots__/test_tui_snapshots/ after
looking at the report of what changed.
"""

from __future__ import annotations

import os

import pytest
from test_tui_app import FakeClock, fixture, make_app

from tui.history import History
from tui.source import Link
from tui.widgets.header import StatusHeader

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("PANTHEON_SNAPSHOTS") != "1",
        reason="screenshot tests run in their own invocation: "
        "PANTHEON_SNAPSHOTS=1 pytest tests/tui/test_tui_snapshots.py",
    ),
    pytest.mark.timeout(120),
]

SIZES = {"80x24": (80, 24), "160x48": (160, 48)}
STALE_S = 42  # how old the data is in the disconnected screenshot


def history() -> History:
    """A fixed two-minute history, so the sparklines have a shape."""
    return History(tokens=[(37 * k) % 200 + 20 for k in range(120)], queue=[(5 * k) % 33 for k in range(120)])


def app_for(state: str):
    clock = FakeClock(1000.0)
    if state == "disconnected":
        items = [
            Link("connected"),
            fixture("normal"),
            Link("disconnected", "ConnectError: All connection attempts failed", 4.0),
        ]
    else:
        items = [Link("connected"), fixture(state)]
    app = make_app(items, clock=clock, history=History() if state == "empty" else history())

    async def run_before(pilot) -> None:
        await pilot.app.workers.wait_for_complete()  # the fixed feed is drained
        await pilot.pause()
        if state == "disconnected":
            clock.t += STALE_S
            pilot.app.query_one(StatusHeader).refresh()

    return app, run_before


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("state", ["normal", "empty", "high_pressure", "disconnected"])
def test_dashboard(snap_compare, state, size):
    app, run_before = app_for(state)
    assert snap_compare(app, terminal_size=SIZES[size], run_before=run_before)


@pytest.mark.parametrize("size", list(SIZES))
def test_load_form_picked_from_the_catalog(snap_compare, size):
    app, run_before = app_for("normal")

    async def pick(pilot) -> None:
        await run_before(pilot)
        await pilot.press("l")
        await pilot.pause()
        await pilot.press("enter", "down", "enter")  # open the picker, its first model, pick it
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZES[size], run_before=pick)
