"""``gpu-console report SWEEP``: a sweep's figures and one HTML page, into ``SWEEP/report/``.

The objective against each parameter (one panel a parameter; a log axis for a log range; the
best trial marked), every trial's eval curve overlaid (the best one drawn over the others),
and a table of all trials. matplotlib as ``report`` of a run uses it (the report extra). No
torch.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from ..results.report import CSS, _pyplot
from ..runs import atomic_write_text
from . import store
from .follow import value_text


def trial_rows(sweep_dir: Path, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The fold's rows, each with its eval curve (step → objective) where its run has one."""
    rows = store.fold(store.read_events(sweep_dir), plan)["trials"]
    for row in rows:
        run = sweep_dir / row["run"] if row["run"] else None
        row["curve"] = store.eval_curve(run, plan["objective"]) if run and run.is_dir() else {}
    return rows


def objective_figure(plt, plan: dict[str, Any], rows: list[dict[str, Any]], best: int | None):
    params = plan["params"]
    metric = plan["objective"]["metric"]
    fig, axes = plt.subplots(1, len(params), figsize=(4.2 * len(params), 3.6), squeeze=False)
    done = [r for r in rows if r["objective"] is not None]
    for ax, p in zip(axes[0], params, strict=True):
        key = p["key"]
        categorical = p.get("values") is not None
        order = [str(v) for v in p["values"]] if categorical else []

        def x(row: dict[str, Any], key=key, categorical=categorical, order=order) -> float:
            v = row["params"][key]
            return float(order.index(str(v))) if categorical else float(v)

        ax.scatter([x(r) for r in done], [r["objective"] for r in done], color="#4a78b5",
                   label="finished")  # fmt: skip
        pruned = [r for r in rows if r["state"] == "pruned" and r["curve"]]
        if pruned:
            ax.scatter([x(r) for r in pruned], [r["curve"][max(r["curve"])] for r in pruned],
                       marker="x", color="#999999", label="pruned (last eval)")  # fmt: skip
        if best is not None:
            b = next(r for r in rows if r["trial"] == best)
            ax.scatter([x(b)], [b["objective"]], marker="*", s=220, color="#d62728",
                       label=f"best (trial {best})", zorder=3)  # fmt: skip
        if categorical:
            ax.set_xticks(range(len(order)), order)
        elif p.get("log"):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{metric} against each parameter")
    fig.tight_layout()
    return fig


def curves_figure(plt, plan: dict[str, Any], rows: list[dict[str, Any]], best: int | None):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in rows:
        if not row["curve"] or row["trial"] == best:
            continue
        steps = sorted(row["curve"])
        style = {"color": "#999999", "alpha": 0.6, "lw": 1}
        if row["state"] == "pruned":
            style["ls"] = ":"
        ax.plot(steps, [row["curve"][s] for s in steps], **style)
    if best is not None:
        row = next(r for r in rows if r["trial"] == best)
        steps = sorted(row["curve"])
        ax.plot(steps, [row["curve"][s] for s in steps], color="#d62728", lw=2.5,
                label=f"best: trial {best}")  # fmt: skip
        ax.legend()
    values = [v for r in rows for v in r["curve"].values() if v > 0]
    if values and max(values) / min(values) > 10 and not math.isclose(min(values), 0):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(plan["objective"]["metric"])
    ax.set_title("every trial's evals (pruned dotted)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def page(sweep_dir: Path, plan: dict[str, Any], rows, best, pngs: list[Path]) -> str:
    keys = plan["sweep"]["parameters"]
    metric = plan["objective"]["metric"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["trial", "state", *keys, metric, "run"])
    body = []
    for r in rows:
        cells = [
            f"{'★ ' if r['trial'] == best else ''}{r['trial']}", r["state"],
            *(value_text(r["params"].get(k, "")) for k in keys),
            "" if r["objective"] is None else f"{r['objective']:.6g}",
            r["run"] or "",
        ]  # fmt: skip
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    sweep = plan["sweep"]
    lines = [
        f"<h1>Sweep {html.escape(sweep_dir.name)}</h1>",
        f"<p>{len(rows)} trials ({html.escape(sweep['search'])}); objective "
        f"{html.escape(metric)} ({plan['objective']['direction']}, "
        f"{plan['objective']['use']} eval); base profile {html.escape(sweep['profile'])}</p>",
    ]
    if best is not None:
        b = next(r for r in rows if r["trial"] == best)
        lines.append(f"<p>Best: trial {best}, {html.escape(metric)} = {b['objective']:.6g} "
                     f"({html.escape(str(sweep_dir / b['run']))})</p>")  # fmt: skip
    lines += [f'<img src="{p.name}" alt="{p.stem}">' for p in pngs]
    lines.append(f"<h2>Trials</h2><table><tr>{head}</tr>{''.join(body)}</table>")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Sweep {sweep_dir.name}"
        f"</title><style>{CSS}</style></head><body>{''.join(lines)}</body></html>\n"
    )


def write(sweep_dir: Path, out: Path) -> tuple[Path, list[Path]]:
    plt = _pyplot()  # the missing extra is said before anything is written
    plan = store.read_plan(sweep_dir)
    rows = trial_rows(sweep_dir, plan)
    folded_best = store.fold(store.read_events(sweep_dir), plan)["best"]
    best = folded_best["trial"] if folded_best else None
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for name, make in (("objective", objective_figure), ("curves", curves_figure)):
        fig = make(plt, plan, rows, best)
        try:
            path = out / f"{name}.png"
            fig.savefig(path, dpi=110)
            pngs.append(path)
        finally:
            plt.close(fig)
    index = out / "index.html"
    atomic_write_text(index, page(sweep_dir, plan, rows, best, pngs))
    return index, pngs


def main(sweep_dir: Path, out: Path | None) -> int:
    index, pngs = write(sweep_dir, out or sweep_dir / "report")
    print(f"report: {index}")
    for p in pngs:
        print(f"  {p}")
    return 0
