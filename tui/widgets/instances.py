"""The instances table: one row per instance, sortable by any column, filtered by name.

The row under the cursor is the selection; the table reports it with ``InstanceSelected`` (it does
not act on it: the App decides what the slot grid shows and what ``u`` unloads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import DataTable

from pantheon.snapshot import InstanceState, Snapshot
from tui.format import busy_slots, human_bytes, instance_state, state_style


class InstanceSelected(Message):
    """The user moved the selection (``None``: nothing left to select)."""

    def __init__(self, instance_id: str | None):
        super().__init__()
        self.instance_id = instance_id


class RowsChanged(Message):
    """The table shows other rows or another order (filter, sort, instances came or went)."""


# key, label, sort key. Labels keep two spare cells for the sort arrow, so widths never shift.
COLUMNS: list[tuple[str, str, Callable[[InstanceState], Any]]] = [
    ("name", "INSTANCE", lambda i: (i.name, i.id)),
    ("dies", "DIES", lambda i: ",".join(i.dies)),
    ("state", "STATE", lambda i: i.state),
    ("slots", "SLOTS", lambda i: (busy_slots(i), len(i.slots))),
    ("queued", "QUEUE", lambda i: i.queued),
    ("weights", "WEIGHTS", lambda i: i.weights_bytes),
    ("kv", "KV", lambda i: i.kv_bytes),
    ("hit", "HIT", lambda i: -1.0 if i.cache_hit_rate is None else i.cache_hit_rate),
]
SORT_KEYS = {key: fn for key, _, fn in COLUMNS}


def instance_label(inst: InstanceState) -> Text:
    """``tiny#1``: the id, which names the model; an id that does not gets the name added."""
    if inst.id.startswith(inst.name):
        return Text.assemble((inst.name, "bold"), (inst.id[len(inst.name) :], "dim"))
    return Text.assemble((inst.name, "bold"), (f" {inst.id}", "dim"))


def cells(inst: InstanceState, draining: bool) -> list[Text]:
    state = instance_state(inst, draining)
    hit = "-" if inst.cache_hit_rate is None else f"{100 * inst.cache_hit_rate:.0f}%"
    busy = busy_slots(inst)
    return [
        instance_label(inst),
        Text(",".join(inst.dies)),
        Text(state, state_style(state)),
        Text(f"{busy}/{len(inst.slots)}", "bold cyan" if busy else ""),
        Text(str(inst.queued), "bold yellow" if inst.queued else ""),
        Text(human_bytes(inst.weights_bytes), justify="right"),
        Text(human_bytes(inst.kv_bytes), justify="right"),
        Text(hit, justify="right"),
    ]


def visible(insts: list[InstanceState], filter_text: str, sort: str, reverse: bool) -> list[InstanceState]:
    """The rows to show: names (or ids) containing the filter, case-insensitive, sorted."""
    needle = filter_text.strip().lower()
    rows = [i for i in insts if needle in i.name.lower() or needle in i.id.lower()]
    # Ties keep the router's order (Python's sort is stable), then id breaks the rest.
    return sorted(rows, key=lambda i: (SORT_KEYS[sort](i), i.id), reverse=reverse)


class InstancesTable(DataTable):
    """Instances, with the selection kept on the same instance across refreshes and sorts."""

    snapshot: reactive[Snapshot | None] = reactive(None, always_update=True)
    filter_text: reactive[str] = reactive("")
    draining: reactive[frozenset[str]] = reactive(frozenset())

    def __init__(self, **kw):
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.sort_column = "name"
        self.sort_reverse = False
        self.selected: str | None = None

    def on_mount(self) -> None:
        for key, label, _ in COLUMNS:
            self.add_column(self._label(key, label), key=key)

    def _label(self, key: str, label: str) -> Text:
        arrow = ("▼" if self.sort_reverse else "▲") if key == self.sort_column else " "
        return Text(f"{label} {arrow}")

    # attributes down: any change re-renders the rows
    def watch_snapshot(self) -> None:
        self._update_rows()

    def watch_filter_text(self) -> None:
        self._update_rows()

    def watch_draining(self) -> None:
        self._update_rows()

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        """Sort on ``column``; the same column again flips the direction."""
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column, self.sort_reverse = column, reverse
        for key, label, _ in COLUMNS:
            self.columns[key].label = self._label(key, label)  # type: ignore[index]
        self._update_rows(force=True)
        self.refresh()

    def cycle_sort(self) -> None:
        keys = [key for key, _, _ in COLUMNS]
        self.sort_by(keys[(keys.index(self.sort_column) + 1) % len(keys)], False)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        key = event.row_key.value if event.row_key is not None else None
        if key is not None and key != self.selected:
            self._select(key)

    def _select(self, key: str | None) -> None:
        self.selected = key
        self.post_message(InstanceSelected(key))

    def shown(self) -> list[InstanceState]:
        """The instances shown, in the table's order (the slot grid follows it)."""
        snap = self.snapshot
        return visible(snap.instances if snap else [], self.filter_text, self.sort_column, self.sort_reverse)

    def _update_rows(self, force: bool = False) -> None:
        if not self.columns:  # not mounted yet: on_mount's first refresh comes later
            return
        rows = self.shown()
        keys = [i.id for i in rows]
        current = [str(row.key.value) for row in self.ordered_rows]
        if not force and keys == current:
            # Same rows in the same order: update the cells in place (cursor and scroll stay).
            for inst in rows:
                for (col, _, _), cell in zip(COLUMNS, cells(inst, inst.id in self.draining)):
                    self.update_cell(inst.id, col, cell)
            return
        self.clear()
        for inst in rows:
            self.add_row(*cells(inst, inst.id in self.draining), key=inst.id)
        self.post_message(RowsChanged())
        if self.selected in keys:
            self.move_cursor(row=keys.index(self.selected), scroll=True)
        else:
            self._select(keys[0] if keys else None)
