"""The model catalog: every model the router can serve, loaded or not, one line each.

A line says the model's status (loaded, loading, failed, unloaded), then for a loaded one how
long until its keep-alive unloads it if it stays idle (counted down between snapshots from the
injected clock), for a failed one why, else its configured keep-alive; then its aliases and
path. Loaded and loading models come first; when the panel is too short for all, the last line
says how many more there are (the load form's picker lists every unloaded one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.text import Text
from textual.reactive import reactive

from pantheon.snapshot import CatalogModel
from tui.format import human_age, join_lines
from tui.widgets import SnapshotPanel

MARKS = {
    "loaded": ("●", "green"),
    "loading": ("◐", "cyan"),
    "failed": ("✗", "bold red"),
    "unloaded": ("○", "grey50"),
}
RANK = {"loaded": 0, "loading": 1, "failed": 2, "unloaded": 3}
SOON_S = 30  # an expiry closer than this is shown in yellow
WHEN_W = 15  # the width of the expiry / keep-alive column


def ordered(catalog: Sequence[CatalogModel]) -> list[CatalogModel]:
    """Loaded, loading, failed, then unloaded models; the router's order within each."""
    return sorted(catalog, key=lambda m: RANK.get(m.status, len(RANK)))


def when(m: CatalogModel, elapsed: float) -> tuple[str, str]:
    """(text, style) of the keep-alive column; ``elapsed``: seconds since the snapshot came."""
    if m.status == "loaded":
        if m.expires_in_s is None:
            return ("pinned", "blue") if m.pinned else ("no expiry", "dim")
        left = max(0.0, m.expires_in_s - elapsed)
        return f"expires {human_age(left)}", "yellow" if left < SOON_S else ""
    if m.pinned:
        return "pinned", "blue"
    if m.keep_alive_s is not None:
        return ("keep forever" if m.keep_alive_s < 0 else f"keep {human_age(m.keep_alive_s)}"), "dim"
    return "", ""


def catalog_line(m: CatalogModel, name_w: int, elapsed: float) -> Text:
    """``● tiny      loaded   expires 2m05s   /models/tiny``."""
    mark, style = MARKS.get(m.status, ("?", "red"))
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{mark} ", style)
    t.append(f"{m.name[:name_w]:<{name_w}} ", "bold")
    t.append(f"{m.status:<10}", style if m.status != "unloaded" else "dim")
    if m.status == "failed":  # why, with all the room there is
        t.append(m.reason or "failed", "red")
        return t
    text, when_style = when(m, elapsed)
    t.append(f"{text:<{WHEN_W}} ", when_style)
    if m.aliases:
        t.append(f"aka {', '.join(m.aliases)}  ", "cyan")
    t.append(m.path, "dim")
    return t


class CatalogPanel(SnapshotPanel):
    """The catalog of the snapshot the App sets; ``received_at`` (the App's clock when it came)
    and the injected ``clock`` count the expiries down, redrawn every second."""

    DEFAULT_CSS = """
    CatalogPanel { height: auto; }
    """

    received_at: reactive[float | None] = reactive(None)

    def __init__(self, clock: Callable[[], float], **kw):
        super().__init__(**kw)
        self._clock = clock

    def on_mount(self) -> None:
        self.set_interval(1.0, self.refresh)

    def _elapsed(self) -> float:
        return 0.0 if self.received_at is None else max(0.0, self._clock() - self.received_at)

    def render(self) -> Text:
        snap = self.snapshot
        if snap is None:
            return Text("-", "dim")
        if not snap.catalog:
            return Text("no models in the catalog (--models-dir, [[models]])", "dim")
        models = ordered(snap.catalog)
        height = max(1, self.size.height)
        shown = models if len(models) <= height else models[: height - 1]
        name_w = min(20, max(6, self.size.width // 4), max(len(m.name) for m in models))
        elapsed = self._elapsed()
        lines = [catalog_line(m, name_w, elapsed) for m in shown]
        rest = models[len(shown) :]
        if rest:
            hint = " (l picks one to load)" if all(m.status == "unloaded" for m in rest) else ""
            lines.append(Text(f"+{len(rest)} more{hint}", "dim"))
        return join_lines(lines)

    def get_content_height(self, container, viewport, width: int) -> int:
        snap = self.snapshot
        return 1 if snap is None else max(1, len(snap.catalog))
