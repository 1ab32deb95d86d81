"""The runs screen: every run under the runs directory, newest first; Enter attaches; Space
marks runs and x compares two of them (``gpu-console diff``)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from ...commands.runs import LS_COLUMNS
from ...format import steps_text
from ..messages import RunsListed
from ..widgets.text import STATE_STYLE, human_duration, num
from .modals import DiffScreen


def ago(now: float, t: float | None) -> str:
    return "-" if t is None else human_duration(now - t) + " ago"


class RunsScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "back"),
        Binding("enter", "attach", "attach", show=True, priority=False),
        Binding("space", "mark", "mark"),
        Binding("x", "compare", "compare two"),
    ]

    def __init__(self, runs_dir: Path, refresh_s: float = 2.0) -> None:
        super().__init__()
        self.runs_dir = Path(runs_dir)
        self.refresh_s = refresh_s
        self.rows: list[dict] = []
        self.listed = 0
        self.marked: list[str] = []  # run paths, at most two: x compares them

    def compose(self) -> ComposeResult:
        yield Static(Text.assemble(("runs", "bold"), f"  under {self.runs_dir}"), id="runs-title")
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Static("", id="runs-empty")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        table = self.query_one("#runs", DataTable)
        for col in LS_COLUMNS:  # the same columns as `gpu-console ls`
            table.add_column(col, key=col)
        table.focus()
        self.refresh_list()
        self.set_interval(self.refresh_s, self.refresh_list)

    @work(thread=True, exclusive=True, group="runs", exit_on_error=False)
    def refresh_list(self) -> None:
        from ...commands.runs import list_runs

        self.post_message(RunsListed(list_runs(self.runs_dir)))

    def on_runs_listed(self, message: RunsListed) -> None:
        table = self.query_one("#runs", DataTable)
        keep = self._cursor_key()
        self.rows = message.rows
        table.clear()
        now = time.time()
        for r in message.rows:
            step = steps_text(r["step"], r["max_steps"], commas=True)
            damaged = " (damaged)" if r.get("damaged") else ""  # ls says what it lacks
            state = Text(r["state"] + damaged, style=STATE_STYLE.get(r["state"], ""))
            mark = "● " if r["path"] in self.marked else ""
            table.add_row(
                Text(mark + r["name"], style="bold" if mark else ""),
                state,
                step,
                num(r["loss"]),
                *(ago(now, r[when]) for when in ("started", "updated")),
                key=r["path"],
            )
        if keep is not None and keep in {r["path"] for r in message.rows}:
            table.move_cursor(row=table.get_row_index(keep))
        empty = self.query_one("#runs-empty", Static)
        empty.update("" if message.rows else f"no runs under {self.runs_dir} yet")
        self.listed += 1

    def _cursor_key(self) -> str | None:
        table = self.query_one("#runs", DataTable)
        if not table.row_count:
            return None
        try:
            return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        except Exception:
            return None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value:
            self.app.open_run(Path(event.row_key.value))

    def action_attach(self) -> None:
        key = self._cursor_key()
        if key:
            self.app.open_run(Path(key))

    def action_mark(self) -> None:
        """Mark the run under the cursor (again: unmark it); a third mark drops the first."""
        key = self._cursor_key()
        if not key:
            return
        if key in self.marked:
            self.marked.remove(key)
        else:
            self.marked = [*self.marked, key][-2:]
        self.on_runs_listed(RunsListed(self.rows))

    def action_compare(self) -> None:
        """The two marked runs side by side; one marked: it and the run under the cursor."""
        pair = list(self.marked)
        key = self._cursor_key()
        if len(pair) == 1 and key and key != pair[0]:
            pair.append(key)
        if len(pair) != 2:
            self.notify("mark two runs with Space, then x compares them", title="compare")
            return
        self._compare(pair[0], pair[1])

    @work(thread=True, exclusive=True, group="compare", exit_on_error=False)
    def _compare(self, a: str, b: str) -> None:
        from ...commands import diff
        from ...runs import RunDirError

        try:
            shown = diff.renderables(diff.compare(a, b, self.runs_dir))
        except (RunDirError, OSError) as e:
            self.app.call_from_thread(self.notify, str(e), title="compare", severity="error")
            return
        self.app.call_from_thread(self.app.push_screen, DiffScreen(shown))

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 1:
            self.app.pop_screen()
