"""The ``/`` filter line: typing filters the instances table live."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input


class FilterBar(Input):
    """An Input docked at the bottom; Enter keeps the filter, Escape clears it. It reports with
    ``FilterBar.Done`` so the App can hide it and give the focus back to the table."""

    BINDINGS = [Binding("escape", "clear_filter", "Clear filter", show=False, id="filter.clear")]

    class Done(Message):
        """Editing ended; ``cleared`` when Escape dropped the filter."""

        def __init__(self, cleared: bool):
            super().__init__()
            self.cleared = cleared

    def action_clear_filter(self) -> None:
        self.value = ""
        self.post_message(self.Done(cleared=True))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.Done(cleared=False))
