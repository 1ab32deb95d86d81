"""The sweep screen: one row per trial (state, devices, values, step, objective), the best
starred; Enter opens a trial's run screen, ``s`` stops a trial (``sweep --resume`` continues
it), ``p`` prunes one, ``S`` stops the sweep. The sweep's driver does what the keys ask
(sweep/driver.py reads them from the sweep's control file); this screen only reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from ...sweep import store
from ...sweep.follow import value_text
from ..widgets.text import STATE_STYLE

TRIAL_STYLE = {**STATE_STYLE, "pending": "dim", "pruned": "yellow", "pruning": "yellow"}


class SweepRead(Message):
    def __init__(self, plan: dict[str, Any], folded: dict[str, Any], steps: dict[int, Any]):
        super().__init__()
        self.plan, self.folded, self.steps = plan, folded, steps


class SweepScreen(Screen):
    BINDINGS = [
        Binding("enter", "open", "open trial", priority=False),
        Binding("s", "stop_trial", "stop trial"),
        Binding("p", "prune", "prune trial"),
        Binding("S", "stop_sweep", "stop sweep", key_display="S"),
    ]

    def __init__(self, sweep_dir: Path, refresh_s: float = 1.0) -> None:
        super().__init__()
        self.sweep_dir = Path(sweep_dir)
        self.refresh_s = refresh_s
        self.plan: dict[str, Any] = {}
        self.folded: dict[str, Any] = {}
        self.read = 0

    def compose(self) -> ComposeResult:
        yield Static("", id="sweep-title")
        yield DataTable(id="sweep", cursor_type="row", zebra_stripes=True)
        yield Static("", id="sweep-best")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#sweep", DataTable).focus()
        self.refresh_sweep()
        self.set_interval(self.refresh_s, self.refresh_sweep)

    @work(thread=True, exclusive=True, group="sweep", exit_on_error=False)
    def refresh_sweep(self) -> None:
        plan = store.read_plan(self.sweep_dir)
        folded = store.fold(store.read_events(self.sweep_dir), plan)
        steps = {}
        for row in folded["trials"]:  # where each running trial is (its status.json)
            if row["run"] and row["state"] in ("running", "pruning"):
                from ...runs import read_status

                steps[row["trial"]] = read_status(self.sweep_dir / row["run"]).get("step")
        self.post_message(SweepRead(plan, folded, steps))

    def on_sweep_read(self, message: SweepRead) -> None:
        plan, folded = message.plan, message.folded
        table = self.query_one("#sweep", DataTable)
        keys = plan["sweep"]["parameters"]
        metric = plan["objective"]["metric"]
        if not table.columns:
            for col in ["trial", "state", "devices", *keys, "step", metric]:
                table.add_column(col, key=col)
        keep = self._cursor_trial()
        best = folded["best"]["trial"] if folded["best"] else None
        table.clear()
        for r in folded["trials"]:
            star = r["trial"] == best
            step = message.steps.get(r["trial"], r.get("step"))
            table.add_row(
                Text(f"{'★ ' if star else ''}{r['trial']}", style="bold" if star else ""),
                Text(r["state"], style=TRIAL_STYLE.get(r["state"], "")),
                r["devices"] or "",
                *(value_text(r["params"].get(k, "")) for k in keys),
                "" if step is None else str(step),
                Text(
                    "" if r["objective"] is None else f"{r['objective']:.6g}",
                    style="bold" if star else "",
                ),  # fmt: skip
                key=str(r["trial"]),
            )
        if keep is not None and keep < table.row_count:
            table.move_cursor(row=keep)
        ended = sum(r["state"] in store.TRIAL_ENDS for r in folded["trials"])
        title = Text.assemble(
            ("sweep ", "bold"), (self.sweep_dir.name, "bold"),
            f"  {folded['state']}  {ended}/{len(folded['trials'])} trials ended  "
            f"{plan['sweep']['search']}, {metric} ({plan['objective']['direction']})",
        )  # fmt: skip
        self.query_one("#sweep-title", Static).update(title)
        line = ""
        if folded["best"]:
            b = folded["best"]
            line = f"best: trial {b['trial']}, {metric} = {b['objective']:.6g}  ({b['run']})"
        self.query_one("#sweep-best", Static).update(line)
        self.plan, self.folded = plan, folded
        self.read += 1

    def _cursor_trial(self) -> int | None:
        table = self.query_one("#sweep", DataTable)
        if not table.row_count:
            return None
        return table.cursor_coordinate.row

    def _row(self) -> dict[str, Any] | None:
        n = self._cursor_trial()
        trials = self.folded.get("trials") or []
        return trials[n] if n is not None and n < len(trials) else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        row = self._row()
        if row is None or not row["run"]:
            self.notify("this trial has not started", title="open")
            return
        self.app.open_run(self.sweep_dir / row["run"])

    def _ask(self, cmd: str, what: str) -> None:
        row = self._row()
        if row is None or row["state"] not in ("running",):
            self.notify(f"only a running trial can be {what}", title=what)
            return
        store.append_control(self.sweep_dir, cmd, trial=row["trial"])
        self.notify(f"trial {row['trial']}: {what} asked", title=what)

    def action_stop_trial(self) -> None:
        self._ask("stop_trial", "stopped")

    def action_prune(self) -> None:
        self._ask("prune", "pruned")

    def action_stop_sweep(self) -> None:
        store.append_control(self.sweep_dir, "stop")
        self.notify("the sweep stops: its running trials checkpoint", title="stop sweep")
