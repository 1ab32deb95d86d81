"""``gpu-console report RUN… [--out DIR]``: a run's report, PNG plots and one HTML page.

The plots (:mod:`.plots`, from :mod:`.curves`' numbers): the train loss (its interval means
smoothed as TensorBoard does, over the raw line) and every eval metric over steps, every
train metric the task logs, samples/s and tokens/s, the learning rate (checkpoints, later
sessions and pauses marked), and each GPU's memory, utilisation, temperature and power over
time (the CPU and memory of the run's processes and of the machine, on a run without GPUs).
The page holds the plots inline (one self-contained file), the summary ``status`` prints,
the resolved profile, the checkpoints, the sessions (launch, resumes, torchrun restarts) and
any failure. Several runs: one set of plots with every run's curves overlaid, the profile
keys that differ from the first run, and the summaries side by side.

The events go through THE fold (:class:`Series` extends :class:`~gpu_console.fold.RunFold`
with the series it draws); a start drops what an earlier session logged past the
checkpoint it starts from, as TensorBoard's purge does, so each curve is the run's one curve.
Made with matplotlib's Agg backend (optional extra ``report``); no torch, no display.
"""

from __future__ import annotations

import base64
import html
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import strict_json
from ..events import JsonlTail, read_events
from ..fold import RunFold
from ..runs import RunDirError, rebased, relative_text
from ..telemetry.fold import TELEMETRY_FILE
from .curves import Telemetry

INSTALL_HINT = "pip install 'gpu-console[report]'"
_NUM = (int, float)


class ReportError(RunDirError):
    """A report that cannot be made (matplotlib missing, an unwritable --out): exit 2."""


def _num(v: Any) -> float | None:
    return float(v) if type(v) in _NUM else None


class Series(RunFold):
    """THE fold of a run's events, plus the series a report draws."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.sessions: list[dict[str, Any]] = []  # every start: launch, resume, restart
        # (wall time paused, wall time it ended or None, step): from the engine's ``paused``
        # status to its next status or start (the resume, or the end of the session)
        self.pauses: list[tuple[float, float | None, int]] = []

    def apply(self, e: dict[str, Any]) -> None:
        super().apply(e)
        kind = e.get("kind")
        self._pause(e)
        if kind == "step" and type(e.get("step")) is int:
            self.steps.append(e)
        elif kind == "eval" and type(e.get("step")) is int:
            self.evals.append(e)
        elif kind == "checkpoint" and e.get("path"):
            self.checkpoints.append(e)
        elif kind == "start":
            at = int(e.get("start_step") or 0)
            # What an earlier session logged past this start's checkpoint is trained again.
            self.steps = [s for s in self.steps if s["step"] <= at]
            self.evals = [s for s in self.evals if s["step"] <= at]
            self.sessions.append(e)

    def _pause(self, e: dict[str, Any]) -> None:
        kind, t = e.get("kind"), _num(e.get("t"))
        if t is None or kind not in ("status", "start"):
            return
        open_ = bool(self.pauses) and self.pauses[-1][1] is None
        if kind == "status" and e.get("state") == "paused":
            if not open_:
                self.pauses.append((t, None, self.step))
        elif open_:
            start, _, step = self.pauses[-1]
            self.pauses[-1] = (start, t, step)


@dataclass
class RunData:
    run: Path
    series: Series
    telemetry: Telemetry
    fields: dict[str, Any]  # ``status --json``
    profile_text: str

    @property
    def name(self) -> str:
        return self.run.name


def load_series(run: Path) -> tuple[Series, Telemetry]:
    """A run's events through the fold, and its telemetry, as the plots draw them."""
    series = Series()
    for e in read_events(run / "events.jsonl"):
        series.apply(e)
    telemetry = Telemetry()
    for s in JsonlTail(run / TELEMETRY_FILE).read():
        if s.get("kind") == "sample":
            telemetry.add(s)
        elif s.get("kind") == "summary":  # a recorder's last line: its session ended
            telemetry.end_session()
    return series, telemetry


def load(run: Path, runs_dir: Path) -> RunData:
    from ..commands import status as status_cmd

    series, telemetry = load_series(run)
    path, follower, row = status_cmd.status(str(run), runs_dir)
    fields = status_cmd.to_json(path, follower, row)
    try:
        profile_text = (run / "run.toml").read_text()
    except OSError:
        profile_text = ""
    return RunData(run, series, telemetry, fields, profile_text)


# -- plots ---------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError(f"report: needs matplotlib ({INSTALL_HINT})") from None
    matplotlib.use("Agg")  # files only: no display, over SSH too
    import matplotlib.pyplot as plt

    return plt


def plot_all(runs: list[RunData], out: Path) -> list[tuple[str, Path]]:
    """Every plot with something to draw, saved as PNG: (caption, path)."""
    from .plots import figures

    plt = _pyplot()
    made: list[tuple[str, Path]] = []
    figs = figures(plt, runs)
    try:
        for name, caption, fig in figs:
            path = out / f"{name}.png"
            fig.savefig(path, dpi=110)
            made.append((caption, path))
    finally:
        for _, _, fig in figs:
            plt.close(fig)
    return made


# -- the page ------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
td, th { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.what { color: #555; white-space: nowrap; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.4em 0; }
.failed { color: #b00020; } .muted { color: #777; }
"""


def _e(v: Any) -> str:
    return html.escape(str(v))


def _table(head: list[str], rows: list[list[str]], first_is_what: bool = True) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = [
            f'<td class="what">{_e(c)}</td>' if i == 0 and first_is_what else f"<td>{_e(c)}</td>"
            for i, c in enumerate(row)
        ]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if type(t) in _NUM else "-"


def _sessions(d: RunData) -> str:
    rows = []
    for s in d.series.sessions:
        if s.get("restart"):
            what = f"torchrun restart {s['restart']}"
        elif s.get("resumed_from"):
            what = "resume"
        else:
            what = "launch"
        rows.append([what, _when(s.get("t")), str(s.get("start_step") or 0),
                     _here(d.run, s.get("resumed_from")),
                     f"{s.get('world_size', '-')} × {s.get('device_type', '-')}"])  # fmt: skip
    if not rows:
        return '<p class="muted">no session started training</p>'
    return _table(["session", "started", "at step", "from", "ranks"], rows)


def _here(run: Path, recorded: Any) -> str:
    """A path the events recorded, as this run directory has it, relative to it (a copied
    run names its own files); ``(not on disk)`` where it is gone (pruned, deleted)."""
    path = rebased(run, recorded)
    if path is None:
        return "-"
    return relative_text(run, path) + ("" if path.exists() else " (not on disk)")


def _checkpoints(d: RunData) -> str:
    rows = [
        [str(c.get("step")), str(c.get("reason") or ""), _here(d.run, c.get("path")),
         _when(c.get("t"))]
        for c in d.series.checkpoints
    ]  # fmt: skip
    if not rows:
        return '<p class="muted">no checkpoint</p>'
    return _table(["step", "reason", "path", "written"], rows)


def page(runs: list[RunData], plots: list[tuple[str, Path]]) -> str:
    from ..commands.diff import _merged, profile_changes
    from ..runs import RunDirError
    from ..summary import summary_rows

    title = "report: " + " vs ".join(d.name for d in runs)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="muted">written {_e(_when(time.time()))} by gpu-console report</p>',
    ]
    # The summaries, one column per run (the rows ``status`` prints).
    per_run = [dict(summary_rows(d.fields)) for d in runs]
    whats: list[str] = []
    for rows in per_run:
        whats = _merged(whats, list(rows))
    parts.append("<h2>Summary</h2>")
    parts.append(
        _table(
            ["", *(d.name for d in runs)], [[w, *(r.get(w, "-") for r in per_run)] for w in whats]
        )
    )
    for d in runs:
        failure = d.fields.get("failure")
        if isinstance(failure, dict) and failure.get("summary"):
            parts.append(f'<p class="failed">{_e(d.name)} failed: {_e(failure["summary"])}</p>')
            if failure.get("traceback"):
                parts.append(f"<pre>{_e(failure['traceback'])}</pre>")
    if len(runs) > 1:
        parts.append(f"<h2>Profile: what differs from {_e(runs[0].name)}</h2>")
        for d in runs[1:]:
            try:
                changes = profile_changes(runs[0].run, d.run)
            except RunDirError as e:  # a damaged run.toml: said, the rest of the page stands
                parts.append(f'<p class="failed">{_e(d.name)}: no comparison: {_e(str(e))}</p>')
                continue
            if not changes:
                parts.append(f"<p>{_e(d.name)}: the same profile</p>")
                continue
            rows = [[c["key"], _value(c["a"]), _value(c["b"])] for c in changes]
            parts.append(_table(["key", runs[0].name, d.name], rows))
    parts.append("<h2>Plots</h2>")
    for caption, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h3>{_e(caption)}</h3>")
        parts.append(f'<img alt="{_e(caption)}" src="data:image/png;base64,{data}">')
    if not plots:
        parts.append('<p class="muted">nothing to plot: no step was logged</p>')
    for d in runs:
        head = f" of {_e(d.name)}" if len(runs) > 1 else ""
        parts.append(f"<h2>Sessions{head}</h2>")
        parts.append(_sessions(d))
        parts.append(f"<h2>Checkpoints{head}</h2>")
        parts.append(_checkpoints(d))
        parts.append(f"<h2>Profile{head} (run.toml)</h2>")
        parts.append(f"<pre>{_e(d.profile_text)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _value(v: Any) -> str:
    if v is None:
        return "(missing)"
    return v if isinstance(v, str) else strict_json.dumps(v)


def write(runs: list[RunData], out: Path) -> tuple[Path, list[Path]]:
    """The plots and the page into ``out``: (the page, the PNGs)."""
    _pyplot()  # the missing extra is said before anything is written
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"--out: {out}: cannot create it ({e.strerror})") from None
    index = out / "index.html"
    from ..runs import atomic_write_text
    from .moe_figures import write_summary

    try:
        plots = plot_all(runs, out)
        summary = write_summary(runs, out)  # runs of the moe_mnist task: beside the plots
        atomic_write_text(index, page(runs, plots))
    except OSError as e:
        if e.filename is None:  # a write that names no file (savefig's): the folder it was in
            e.filename = str(out)
        raise  # the CLI says it in one line (cli.os_error_line)
    return index, [p for _, p in plots] + ([summary] if summary else [])


def default_out(runs: list[Path]) -> Path:
    """One run: ``RUN/report/``; several: ``report-<first>-vs-<n-1>-more`` here."""
    if len(runs) == 1:
        return runs[0] / "report"
    more = len(runs) - 1
    return Path.cwd() / f"report-{runs[0].name}-vs-{runs[1].name if more == 1 else f'{more}-runs'}"


def main(run_args: list[str], runs_dir: Path, out: Path | None) -> int:
    from ..runs import find_run

    runs = [find_run(a, runs_dir) for a in run_args]
    _pyplot()
    data = [load(r, runs_dir) for r in runs]
    index, pngs = write(data, out or default_out(runs))
    print(f"report: {index}")
    for p in pngs:
        print(f"  {p}")
    return 0
