"""Learning curves of cvrp runs against wall time: the greedy and sampled tours' gap to
Clarke-Wright at each eval, from the runs' own events (docs/tasks.md publishes them).

    python benchmarks/cvrp_curves.py RUN_DIR [RUN_DIR ...] [--label NAME ...] [--png OUT.png]

Prints a Markdown table per run (minutes since the launch, step, greedy, sampled, each gap
to Clarke-Wright) and, with ``--png`` (matplotlib, the ``report`` extra), draws both gaps of
every run against minutes since its launch. The clock is the events' own: a run's first
event is its launch, an eval's event is written when the eval ended, so a point's minutes
include everything the run spent until then (start-up, training, the evals before it).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from gpu_console.events import read_events

END_SAMPLES = re.compile(r"the eval at step (?P<step>\d+).*best of (?P<tours>\d+) tours")


def evals(run: Path) -> list[dict[str, Any]]:
    """The run's eval events, each with ``minutes`` since the run's first event."""
    events = read_events(run / "events.jsonl")  # a running run's torn last line skipped
    if not events:
        return []
    t0 = events[0]["t"]
    # The task's log line at an end eval that sampled task.end_sampled_tours (tasks/cvrp.py).
    end_samples = {}
    for e in events:
        said = END_SAMPLES.search(str(e.get("message", ""))) if e.get("kind") == "log" else None
        if said:
            end_samples[int(said["step"])] = int(said["tours"])
    return [
        {**e, "minutes": (e["t"] - t0) / 60, "end_samples": end_samples.get(e["step"])}
        for e in events
        if e.get("kind") == "eval"
    ]


def table(label: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"**{label}**",
        "",
        "| minutes | step | greedy | sampled | greedy vs CW | sampled vs CW |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    nan = float("nan")
    for r in rows:
        sampled, sampled_gap = r.get("sampled", nan), r.get("sampled_gap_cw_pct", nan)
        tours = f" (best of {r['end_samples']:,})" if r["end_samples"] else ""
        lines.append(
            f"| {r['minutes']:.1f} | {r['step']} | {r['greedy']:.3f} | {sampled:.3f}{tours} "
            f"| {r['greedy_gap_cw_pct']:+.1f} % | {sampled_gap:+.1f} % |"
        )
    if rows:
        lines.append(f"\nClarke-Wright on the same instances: {rows[-1]['cw']:.3f}")
    return "\n".join(lines)


def draw(runs: list[tuple[str, list[dict[str, Any]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs):
        c = colours[i % len(colours)]
        xs = [r["minutes"] for r in rows]
        greedy = [r["greedy_gap_cw_pct"] for r in rows]
        ax.plot(xs, greedy, "o--", color=c, label=f"{label}: greedy")
        sampled = [r for r in rows if "sampled_gap_cw_pct" in r]
        if sampled:
            ax.plot(
                [r["minutes"] for r in sampled],
                [r["sampled_gap_cw_pct"] for r in sampled],
                "o-",
                color=c,
                label=f"{label}: best of the samples",
            )
            for r in sampled:
                if r["end_samples"]:
                    ax.annotate(
                        f"best of {r['end_samples']:,}",
                        (r["minutes"], r["sampled_gap_cw_pct"]),
                        textcoords="offset points",
                        xytext=(-8, 6),
                        ha="right",
                        fontsize=8,
                        color=c,
                    )
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.text(0.0, 0.0, " Clarke-Wright", va="bottom", fontsize=8)
    ax.set_xlabel("minutes since the launch (2 CPU cores)")
    ax.set_ylabel("gap to Clarke-Wright (%)")
    ax.set_title("cvrp20: mean tour on the 1,024 eval instances", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--label", action="append", default=[], help="one per run, in order")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    for run in args.runs:
        if not (run / "events.jsonl").is_file():
            parser.error(f"{run}: not a run directory (no events.jsonl)")
    labels = args.label + [r.name for r in args.runs[len(args.label) :]]
    runs = [(label, evals(run)) for label, run in zip(labels, args.runs, strict=True)]
    for label, rows in runs:
        print(table(label, rows), end="\n\n")
    if args.png:
        draw(runs, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
