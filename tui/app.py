"""``pantheon tui``: the live dashboard of a Pantheon router.

    pantheon tui [--url http://127.0.0.1:8000] [--admin-key KEY] [--readonly] [--interval 1]

Attributes down, messages up: the App owns the latest ``Snapshot`` (one object per refresh) and
pushes it into the panels through their reactive attributes; panels post messages up
(``InstanceSelected``, ``FilterBar.Done``). The data source is injected (``PantheonApp(source=)``):
``RouterClient`` over HTTP for real, ``StaticSource`` in tests. The footer, the help screen and the
command palette are all built from ``KEYS``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable
from datetime import tzinfo
from functools import partial
from typing import ClassVar

from textual import events, on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Input

from pantheon.snapshot import Event, InstanceState, Snapshot
from tui.forms import LoadRequest
from tui.history import History
from tui.screens import ConfirmScreen, HelpScreen, LoadScreen
from tui.source import DISCONNECTED, Link, RouterError, Source
from tui.widgets.catalog import CatalogPanel
from tui.widgets.dies import DiesPanel
from tui.widgets.events import EventLog
from tui.widgets.filter import FilterBar
from tui.widgets.header import StatusHeader
from tui.widgets.instances import InstanceSelected, InstancesTable, RowsChanged
from tui.widgets.queue import QueuePanel, Throughput
from tui.widgets.slots import SlotGrid

# The one list of keys: the footer, the help screen and the command palette all read it, and the
# ids make each key rebindable through Textual's keymap.
KEYS = [
    Binding(
        "l", "load", "Load", id="load", tooltip="Load a model: pick one from the catalog, or give its path"
    ),
    Binding(
        "u", "unload", "Unload", id="unload", tooltip="Unload the selected instance (asks first; it drains)"
    ),
    Binding("space", "pause", "Pause", id="pause", tooltip="Freeze or resume the display"),
    Binding(
        "slash", "filter", "Filter", id="filter", key_display="/", tooltip="Filter the instances by name"
    ),
    Binding("s", "sort", "Sort", id="sort", tooltip="Sort the instances by the next column"),
    Binding("question_mark", "help", "Help", id="help", key_display="?", tooltip="Show every key"),
    Binding("q", "quit", "Quit", id="quit", tooltip="Leave the dashboard"),
]
WRITE_ACTIONS = {"load", "unload"}  # what --readonly turns off
DASHBOARD_ACTIONS = {b.action for b in KEYS}


class PantheonApp(App[int]):
    """The dashboard. ``clock`` (seconds) dates the data for its age and ``tz`` formats event
    times: tests inject fixed ones. ``sample_every`` is the sparklines' timebase (None: no
    sampling timer, for deterministic screenshots; seed ``history`` instead)."""

    CSS_PATH = "app.tcss"
    TITLE = "Pantheon"
    BINDINGS: ClassVar[list[BindingType]] = list(KEYS)  # Textual's declared type (Binding | tuple)
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]

    snapshot: reactive[Snapshot | None] = reactive(None)
    link: reactive[Link] = reactive(Link("connecting"))
    selected: reactive[str | None] = reactive(None, bindings=True)
    draining: reactive[frozenset[str]] = reactive(frozenset(), bindings=True)
    paused: reactive[bool] = reactive(False)
    filter_text: reactive[str] = reactive("")

    def __init__(
        self,
        source: Source,
        *,
        readonly: bool = False,
        clock: Callable[[], float] = time.monotonic,
        tz: tzinfo | None = None,
        sample_every: float | None = 1.0,
        history: History | None = None,
        blink: bool = True,
    ):
        super().__init__()
        self.source = source
        self.readonly = readonly
        self.clock = clock
        self.tz = tz
        self.sample_every = sample_every
        self.history = history or History()
        self.blink = blink
        self.latest: Snapshot | None = None  # newest received; shown unless paused
        self._latest_at: float | None = None  # clock() when it came

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield StatusHeader(self.clock, id="status")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield DiesPanel(id="dies", classes="panel")
                yield InstancesTable(id="instances", classes="panel")
                yield SlotGrid(id="slots", classes="panel")
            with Vertical(id="right"):
                yield QueuePanel(id="queue", classes="panel")
                yield CatalogPanel(self.clock, id="catalog", classes="panel")
                yield Throughput(id="throughput", classes="panel")
                yield EventLog(self.tz, id="events", classes="panel")
        bar = FilterBar(placeholder="filter instances by name (Enter keeps, Escape clears)", id="filter")
        bar.cursor_blink = self.blink
        yield bar
        yield Footer()

    def on_mount(self) -> None:
        titles = {
            "dies": "Dies",
            "instances": "Instances",
            "slots": "Slots",
            "queue": "Queues",
            "catalog": "Models",
            "throughput": "Throughput",
            "events": "Events",
        }
        for wid, title in titles.items():
            self.query_one(f"#{wid}").border_title = title
        self.query_one(FilterBar).display = False
        self.query_one(StatusHeader).url = self.source.url
        self.query_one(InstancesTable).focus()
        if self.sample_every:
            self.set_interval(self.sample_every, self._sample)
        self._push_history()
        self.run_worker(self._consume(), name="feed", group="feed", exit_on_error=False)

    async def on_unmount(self) -> None:
        await self.source.aclose()

    # ------------------------------------------------------------ the feed

    async def _consume(self) -> None:
        try:
            async for item in self.source.updates():
                if isinstance(item, Snapshot):
                    self.receive(item)
                elif isinstance(item, Link):
                    self.link = item
                elif isinstance(item, Event):
                    self.query_one(EventLog).add([item])
        except Exception as e:  # noqa: BLE001 - a broken source must not kill the dashboard
            self.link = Link(DISCONNECTED, f"feed stopped: {type(e).__name__}: {e}")

    def receive(self, snap: Snapshot) -> None:
        """A new snapshot from the source; shown at once unless the display is paused."""
        self.latest, self._latest_at = snap, self.clock()
        if not self.paused:
            self._show()

    def _show(self) -> None:
        self.snapshot = self.latest
        self.query_one(StatusHeader).received_at = self._latest_at  # the age of what is shown
        self.query_one(CatalogPanel).received_at = self._latest_at  # expiries count down from it

    def _sample(self) -> None:
        if not self.paused:
            self.history.sample(self.snapshot)
            self._push_history()

    def _push_history(self) -> None:
        tp = self.query_one(Throughput)
        tp.tokens, tp.queue = self.history.tokens, self.history.queue

    # ------------------------------------------------------------ attributes down

    def watch_snapshot(self, snap: Snapshot | None) -> None:
        if snap is None:
            return
        present = {i.id for i in snap.instances}
        if self.draining - present:  # an unloaded instance is gone: its drain is over
            self.draining = self.draining & present
        self.query_one(StatusHeader).pressure = snap.pressure
        for panel in (DiesPanel, InstancesTable, QueuePanel, CatalogPanel, Throughput):
            self.query_one(panel).snapshot = snap
        self.query_one(EventLog).add(snap.events)
        self._push_selection()

    def watch_link(self, link: Link) -> None:
        self.query_one(StatusHeader).link = link

    def watch_selected(self) -> None:
        self._push_selection()

    def watch_draining(self, draining: frozenset[str]) -> None:
        self.query_one(InstancesTable).draining = draining
        self._push_selection()

    def watch_paused(self, paused: bool) -> None:
        self.query_one(StatusHeader).paused = paused
        if not paused and self.latest is not self.snapshot:
            self._show()

    def watch_filter_text(self, text: str) -> None:
        self.query_one(InstancesTable).filter_text = text
        self.query_one(StatusHeader).filter_text = text

    def selected_instance(self) -> InstanceState | None:
        snap = self.snapshot
        if snap is None or self.selected is None:
            return None
        return next((i for i in snap.instances if i.id == self.selected), None)

    def _push_selection(self) -> None:
        grid = self.query_one(SlotGrid)
        grid.instances = tuple(self.query_one(InstancesTable).shown())
        grid.selected = self.selected
        grid.draining = self.draining

    def on_resize(self, event: events.Resize) -> None:
        # Wide terminals have room for every instance's slots; narrow ones show the selected.
        self.query_one(SlotGrid).show_all = event.size.width >= 120

    # ------------------------------------------------------------ messages up

    def on_instance_selected(self, message: InstanceSelected) -> None:
        self.selected = message.instance_id

    def on_rows_changed(self, message: RowsChanged) -> None:
        self._push_selection()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value

    def on_filter_bar_done(self, message: FilterBar.Done) -> None:
        bar = self.query_one(FilterBar)
        if message.cleared or not bar.value:
            bar.display = False
        self.query_one(InstancesTable).focus()

    # ------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action not in DASHBOARD_ACTIONS:
            return True
        if self.screen is not self.screen_stack[0]:
            return False  # a modal is open: its own keys only
        return self._allowed(action)

    def _allowed(self, action: str) -> bool | None:
        """Whether a dashboard action may run now: None greys it out (footer, palette)."""
        if action in WRITE_ACTIONS and self.readonly:
            return None  # shown greyed out
        if action == "unload" and (self.selected_instance() is None or self.selected in self.draining):
            return None
        return True

    def action_load(self) -> None:
        snap = self.snapshot
        unloaded = [m for m in snap.catalog if m.status == "unloaded"] if snap is not None else []
        self.push_screen(LoadScreen(self._submit_load, catalog=unloaded), self._loaded)

    async def _submit_load(self, req: LoadRequest) -> dict:
        return await self.source.load(req.path, req.name, req.dies, req.quantize, req.kv_cache_dtype)

    def _loaded(self, result: dict | None) -> None:
        if result:
            where = ",".join(result.get("dies") or [])
            self.notify(
                f"loaded {result.get('instance') or result.get('name')}" + (f" on {where}" if where else ""),
                title="Load",
            )

    def action_unload(self) -> None:
        inst = self.selected_instance()
        if inst is None:
            return
        question = f"Unload {inst.id} ({inst.name})?\nIts {inst.in_flight} in-flight requests finish first."
        self.push_screen(ConfirmScreen(question), partial(self._confirmed_unload, inst.id))

    def _confirmed_unload(self, instance_id: str, yes: bool | None) -> None:
        if yes:
            self.draining = self.draining | {instance_id}
            self.run_worker(self._unload(instance_id), group="unload")

    async def _unload(self, instance_id: str) -> None:
        try:
            await self.source.unload(instance_id)
        except RouterError as e:
            self.draining = self.draining - {instance_id}
            self.notify(
                f"unload {instance_id} failed: {e.message}", title="Unload", severity="error", timeout=10
            )

    def action_pause(self) -> None:
        self.paused = not self.paused

    def action_filter(self) -> None:
        bar = self.query_one(FilterBar)
        bar.display = True
        bar.focus()

    def action_sort(self) -> None:
        self.query_one(InstancesTable).cycle_sort()

    def key_rows(self) -> list[tuple[str, str, str, bool]]:
        """(key, description, help, enabled) per binding, for the help screen; "enabled" is
        False only for what ``--readonly`` turns off (not for "nothing selected yet")."""
        return [
            (
                self.get_key_display(b),
                b.description,
                b.tooltip,
                not (self.readonly and b.action in WRITE_ACTIONS),
            )
            for b in KEYS
        ]

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.key_rows()))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # The palette offers the same keys (those usable now), then Textual's own commands.
        if screen is self.screen_stack[0]:
            for b in KEYS:
                if self._allowed(b.action) is True:
                    yield SystemCommand(b.description, b.tooltip, partial(self.run_action, b.action))
        yield from super().get_system_commands(screen)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pantheon tui", description="The live dashboard of a Pantheon router.")
    ap.add_argument(
        "--url",
        default=os.environ.get("PANTHEON_URL", "http://127.0.0.1:8000"),
        help="the router's base URL (default http://127.0.0.1:8000, or $PANTHEON_URL)",
    )
    ap.add_argument(
        "--admin-key",
        default=os.environ.get("PANTHEON_ADMIN_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default $PANTHEON_ADMIN_KEY)",
    )
    ap.add_argument("--readonly", action="store_true", help="turn off load and unload")
    ap.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (default 1)"
    )
    ap.add_argument(
        "--sse", action="store_true", help="follow /admin/events instead of polling (falls back when absent)"
    )
    return ap


def cli(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    if not ns.url.startswith(("http://", "https://")):
        ap.error(f"--url must start with http:// or https:// (got {ns.url!r})")
    if not ns.interval > 0:
        ap.error("--interval must be a positive number of seconds")
    from tui.client import RouterClient

    source = RouterClient(ns.url, ns.admin_key, interval=ns.interval, sse=ns.sse)
    app = PantheonApp(source, readonly=ns.readonly)
    app.run()
    return int(app.return_code or 0)
