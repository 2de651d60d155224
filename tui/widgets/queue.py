"""The queue panel (depth per model against its maximum, counters) and the sparklines."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.reactive import reactive
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from pantheon.snapshot import QueueState, Snapshot
from tui.format import human_count, join_lines
from tui.widgets import SnapshotPanel


def fill_style(frac: float) -> str:
    return "green" if frac < 0.5 else "yellow" if frac < 0.9 else "red"


def queue_line(q: QueueState, width: int) -> Text:
    """``tiny     ███░░░░░  3/32  1.2s``: how full the model's queue is, its oldest wait."""
    nums = f" {q.depth:>3}/{q.max_depth:<3}"
    wait = f" {q.oldest_wait_s:.1f}s" if q.depth else ""
    name_w = min(14, max(6, width // 4))
    room = max(4, width - name_w - 1 - len(nums) - 7)  # 7: the widest wait, ' 99.9s'
    frac = q.depth / q.max_depth if q.max_depth else 0.0
    filled = min(room, round(room * frac))
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{q.model[:name_w]:<{name_w}} ", "bold")
    t.append("█" * filled, fill_style(frac))
    t.append("░" * (room - filled), "grey42")
    t.append(nums, "bold" if q.depth else "dim")
    t.append(wait, "yellow")
    return t


class QueuePanel(SnapshotPanel):
    """Per model queue depth against its maximum, then the 429 / 503 and load counters."""

    DEFAULT_CSS = """
    QueuePanel { height: auto; }
    """

    def render(self) -> Text:
        snap = self.snapshot
        if snap is None:
            return Text("-", "dim")
        width = max(24, self.size.width)
        lines = [queue_line(q, width) for q in snap.queues] or [Text("no queues", "dim")]
        c = snap.counters
        counts = Text(no_wrap=True, overflow="ellipsis")
        counts.append(f"429 {c.rejected_429}", "bold yellow" if c.rejected_429 else "dim")
        counts.append("  ")
        counts.append(f"503 {c.rejected_503}", "bold red" if c.rejected_503 else "dim")
        counts.append(f"  loads {c.loads}  unloads {c.unloads}  ", "dim")
        counts.append(f"load failures {c.load_failures}", "bold red" if c.load_failures else "dim")
        lines.append(counts)
        return join_lines(lines)

    def get_content_height(self, container, viewport, width: int) -> int:
        snap = self.snapshot
        return 1 if snap is None else max(1, len(snap.queues)) + 1


class TailSparkline(Sparkline):
    """The newest samples at one cell each, right-aligned (Textual's Sparkline squeezes or
    stretches all of its data into the width, which would make the timebase vary)."""

    def render(self) -> SparklineRenderable:
        width = max(1, self.size.width)
        data = list(self.data or [])[-width:]
        data = [0.0] * (width - len(data)) + data  # no samples yet: the baseline
        _, base = self.background_colors
        low = base + self.get_component_styles("sparkline--min-color").color
        high = base + self.get_component_styles("sparkline--max-color").color
        return SparklineRenderable(
            data,
            width=width,
            height=self.size.height,
            min_color=low.rich_color,
            max_color=high.rich_color,
            summary_function=self.summary_function,
        )


class Throughput(Widget):
    """Tokens/s and queue depth sparklines; the App feeds ``tokens``/``queue`` per sample."""

    DEFAULT_CSS = """
    Throughput { height: auto; }
    Throughput Static { height: 1; }
    Throughput Sparkline { height: 1; margin-bottom: 0; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None)
    tokens: reactive[Sequence[float]] = reactive((), always_update=True)
    queue: reactive[Sequence[float]] = reactive((), always_update=True)

    def compose(self) -> ComposeResult:
        yield Static(id="tok-label")
        yield TailSparkline([], id="tok-spark")
        yield Static(id="queue-label")
        yield TailSparkline([], id="queue-spark")

    def on_mount(self) -> None:
        self.watch_snapshot()
        self.watch_tokens()
        self.watch_queue()

    def watch_tokens(self) -> None:
        if not self.is_mounted:
            return
        self.query_one("#tok-spark", Sparkline).data = list(self.tokens)

    def watch_queue(self) -> None:
        if not self.is_mounted:
            return
        self.query_one("#queue-spark", Sparkline).data = list(self.queue)

    def watch_snapshot(self) -> None:
        if not self.is_mounted:
            return
        snap = self.snapshot
        tp = snap.throughput if snap else None
        tok = Text(no_wrap=True, overflow="ellipsis")
        tok.append("tokens/s ", "dim")
        tok.append(f"{tp.tokens_per_s:.1f}" if tp else "-", "bold")
        if tp:
            tok.append(f"  req/s {tp.requests_per_s:.1f}", "dim")
            p50 = "-" if tp.ttft_p50_s is None else f"{1000 * tp.ttft_p50_s:.0f}ms"
            p99 = "-" if tp.ttft_p99_s is None else f"{1000 * tp.ttft_p99_s:.0f}ms"
            tok.append(f"  TTFT p50 {p50} p99 {p99}", "dim")
        queued = Text(no_wrap=True, overflow="ellipsis")
        queued.append("queued ", "dim")
        queued.append(str(sum(q.depth for q in snap.queues)) if snap else "-", "bold")
        if snap:
            c = snap.counters
            queued.append(
                f"  served {human_count(c.requests)} requests, {human_count(c.tokens)} tokens", "dim"
            )
        self.query_one("#tok-label", Static).update(tok)
        self.query_one("#queue-label", Static).update(queued)
