"""The dashboard's panels. Each takes its data as attributes set by the App (never fetches)
and reports user intent with messages (``InstanceSelected``)."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widget import Widget

from pantheon.snapshot import Snapshot


class AutoHeight(Widget):
    """A panel whose height follows its data (``height: auto``).

    A layout request made while the screen is mid-refresh (the first snapshot arrives during
    the first layout) can be dropped, leaving the panel at its old height; asking again once
    that refresh is done makes the new height stick.
    """

    def relayout(self) -> None:
        self.call_after_refresh(self.refresh, layout=True)


class SnapshotPanel(AutoHeight):
    """An auto-height panel drawn from the whole Snapshot, which the App sets each refresh."""

    snapshot: reactive[Snapshot | None] = reactive(None, layout=True)

    def watch_snapshot(self) -> None:
        self.relayout()
