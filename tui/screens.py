"""The modal screens: the load form, the unload confirmation and the help screen."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, DataTable, Input, Label, ProgressBar, Select, Static

from pantheon.snapshot import CatalogModel
from tui.forms import KV_CACHE_TYPES, LoadRequest, validate_load
from tui.source import RouterError

Submit = Callable[[LoadRequest], Awaitable[dict[str, Any]]]

# The KV cache picker's lines (K and V together; pantheon/core/kv_types.py has the ratios)
KV_CHOICES = {
    "auto": "auto: the router's --kv-cache-dtype",
    "q8_0": "q8_0: ~1.9x the tokens of bf16",
    "q4_0": "q4_0: ~3.6x the tokens of bf16",
}


def catalog_option(m: CatalogModel) -> Text:
    """A picker line: the name, then where it is (and its aliases)."""
    t = Text.assemble((m.name, "bold"), no_wrap=True, overflow="ellipsis")
    if m.aliases:
        t.append(f" ({', '.join(m.aliases)})", "cyan")
    t.append(f"  {m.path}", "dim")
    return t


class LoadScreen(ModalScreen[dict | None]):
    """The load form. ``catalog`` (the router's unloaded catalog entries) fills the picker at
    the top: picking one fills the path, name, dies and quantization from it (and sets the KV
    cache back to auto), and the fields stay editable; a path typed by hand works as before. Validates locally, then runs
    ``submit`` (the router call, which returns only when the model is ready) while showing
    progress; a failure shows the router's text and keeps the form open for a fix. Dismisses
    with the router's instance JSON, or None when cancelled (Escape also cancels a running load:
    the request is dropped and the router cancels it)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="load.cancel")]

    def __init__(
        self,
        submit: Submit,
        path: str = "",
        name: str = "",
        dies: str = "",
        catalog: Sequence[CatalogModel] = (),
    ):
        super().__init__()
        self._submit = submit
        self._initial = (path, name, dies)
        self._catalog = {m.name: m for m in catalog}
        self._started: float | None = None

    def compose(self) -> ComposeResult:
        path, name, dies = self._initial
        with Vertical(id="load-dialog", classes="dialog"):
            yield Label("Load a model", classes="dialog-title")
            # One row per field (label, then the field): the form fits an 80x24 terminal.
            with Grid(id="load-fields"):
                yield Label("Catalog")
                yield Select(
                    [(catalog_option(m), m.name) for m in self._catalog.values()],
                    prompt=f"pick one of {len(self._catalog)} unloaded models"
                    if self._catalog
                    else "no unloaded model in the router's catalog",
                    disabled=not self._catalog,
                    compact=True,
                    id="catalog",
                )
                yield Label("Path")
                yield Input(
                    path, placeholder="model folder or .gguf on the router's host", id="path", compact=True
                )
                yield Label("Name")
                yield Input(name, placeholder="served name (empty: the folder's)", id="name", compact=True)
                yield Label("Dies")
                yield Input(
                    dies, placeholder="cpu:0, 0,1 or cuda:1 (empty: automatic)", id="dies", compact=True
                )
                yield Label("KV cache")
                yield Select(
                    [(KV_CHOICES[kind], kind) for kind in KV_CACHE_TYPES],
                    value="auto",
                    allow_blank=False,
                    compact=True,
                    id="kv-cache",
                )
                yield Label("")
                yield Checkbox("int8 weight-only quantization", id="quantize", compact=True)
            yield Static("", id="load-error")
            with Horizontal(id="load-progress"):
                yield ProgressBar(total=None, show_eta=False, show_percentage=False)
                yield Static("", id="load-elapsed")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Load", variant="primary", id="do-load", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#load-progress").display = False
        for field in self.query(Input):  # tests turn blinking off for stable screenshots
            field.cursor_blink = getattr(self.app, "blink", True)
        # with a catalog to pick from, the picker first (Tab reaches the path)
        self.query_one("#catalog" if self._catalog else "#path").focus()
        self.set_interval(0.5, self._tick)

    @property
    def running(self) -> bool:
        return self._started is not None

    def _tick(self) -> None:
        if self._started is not None:
            secs = time.monotonic() - self._started
            self.query_one("#load-elapsed", Static).update(f" loading… {secs:.0f}s")

    @on(Select.Changed, "#catalog")
    def _picked(self, event: Select.Changed) -> None:
        m = self._catalog.get(event.value) if isinstance(event.value, str) else None
        if m is None:
            return
        self.query_one("#path", Input).value = m.path
        self.query_one("#name", Input).value = m.name
        self.query_one("#dies", Input).value = ", ".join(m.dies)
        self.query_one("#quantize", Checkbox).value = m.quantize
        self.query_one("#kv-cache", Select).value = "auto"  # the catalog does not say one
        self.query_one("#do-load", Button).focus()  # Enter loads it

    @on(Input.Changed, "#path")
    def _path_edited(self, event: Input.Changed) -> None:
        """A path typed over a picked entry's: the picker no longer says what is loaded."""
        picker = self.query_one("#catalog", Select)
        m = self._catalog.get(picker.value) if isinstance(picker.value, str) else None
        if m is not None and event.value != m.path:
            picker.clear()

    def _show_error(self, text: str) -> None:
        self.query_one("#load-error", Static).update(Text(text, "bold red"))

    @on(Input.Submitted)
    @on(Button.Pressed, "#do-load")
    def action_submit(self) -> None:
        if self.running:
            return
        values = {k: self.query_one(f"#{k}", Input).value for k in ("path", "name", "dies")}
        kv = self.query_one("#kv-cache", Select).value
        req, errors = validate_load(
            **values,
            quantize=self.query_one(Checkbox).value,
            kv_cache_dtype=kv if isinstance(kv, str) else "auto",
        )
        for key in ("path", "name", "dies"):
            self.query_one(f"#{key}", Input).set_class(key in errors, "-invalid")
        if req is None:
            self._show_error("\n".join(errors.values()))
            return
        self._show_error("")
        self._set_running(True)
        self.run_worker(self._run(req), exclusive=True, group="load")

    def _set_running(self, running: bool) -> None:
        self._started = time.monotonic() if running else None
        self.query_one("#load-progress").display = running
        for widget in self.query("Input, Checkbox, #kv-cache, #do-load"):
            widget.disabled = running
        self.query_one("#catalog", Select).disabled = running or not self._catalog
        self._tick()

    async def _run(self, req: LoadRequest) -> None:
        try:
            result = await self._submit(req)
        except RouterError as e:
            self._set_running(False)
            self._show_error(f"the router refused the load: {e.message}")
            self.query_one("#path", Input).focus()
            return
        self.dismiss(result)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; ``y`` / ``n`` / Escape answer it from the keyboard."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no"),
    ]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog", classes="dialog"):
            yield Label(self.question, id="question")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # the safe answer is the default

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    """Every key of the dashboard, from the same binding list as the footer and the palette;
    keys that are off right now (``--readonly``) are marked."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="help.close")]

    def __init__(self, rows: Sequence[tuple[str, str, str, bool]]):
        super().__init__()
        self.rows = rows  # (key, description, help text, enabled)

    def compose(self) -> ComposeResult:
        with Vertical(id="help-dialog", classes="dialog"):
            yield Label("Keys", classes="dialog-title")
            yield DataTable(id="help-keys", cursor_type="none", show_cursor=False)
            yield Label("Click a column title to sort; ctrl+p opens the command palette.", classes="dim")
            yield Label("Escape or ? closes this help.", classes="dim")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("key", "action", "")
        for key, desc, help_text, enabled in self.rows:
            style = "" if enabled else "dim strike"
            table.add_row(
                Text(key, "bold " + style if enabled else style),
                Text(desc, style),
                Text(help_text if enabled else f"{help_text} (off: read-only)", "dim"),
            )

    def action_close(self) -> None:
        self.dismiss(None)
