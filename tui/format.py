"""Pure formatting helpers shared by the widgets: sizes, ages, pressure, memory bars, slots,
speculation.

Nothing here touches Textual (only Rich text), so the rules (how a bar splits, what a slot says)
are unit-tested without running an app.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, tzinfo

from rich.text import Text

from pantheon.snapshot import InstanceState, SlotState

PRESSURE_NAMES = ("normal", "elevated", "high", "critical")
# One colour per pressure level; the dies bars, the header badge and the queue bars share them.
PRESSURE_COLOURS = ("green", "yellow", "dark_orange", "red")


def pressure_name(level: int) -> str:
    return PRESSURE_NAMES[max(0, min(level, len(PRESSURE_NAMES) - 1))]


def pressure_colour(level: int) -> str:
    return PRESSURE_COLOURS[max(0, min(level, len(PRESSURE_COLOURS) - 1))]


def human_bytes(n: int | float) -> str:
    """``1536 -> '1.5K'``: binary units, three significant digits, short enough for a cell."""
    n = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            if unit == "B":
                return f"{int(n)}B"
            return f"{n:.0f}{unit}" if abs(n) >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """``40123554 -> '40.1M'``: counters stay short."""
    for div, unit in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def human_age(seconds: float | None) -> str:
    """The age of the data: ``'0s'``, ``'42s'``, ``'3m05s'``, ``'2h10m'``; ``'-'`` for none."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def clock_time(ts: float, tz: tzinfo | None = None) -> str:
    """``HH:MM:SS`` of a unix time in ``tz`` (local time when None; tests pass UTC)."""
    return datetime.fromtimestamp(ts, tz).strftime("%H:%M:%S")


def split_bar(weights: int, kv: int, free: int, width: int) -> tuple[int, int, int]:
    """Cells of a ``width`` bar for weights / KV / free, summing to ``width`` exactly.

    A non-zero part gets at least one cell when there is room, so a small KV cache next to big
    weights stays visible; rounding error goes to the free part, unless nothing is free (a full
    die must not look as if it had room).
    """
    w, k, f = split_parts((weights, kv), free, width)
    return w, k, f


def split_parts(used: Sequence[int], free: int, width: int) -> list[int]:
    """``split_bar`` for any number of used parts (weights / KV / recurrent state ...): the
    cells of each, then the free cells, summing to ``width`` exactly (same rules)."""
    width = max(0, width)
    parts = [max(0, u) for u in used]
    total = sum(parts) + max(0, free)
    if width == 0 or total == 0:
        return [0] * len(parts) + [width]
    cells = [round(width * u / total) for u in parts]
    for i, u in enumerate(parts):
        if u > 0 and cells[i] == 0 and width >= len(parts) + 1:
            cells[i] = 1
    while sum(cells) > width:  # rounding several up can overflow
        cells[cells.index(max(cells))] -= 1
    if free <= 0 and sum(cells) < width:
        big = parts.index(max(parts))
        cells[big] += width - sum(cells)
    return cells + [width - sum(cells)]


def slot_kind(slot: SlotState) -> str:
    """``idle`` | ``warm`` (idle, its session's blocks resident) | ``prefill`` | ``decode``."""
    if slot.state == "idle":
        return "warm" if slot.session_id else "idle"
    return slot.state


def slot_detail(slot: SlotState) -> str:
    """What a slot cell says after its kind: prefill progress, tokens so far, the session."""
    kind = slot_kind(slot)
    if kind == "prefill":
        pct = 100 * slot.prefilled // slot.prompt_tokens if slot.prompt_tokens else 0
        return f"{pct}% of {slot.prompt_tokens}"
    if kind == "decode":
        return f"{slot.generated} tok"
    if kind == "warm":
        return str(slot.session_id)
    return ""


def busy_slots(inst: InstanceState) -> int:
    return sum(1 for s in inst.slots if s.state != "idle")


def instance_state(inst: InstanceState, draining: bool = False) -> str:
    """The state column: ``loading 40%``, ``draining`` (also while our own unload runs), ..."""
    if inst.state == "loading" and inst.load_progress is not None:
        return f"loading {int(100 * inst.load_progress)}%"
    if draining and inst.state == "ready":
        return "draining"
    return inst.state


def draft_name(draft: str) -> str:
    """What drafts an instance's speculation: a draft model's path by its last part
    (``/models/draft-68m/`` -> ``draft-68m``), ``mtp`` (the model's own multi-token-prediction
    head) as it is, and ``lookup`` for "" (drafts from prompt lookup)."""
    if not draft:
        return "lookup"
    parts = [p for p in draft.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else draft


def speculation(inst: InstanceState) -> str:
    """``spec: draft-68m 71% accepted, 2.4 tok/step``: since load, the draft tokens accepted of
    those verified and the tokens a verify step gave out on average; "" while it drafted nothing."""
    if inst.spec_drafted <= 0:
        return ""
    text = f"spec: {draft_name(inst.draft)} {100 * inst.spec_accepted / inst.spec_drafted:.0f}% accepted"
    if inst.spec_verify_steps > 0:
        text += f", {inst.spec_emitted / inst.spec_verify_steps:.1f} tok/step"
    return text


STATE_STYLES = {"ready": "green", "loading": "cyan", "draining": "yellow", "failed": "bold red"}


def state_style(state: str) -> str:
    return STATE_STYLES.get(state.split()[0], "")


def join_lines(lines: list[Text]) -> Text:
    """Lines into one Text that never wraps (each line is cut with an ellipsis instead)."""
    return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)
