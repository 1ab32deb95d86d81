"""A report's figures (matplotlib), each returned before it is saved so a test reads its axes.

What every plot keeps to, so a researcher reads it at a glance: each axis says what it holds
and its unit; a run is one colour in every plot; the train loss is its interval means
smoothed as TensorBoard smooths (solid) over the values as logged (faint); a curve that spans
more than a decade of positive values is drawn on a log scale, and its axis says so; on the
step plots checkpoints are dotted, later sessions (resume, restart) dashed and pauses
dash-dotted lines, on the time plots sessions are dashed lines and pauses shaded.
The numbers come from :mod:`.curves`; no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import curves, moe_figures

if TYPE_CHECKING:
    from .report import RunData

Plot = tuple[str, str, Any]  # file stem, caption, matplotlib Figure
_UNITS = {"psnr": "dB"}  # an eval or train metric whose unit its name does not say
_MARKS = {  # kind: (line style, legend text)
    "checkpoint": (":", "checkpoint"),
    "session": ("--", "resumed or restarted session"),
    "start": ("--", "a session's training starts"),
    "pause": ("-.", "paused"),
}


def _ylabel(ax, text: str, log: bool) -> None:
    ax.set_ylabel(f"{text} (log scale)" if log else text)


def _scale(ax, *ys: list[float], metric: bool = False) -> bool:
    """A log scale for a curve over a decade; a metric within [0, 1] (an accuracy, a share)
    is a fraction and stays linear."""
    log = curves.wants_log(*ys) and not (metric and curves.fraction(*ys))
    if log:
        ax.set_yscale("log")
    return log


def _metric_label(name: str) -> str:
    unit = _UNITS.get(name.rsplit("/", 1)[-1])
    return f"{name} ({unit})" if unit else name


class _Figures:
    def __init__(self, plt, runs: list[RunData]) -> None:
        self.plt, self.runs = plt, runs
        self.colors = [c["color"] for c in plt.rcParams["axes.prop_cycle"]]
        self.several = len(runs) > 1
        self.made: list[Plot] = []

    def color(self, i: int) -> str:
        return self.colors[i % len(self.colors)]

    def label(self, d: RunData, what: str) -> str | None:
        if self.several:
            return f"{d.name} {what}".strip()
        return what or None

    # -- marks ---------------------------------------------------------------------------
    def step_marks(self, ax, d: RunData, color: str) -> set[str]:
        """Checkpoints, later sessions and pauses at their steps; the kinds drawn."""
        alpha = 0.3 if self.several else 0.5
        drawn = set()
        for c in d.series.checkpoints:
            if type(c.get("step")) is int:
                ax.axvline(c["step"], color=color, linestyle=":", linewidth=0.8, alpha=alpha)
                drawn.add("checkpoint")
        for s in d.series.sessions[1:]:
            ax.axvline(
                int(s.get("start_step") or 0),
                color=color,
                linestyle="--",
                linewidth=1.0,
                alpha=min(1.0, 2 * alpha),
            )
            drawn.add("session")
        for _, _, step in d.series.pauses:
            ax.axvline(step, color=color, linestyle="-.", linewidth=1.0, alpha=min(1.0, 2 * alpha))
            drawn.add("pause")
        return drawn

    def time_marks(self, ax, d: RunData, t0: float, per: float, color: str) -> set[str]:
        """Sessions' starts (dashed) and pauses (shaded) on a telemetry time axis; the kinds
        drawn."""
        drawn = set()
        for s in d.series.sessions:
            if (t := curves.num(s.get("t"))) is not None:
                ax.axvline((t - t0) / per, color=color, linestyle="--", linewidth=1.0, alpha=0.6)
                drawn.add("start")
        end = (t0 + d.telemetry.span) if d.telemetry.t0 is not None else None
        for start, stop, _ in d.series.pauses:
            stop = stop if stop is not None else end
            if stop is not None:
                ax.axvspan(
                    (start - t0) / per, (stop - t0) / per, color=color, alpha=0.12, linewidth=0
                )
                drawn.add("pause_span")
        return drawn

    def legend(self, ax, marks: set[str], fontsize: int = 8) -> None:
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        handles, labels = ax.get_legend_handles_labels()
        for kind in ("checkpoint", "session", "start", "pause"):
            if kind in marks:
                style, text = _MARKS[kind]
                handles.append(Line2D([], [], color="grey", linestyle=style, linewidth=1.0))
                labels.append(text)
        if "pause_span" in marks:
            handles.append(Patch(color="grey", alpha=0.25))
            labels.append("paused")
        if handles:
            ax.legend(handles, labels, fontsize=fontsize)

    # -- figures -------------------------------------------------------------------------
    def add(self, name: str, caption: str, fig) -> None:
        fig.tight_layout()
        self.made.append((name, caption, fig))

    def tours(self) -> None:
        """cvrp: the latest eval's drawn instances, a row each: the model's greedy tour
        beside Clarke-Wright's, each route a colour, the depot a black square."""
        for i, d in enumerate(self.runs):
            step, records = latest_tours(d.run)
            if not records:
                continue
            fig, axes = self.plt.subplots(
                len(records), 2, figsize=(8, 3.9 * len(records)), squeeze=False
            )
            for row, record in zip(axes, records, strict=True):
                xy = record["coords"]
                for ax, (kind, label) in zip(row, TOUR_KINDS, strict=True):
                    tour = record["tours"][kind]
                    for r, route in enumerate(tour["routes"]):
                        stops = [xy[0], *(xy[c] for c in route), xy[0]]
                        ax.plot([p[0] for p in stops], [p[1] for p in stops], "-o",
                                color=self.color(r), lw=1.2, ms=3)  # fmt: skip
                    ax.plot([xy[0][0]], [xy[0][1]], "s", color="black", ms=7)
                    ax.set_title(
                        f"instance {record['instance']}: {label}\n"
                        f"length {tour['length']:.3f}, {len(tour['routes'])} routes",
                        fontsize=9,
                    )
                    ax.set_aspect("equal")
                    ax.set_xlabel("x (unit square)")
                    ax.set_ylabel("y (unit square)")
            of = f" of {d.name}" if self.several else ""
            caption = (f"Tours of eval instances at step {step}{of}: the model's greedy (left) "
                       "and Clarke-Wright's (right)")  # fmt: skip
            self.add(f"tours-{i}" if self.several else "tours", caption, fig)

    def loss(self) -> None:
        if not any(d.series.steps for d in self.runs):
            return
        fig, ax = self.plt.subplots(figsize=(9, 4.8))
        ys_all: list[list[float]] = []
        marks: set[str] = set()
        means = False
        for i, d in enumerate(self.runs):
            color = self.color(i)
            xs, ys, run_means = curves.train_loss(d.series.steps)
            means = means or run_means
            smooth = curves.ema(ys)
            ax.plot(
                xs,
                ys,
                color=color,
                linewidth=0.8,
                alpha=0.3,
                label="_nolegend_",
                gid=f"train-raw:{d.name}",
            )
            ax.plot(
                xs,
                smooth,
                color=color,
                linewidth=1.8,
                gid=f"train-ema:{d.name}",
                label=self.label(d, "train loss, smoothed"),
            )
            ys_all += [ys, smooth]
            exs, eys = _xy(d.series.evals, "loss")
            if exs:
                ax.plot(
                    exs,
                    eys,
                    color=color,
                    marker="o",
                    markersize=3.5,
                    linestyle="--",
                    linewidth=1.0,
                    label=self.label(d, "eval loss"),
                    gid=f"eval:{d.name}",
                )
                ys_all.append(eys)
            marks |= self.step_marks(ax, d, color)
        log = _scale(ax, *ys_all)
        ax.set_xlabel("step")
        _ylabel(ax, "loss", log)
        what = "mean over each log interval" if means else "loss of each logged batch"
        ax.set_title(
            f"train loss ({what}): smoothed (EMA {curves.SMOOTHING}) over the raw line",
            fontsize=10,
        )
        ax.grid(alpha=0.3, which="both" if log else "major")
        self.legend(ax, marks)
        self.add("loss", "Loss", fig)

    def grid(self, n: int, width: float = 4.2, height: float = 3.3):
        cols = min(3, n)
        rows = (n + cols - 1) // cols
        fig, axes = self.plt.subplots(
            rows, cols, figsize=(width * cols, height * rows), squeeze=False
        )
        for ax in list(axes.flat)[n:]:
            ax.set_visible(False)
        return fig, list(axes.flat)[:n]

    def evals(self) -> None:
        names = [m for m in _eval_metrics(self.runs) if m != "loss"]
        if not names:
            return
        fig, axes = self.grid(len(names))
        for ax, metric in zip(axes, names, strict=True):
            ys_all = []
            marks: set[str] = set()
            for i, d in enumerate(self.runs):
                xs, ys = _xy(d.series.evals, metric)
                if xs:
                    ax.plot(
                        xs,
                        ys,
                        color=self.color(i),
                        marker="o",
                        markersize=3,
                        label=d.name if self.several else None,
                    )
                    ys_all.append(ys)
                    marks |= self.step_marks(ax, d, self.color(i))
            log = _scale(ax, *ys_all, metric=True)
            ax.set_title(f"eval {metric}", fontsize=10)
            ax.set_xlabel("step")
            _ylabel(ax, _metric_label(metric), log)
            ax.grid(alpha=0.3)
            if self.several:
                ax.legend(fontsize=7)
        self.add("eval", "Eval metrics", fig)

    def train_metrics(self) -> None:
        groups: dict[str, list[str]] = {}
        for d in self.runs:
            for group, names in curves.metric_groups(d.series.steps).items():
                have = groups.setdefault(group, [])
                have += [n for n in names if n not in have]
        if not groups:
            return
        fig, axes = self.grid(len(groups))
        styles = ["-", "--", ":", "-."]
        for ax, (group, names) in zip(axes, groups.items(), strict=True):
            ys_all = []
            for i, d in enumerate(self.runs):
                for j, name in enumerate(names):
                    xs, ys = curves.metric_series(d.series.steps, name)
                    if not xs:
                        continue
                    one = len(names) == 1
                    color = self.color(i if one else j)
                    style = styles[i % len(styles)] if not one else "-"
                    what = "" if one else name.split("/", 1)[1]
                    ax.plot(
                        xs,
                        ys,
                        color=color,
                        linestyle=style,
                        linewidth=1.2,
                        label=self.label(d, what),
                        gid=f"metric:{d.name}:{name}",
                    )
                    ys_all.append(ys)
            log = _scale(ax, *ys_all, metric=True)
            ax.set_title(
                f"train {group}" + ("" if len(names) == 1 else f" ({len(names)})"), fontsize=10
            )
            ax.set_xlabel("step")
            _ylabel(ax, _metric_label(group), log)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, ncol=2 if len(names) > 4 else 1)
        self.add("train_metrics", "Train metrics (the task's, over each log interval)", fig)

    def throughput(self) -> None:
        keys = [
            k
            for k in ("samples_per_s", "tokens_per_s")
            if any(_xy(d.series.steps, k)[0] for d in self.runs)
        ]
        if "samples_per_s" not in keys:
            return
        fig, axes = self.plt.subplots(1, len(keys), figsize=(9, 3.6), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            for i, d in enumerate(self.runs):
                ax.plot(
                    *_xy(d.series.steps, key),
                    color=self.color(i),
                    linewidth=1,
                    label=d.name if self.several else None,
                )
            unit = key.replace("_per_s", "/s")
            ax.set_title(f"throughput ({unit})", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
            if self.several:
                ax.legend(fontsize=7)
        self.add("throughput", "Throughput", fig)

    def lr(self) -> None:
        if not any(_xy(d.series.steps, "lr")[0] for d in self.runs):
            return
        fig, ax = self.plt.subplots(figsize=(9, 3.2))
        for i, d in enumerate(self.runs):
            groups = sorted({k for s in d.series.steps for k in (s.get("lrs") or {})})
            if groups:
                for g in groups:
                    pts = [
                        (s["step"], v)
                        for s in d.series.steps
                        if (v := curves.num((s.get("lrs") or {}).get(g))) is not None
                    ]
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        linewidth=1,
                        label=self.label(d, g),
                    )
            else:
                ax.plot(
                    *_xy(d.series.steps, "lr"),
                    color=self.color(i),
                    linewidth=1,
                    label=d.name if self.several else None,
                )
        ax.set_title("learning rate", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("learning rate")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        self.add("lr", "Learning rate", fig)

    def telemetry(self) -> None:
        span = max((d.telemetry.span for d in self.runs), default=0.0)
        per, unit = (60.0, "min") if span > 180 else (1.0, "s")
        xlabel = f"time since the run's first sample ({unit})"

        def timeline(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
            return [p[0] / per for p in points], [p[1] for p in points]

        def marks(ax, i: int, d: RunData) -> set[str]:
            if d.telemetry.t0 is None:
                return set()
            return self.time_marks(ax, d, d.telemetry.t0, per, self.color(i))

        if any(d.telemetry.gpus for d in self.runs):
            fig, axes = self.plt.subplots(2, 2, figsize=(10, 6), squeeze=False)
            for ax, (key, _) in zip(axes.flat, curves.GPU_SERIES, strict=True):
                drawn: set[str] = set()
                for i, d in enumerate(self.runs):
                    for gi, (index, series) in enumerate(sorted(d.telemetry.gpus.items())):
                        if points := series.get(key):
                            ax.plot(
                                *timeline(points),
                                linewidth=1,
                                color=self.color(i * 4 + gi),
                                label=self.label(d, f"GPU {index}"),
                            )
                    drawn |= marks(ax, i, d)
                title, yunit = curves.GPU_AXES[key]
                ax.set_title(f"GPU {title}", fontsize=10)
                ax.set_xlabel(xlabel)
                ax.set_ylabel(yunit)
                ax.grid(alpha=0.3)
                self.legend(ax, drawn, fontsize=7)
            self.add("gpus", "GPUs", fig)
        elif any(d.telemetry.host for d in self.runs):
            fig, axes = self.plt.subplots(1, 2, figsize=(10, 3.6), squeeze=False)
            cores = next((d.telemetry.cores for d in self.runs if d.telemetry.cores), None)
            panels: list[tuple[str, str, list[tuple[str, str, str]]]] = [
                (
                    "host CPU",
                    f"% of the machine ({cores} cores)" if cores else "% of the machine",
                    [("run_cpu", "run's processes", "-"), ("cpu_percent", "machine", ":")],
                ),
                (
                    "host memory",
                    "GiB",
                    [
                        ("run_rss", "run's processes (RSS)", "-"),
                        ("ram_used", "machine (used)", ":"),
                    ],
                ),
            ]
            for ax, (title, ylabel, lines) in zip(axes.flat, panels, strict=True):
                drawn = set()
                for i, d in enumerate(self.runs):
                    for key, what, style in lines:
                        if points := d.telemetry.host.get(key):
                            ax.plot(
                                *timeline(points),
                                linewidth=1.2 if style == "-" else 0.9,
                                linestyle=style,
                                color=self.color(i),
                                label=self.label(d, what),
                                gid=f"host:{d.name}:{key}",
                            )
                    drawn |= marks(ax, i, d)
                ax.set_title(title, fontsize=10)
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel)
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
                self.legend(ax, drawn, fontsize=7)
            self.add("host", "Host (no GPU telemetry)", fig)


TOUR_KINDS = (("greedy", "the model's greedy tour"), ("cw", "Clarke-Wright savings"))


def latest_tours(run: Path) -> tuple[int, list[dict[str, Any]]]:
    """The cvrp task's drawn tours of its latest eval (``task/tours/step-N/instance-K.json``,
    tasks/cvrp.py): (N, the instances' records by instance); (0, []) where there are none.
    A file that does not read as one (torn, by hand) is left out."""
    steps = sorted((run / "task" / "tours").glob("step-*"))
    if not steps:
        return 0, []
    records = []
    for path in sorted(steps[-1].glob("instance-*.json")):
        try:
            record = json.loads(path.read_text())
            if all(k in record.get("tours", {}) for k, _ in TOUR_KINDS) and record["coords"]:
                records.append(record)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    try:
        step = int(steps[-1].name.removeprefix("step-"))
    except ValueError:
        step = 0
    return step, records


def _xy(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = curves.num(r.get(key))
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


# Eval figures a task's own plots draw (moe_figures.py), left out of the eval grid.
_OWN_PLOTS = ("routed/", "expert_class/")


def _eval_metrics(runs: list[RunData]) -> list[str]:
    names: list[str] = []
    for d in runs:
        for e in d.series.evals:
            for k, v in e.items():
                metric = k not in ("v", "t", "kind", "step") and type(v) in (int, float)
                metric = metric and not k.startswith(_OWN_PLOTS)
                if metric and k not in names:
                    names.append(k)
    return names


def figures(plt, runs: list[RunData]) -> list[Plot]:
    """Every figure with something to draw, in the page's order (unsaved: the caller saves
    and closes them)."""
    f = _Figures(plt, runs)
    steps: list[Callable[[], None]] = [
        f.loss,
        f.evals,
        f.train_metrics,
        f.throughput,
        f.lr,
        f.telemetry,
        f.tours,
    ]
    for make in steps:
        make()
    moe_figures.add_figures(f)  # runs of the moe_mnist task: its own figures
    return f.made
