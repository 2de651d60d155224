"""The top line: router URL, connection state, the age of the data, pressure, pause and filter."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tui.format import human_age, pressure_colour, pressure_name
from tui.source import CONNECTED, CONNECTING, Link

LINK_STYLES = {CONNECTED: "bold green", CONNECTING: "bold yellow"}


class StatusHeader(Widget):
    """One line of status. The age is recomputed every second from the injected ``clock``
    (a fixed clock in tests), so it moves even when no snapshot arrives."""

    DEFAULT_CSS = """
    StatusHeader { height: 1; background: $panel; }
    """

    url: reactive[str] = reactive("")
    link: reactive[Link] = reactive(Link(CONNECTING))
    received_at: reactive[float | None] = reactive(None)  # clock() when the data arrived
    pressure: reactive[int | None] = reactive(None)
    paused: reactive[bool] = reactive(False)
    filter_text: reactive[str] = reactive("")

    def __init__(self, clock: Callable[[], float], **kw):
        super().__init__(**kw)
        self._clock = clock

    def on_mount(self) -> None:
        self.set_interval(1.0, self.refresh)

    def render(self) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" Pantheon ", "bold reverse")
        t.append(f" {self.url} ", "bold")
        link = self.link
        t.append(f" {link.state} ", LINK_STYLES.get(link.state, "bold red"))
        age = None if self.received_at is None else self._clock() - self.received_at
        t.append(" data ", "dim")
        t.append(human_age(age), "bold" if age is None or age < 5 else "bold yellow")
        if self.pressure is not None:
            t.append("  pressure ", "dim")
            t.append(f" {pressure_name(self.pressure)} ", f"bold black on {pressure_colour(self.pressure)}")
        if self.paused:
            t.append("  PAUSED ", "bold reverse yellow")
        if self.filter_text:
            t.append(f"  filter: {self.filter_text}", "italic cyan")
        if link.state != CONNECTED and link.error:  # last: the long part, cut at the edge
            retry = f", retry in {link.retry_in:.0f}s" if link.retry_in else ""
            t.append(f"  {link.error}{retry}", "red")
        return t
