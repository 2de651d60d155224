"""The modal screens: the load form, the unload confirmation and the help screen."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, DataTable, Input, Label, ProgressBar, Static

from tui.forms import LoadRequest, validate_load
from tui.source import RouterError

Submit = Callable[[LoadRequest], Awaitable[dict[str, Any]]]


class LoadScreen(ModalScreen[dict | None]):
    """The load form. Validates locally, then runs ``submit`` (the router call, which returns only
    when the model is ready) while showing progress; a failure shows the router's text and keeps
    the form open for a fix. Dismisses with the router's instance JSON, or None when cancelled
    (Escape also cancels a running load: the request is dropped and the router cancels it)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="load.cancel")]

    def __init__(self, submit: Submit, path: str = "", name: str = "", dies: str = ""):
        super().__init__()
        self._submit = submit
        self._initial = (path, name, dies)
        self._started: float | None = None

    def compose(self) -> ComposeResult:
        path, name, dies = self._initial
        with Vertical(id="load-dialog", classes="dialog"):
            yield Label("Load a model", classes="dialog-title")
            yield Label("Model folder (on the router's host)")
            yield Input(path, placeholder="/models/qwen3-0.6b", id="path")
            yield Label("Served name (empty: the folder's name)")
            yield Input(name, placeholder="qwen3", id="name")
            yield Label("Dies (cpu:0, 0,1 or cuda:1; empty: automatic)")
            yield Input(dies, placeholder="cpu:0", id="dies")
            yield Checkbox("int8 weight-only quantization", id="quantize")
            yield Static("", id="load-error")
            with Horizontal(id="load-progress"):
                yield ProgressBar(total=None, show_eta=False, show_percentage=False)
                yield Static("", id="load-elapsed")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Load", variant="primary", id="do-load")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#load-progress").display = False
        for field in self.query(Input):  # tests turn blinking off for stable screenshots
            field.cursor_blink = getattr(self.app, "blink", True)
        self.query_one("#path", Input).focus()
        self.set_interval(0.5, self._tick)

    @property
    def running(self) -> bool:
        return self._started is not None

    def _tick(self) -> None:
        if self._started is not None:
            secs = time.monotonic() - self._started
            self.query_one("#load-elapsed", Static).update(f" loading… {secs:.0f}s")

    def _show_error(self, text: str) -> None:
        self.query_one("#load-error", Static).update(Text(text, "bold red"))

    @on(Input.Submitted)
    @on(Button.Pressed, "#do-load")
    def action_submit(self) -> None:
        if self.running:
            return
        values = {k: self.query_one(f"#{k}", Input).value for k in ("path", "name", "dies")}
        req, errors = validate_load(**values, quantize=self.query_one(Checkbox).value)
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
        for widget in self.query("Input, Checkbox, #do-load"):
            widget.disabled = running
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
