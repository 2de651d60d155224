"""The slot grid of the selected instance: idle, warm session, prefill progress, decode tokens; and
under its heading, its speculation once it drafted (``tui.format.speculation``)."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from pantheon.snapshot import InstanceState, SlotState
from tui.format import busy_slots, instance_state, join_lines, slot_kind, speculation, state_style
from tui.widgets import AutoHeight

CELL = 24  # characters per slot cell, separator included
MARKS = {
    "idle": ("·", "grey50"),
    "warm": ("○", "blue"),
    "prefill": ("◐", "bold yellow"),
    "decode": ("▶", "bold green"),
}


def slot_cell(index: int, slot: SlotState) -> Text:
    """One cell, exactly ``CELL - 1`` wide: ``#3 ▶ decode 137 tok``."""
    kind = slot_kind(slot)
    mark, style = MARKS.get(kind, ("?", "red"))
    t = Text(no_wrap=True, overflow="crop")
    t.append(f"#{index:<2}", "dim")
    t.append(f"{mark} ", style)
    if kind == "prefill":
        done = slot.prefilled / slot.prompt_tokens if slot.prompt_tokens else 0.0
        filled = round(5 * done)
        t.append("prefill ", style)
        t.append("▰" * filled + "▱" * (5 - filled), "yellow")
        t.append(f"{int(100 * done):>4}%")
    elif kind == "decode":
        t.append("decode ", style)
        t.append(f"{slot.generated} tok")
    elif kind == "warm":
        t.append("warm ", style)
        t.append(str(slot.session_id), "blue")
    else:
        t.append("idle", style)
    t.truncate(CELL - 1, pad=True)
    return t


def load_bar(progress: float, width: int) -> Text:
    filled = round(width * max(0.0, min(1.0, progress)))
    return Text("█" * filled, "cyan") + Text("░" * (width - filled), "grey42")


class SlotGrid(AutoHeight):
    """Slots per instance. The App sets ``instances`` (the table's rows, in its order) and
    ``selected`` every refresh; with ``show_all`` off (narrow terminals) only the selected
    instance is drawn, else every instance, the selected one marked."""

    DEFAULT_CSS = """
    SlotGrid { height: auto; }
    """

    instances: reactive[tuple[InstanceState, ...]] = reactive((), layout=True)
    selected: reactive[str | None] = reactive(None, layout=True)
    draining: reactive[frozenset[str]] = reactive(frozenset())
    show_all: reactive[bool] = reactive(False, layout=True)

    def watch_instances(self) -> None:
        self.relayout()

    def watch_selected(self) -> None:
        self.relayout()

    def watch_show_all(self) -> None:
        self.relayout()

    def _block(self, inst: InstanceState, width: int, marked: bool) -> list[Text]:
        state = instance_state(inst, inst.id in self.draining)
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append("▶ " if marked else "  ", "bold cyan")
        head.append(inst.id, "bold reverse" if marked else "bold")
        head.append(f"  {state}", state_style(state))
        head.append(
            f"  {busy_slots(inst)}/{len(inst.slots)} busy  in flight {inst.in_flight}  queued {inst.queued}",
            "dim",
        )
        if inst.quantized:
            head.append("  int8", "magenta")
        if inst.kv_cache_dtype != "auto":  # a quantized KV cache: more tokens, a little less exact
            head.append(f"  KV {inst.kv_cache_dtype}", "magenta")
        lines = [head]
        spec = speculation(inst)
        if spec:  # it drafted: the draft (or lookup), how much of it was kept, tokens per step
            lines.append(Text(f"  {spec}", "dim"))
        if inst.state == "loading":
            lines.append(Text("  loading ") + load_bar(inst.load_progress or 0.0, 20))
        if inst.state == "failed":
            lines.append(Text(f"  {inst.error or 'failed'}", "red"))
        per_row = max(1, (width - 1) // CELL)
        for start in range(0, len(inst.slots), per_row):
            row = Text("  ", no_wrap=True, overflow="crop")
            for n, slot in enumerate(inst.slots[start : start + per_row], start):
                if n > start:
                    row.append(" ")
                row.append_text(slot_cell(n, slot))
            lines.append(row)
        return lines

    def _lines(self, width: int) -> list[Text]:
        chosen = [i for i in self.instances if i.id == self.selected]
        shown = list(self.instances) if self.show_all else chosen
        if not shown:
            return [
                Text("no instance selected" if self.instances else "no instances (l loads a model)", "dim")
            ]
        lines: list[Text] = []
        for inst in shown:
            lines += self._block(inst, width, marked=self.show_all and inst.id == self.selected)
        return lines

    def render(self) -> Text:
        return join_lines(self._lines(max(CELL, self.size.width)))

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self._lines(max(CELL, width)))
