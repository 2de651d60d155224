"""The event log: the router's recent events, each shown once, newest at the bottom."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from datetime import tzinfo

from rich.text import Text
from textual.widget import Widget

from pantheon.snapshot import Event
from tui.format import clock_time, join_lines

KIND_STYLES = {
    "load": "cyan",
    "loaded": "green",
    "load_failed": "bold red",
    "unload": "cyan",
    "unloaded": "green",
    "worker_dead": "bold red",
    "reject_429": "yellow",
    "reject_503": "red",
}


def event_key(e: Event) -> tuple[float, str, str]:
    return (e.ts, e.kind, e.message)


class EventLog(Widget):
    """Every snapshot repeats the router's recent events; ``add`` keeps the new ones only
    (identity is ts + kind + message), so polling twice never shows an event twice."""

    def __init__(self, tz: tzinfo | None = None, keep: int = 500, **kw):
        super().__init__(**kw)
        self._tz = tz
        self._events: deque[Event] = deque(maxlen=keep)
        self._seen: set[tuple[float, str, str]] = set()

    @property
    def events(self) -> list[Event]:
        return list(self._events)

    def add(self, events: Iterable[Event]) -> int:
        """Append the events not seen yet (kept in time order); returns how many were new."""
        new = [e for e in events if event_key(e) not in self._seen]
        if not new:
            return 0
        for e in sorted(new, key=lambda e: e.ts):
            if len(self._events) == self._events.maxlen:
                self._seen.discard(event_key(self._events[0]))
            self._events.append(e)
            self._seen.add(event_key(e))
        self.refresh()
        return len(new)

    def render(self) -> Text:
        height = max(1, self.size.height)
        if not self._events:
            return Text("no events yet", "dim")
        lines = []
        for e in list(self._events)[-height:]:
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append(clock_time(e.ts, self._tz), "dim")
            t.append(f" {e.kind:<12}", KIND_STYLES.get(e.kind, "bold"))
            t.append(f" {e.message}")
            lines.append(t)
        return join_lines(lines)
