"""The dies panel: one memory bar per die, split into weights / KV cache / recurrent state (hybrid
models only) / free."""

from __future__ import annotations

from rich.text import Text

from pantheon.snapshot import DieState
from tui.format import human_bytes, join_lines, pressure_colour, pressure_name, split_parts
from tui.widgets import SnapshotPanel

WEIGHTS, KV, STATE, FREE = "█", "▓", "▒", "░"


def die_line(die: DieState, width: int) -> Text:
    """``cpu:0 ███▓▓░░░ 1.2G/2.0G P1``: the bar takes what the label and numbers leave."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{die.id:<7}", "bold")
    # a worker that was restarted says so, and why it last died, until the router restarts
    restarts = f" restarted {die.restarts}x" if die.restarts else ""
    if not die.alive:
        t.append(" DEAD ", "bold reverse red")
        t.append(f"{restarts} {die.error or 'worker gone'}", "red")
        return t
    used = die.weights_bytes + die.kv_bytes + die.state_bytes
    nums = f" {human_bytes(used)}/{human_bytes(die.budget_bytes)}"
    level = f" {pressure_name(die.pressure)}{restarts}"
    # a hybrid model's recurrent state pools, when the die holds one
    state = f" state {human_bytes(die.state_bytes)}" if die.state_bytes else ""
    detail = (
        f"  w {human_bytes(die.weights_bytes)} kv {human_bytes(die.kv_bytes)}{state}"
        f" free {human_bytes(die.free_bytes)}"
    )
    if die.host:  # a worker on another machine
        detail += f"  on {die.host}"
    if die.cpu_path or die.isa:  # how a CPU die computes: its chosen path and the ISA
        detail += f"  {die.cpu_path or '-'}{f' ({die.isa})' if die.isa else ''}"
    if die.restarts and die.last_death:
        detail += f"  last death: {die.last_death}"
    room = width - 7 - len(nums) - len(level) - 1
    if room - len(detail) >= 20:  # wide: add the split in numbers
        room -= len(detail)
    else:
        detail = ""
    w, k, s, f = split_parts((die.weights_bytes, die.kv_bytes, die.state_bytes), die.free_bytes, max(4, room))
    colour = pressure_colour(die.pressure)
    t.append(" ")
    t.append(WEIGHTS * w, colour)
    t.append(KV * k, f"{colour} dim")
    t.append(STATE * s, f"{colour} dim")
    t.append(FREE * f, "grey42")
    t.append(nums)
    t.append(level[: len(level) - len(restarts)], f"bold {colour}")
    t.append(restarts, "bold yellow")
    t.append(detail, "dim")
    return t


class DiesPanel(SnapshotPanel):
    """Memory per die, coloured by its pressure level, plus the host's available memory."""

    DEFAULT_CSS = """
    DiesPanel { height: auto; }
    """

    def render(self) -> Text:
        snap = self.snapshot
        if snap is None:
            return Text("waiting for the router…", "dim")
        width = max(20, self.size.width)
        lines = [die_line(d, width) for d in snap.dies] or [Text("no dies", "dim")]
        if snap.host_total_bytes:
            lines.append(
                Text(
                    f"host   {human_bytes(snap.host_available_bytes)} available of "
                    f"{human_bytes(snap.host_total_bytes)}",
                    "dim",
                )
            )
        legend = Text(no_wrap=True)
        parts = [(WEIGHTS, "weights", ""), (KV, "KV cache", "dim")]
        if any(d.state_bytes for d in snap.dies):  # a hybrid model's recurrent state is booked
            parts.append((STATE, "state", "dim"))
        for ch, label, style in (*parts, (FREE, "free", "grey42")):
            legend.append(f"{ch}{ch} ", style)
            legend.append(f"{label}  ", "dim")
        lines.append(legend)
        return join_lines(lines)

    def get_content_height(self, container, viewport, width: int) -> int:
        snap = self.snapshot
        if snap is None:
            return 1
        return max(1, len(snap.dies)) + (1 if snap.host_total_bytes else 0) + 1
