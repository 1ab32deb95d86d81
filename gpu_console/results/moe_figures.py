"""The report's figures for runs of the ``moe_mnist`` task (a mixture-of-experts image
classifier), beside the plots every run gets:

- ``training_metrics.png``: the loss (train, smoothed, and eval), the accuracy (train and
  eval) and each whole epoch's wall time, together;
- ``expert_activations.png``: the expert activations per class over training, one panel per
  class, each expert's share of that class's assignments at each eval
  (``expert_class/<c>/<e>``);
- ``expert_device_distribution.png``: the experts each device (rank) holds, from the run's
  world size and strategy (``expert``: rank r holds the r-th of N equal slices; otherwise
  every rank holds every expert), and each expert's share of the last eval's assignments
  coloured by its device;
- ``performance_summary.txt``: final accuracy, time per epoch, samples/s, compile status,
  the experts and their placement.

With several runs, the training metrics overlay every ``moe_mnist`` run; the expert figures
and the summary are the first such run's (the summary has a section per run).
An epoch's time: the engine's ``epoch`` events (each whole epoch's wall time, evals and
checkpoints inside it included: engine/epoch_clock.py); for a run written before them, from
the first logged step of that epoch to the first logged step of the next (the ``epoch`` of
step events), as fine as ``train.log_every``. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..toml_text import loads_or_empty
from . import curves

if TYPE_CHECKING:
    from .plots import _Figures
    from .report import RunData

KIND = "moe_mnist"
SUMMARY = "performance_summary.txt"


def task_kind(d: RunData) -> str | None:
    for s in d.series.sessions:
        if isinstance(s.get("task"), str):
            return s["task"]
    return _task(d).get("kind")


def _task(d: RunData) -> dict[str, Any]:
    task = loads_or_empty(d.profile_text).get("task")
    return task if isinstance(task, dict) else {}


def runs_of_task(runs: list[RunData]) -> list[RunData]:
    return [d for d in runs if task_kind(d) == KIND]


@dataclass
class Placement:
    devices: list[str]  # one label per rank
    held: list[list[int]]  # the experts each rank holds
    parallel: bool  # expert parallel (each rank its slice) or replicated
    num_experts: int
    layers: int


def placement(d: RunData) -> Placement | None:
    """Where the run's experts lived: its last session's ranks and strategy."""
    task = _task(d)
    experts = task.get("num_experts")
    if not isinstance(experts, int) or not d.series.sessions:
        return None
    start = d.series.sessions[-1]
    world = start.get("world_size")
    world = world if isinstance(world, int) and world > 0 else 1
    device = start.get("device_type") or "?"
    parallel = start.get("strategy") == "expert" and world > 1 and experts % world == 0
    devices = [f"rank {r} ({device})" for r in range(world)]
    if parallel:
        per = experts // world
        held = [list(range(r * per, (r + 1) * per)) for r in range(world)]
    else:
        held = [list(range(experts)) for _ in range(world)]
    layers = task.get("n_layers")
    return Placement(devices, held, parallel, experts, layers if isinstance(layers, int) else 1)


def whole_epoch_times(d: RunData) -> list[tuple[int, float]]:
    """(epoch, seconds) of each whole epoch: the run's epoch events, else its logged steps."""
    if d.series.epoch_seconds:
        return sorted(d.series.epoch_seconds.items())
    return epoch_times(d.series.steps)


def epoch_times(steps: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(epoch, seconds) of each whole epoch the logged steps span: from the first logged
    step of the epoch to the first logged step of the next."""
    first: dict[int, float] = {}
    for s in steps:
        e, t = s.get("epoch"), curves.num(s.get("t"))
        if type(e) is int and t is not None and e not in first:
            first[e] = t
    return [(e, first[e + 1] - first[e]) for e in sorted(first) if e + 1 in first]


def _series(rows: list[dict[str, Any]], key: str, metric: bool = False):
    xs, ys = [], []
    for r in rows:
        v = curves.num((r.get("metrics") or {}).get(key) if metric else r.get(key))
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def add_figures(f: _Figures) -> None:
    runs = runs_of_task(f.runs)
    if not runs:
        return
    _training_metrics(f, runs)
    _expert_activations(f, runs[0])
    _device_distribution(f, runs[0])


def _training_metrics(f: _Figures, runs: list[RunData]) -> None:
    fig, (loss_ax, acc_ax, time_ax) = f.plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.8 / len(runs)
    for i, d in enumerate(runs):
        color = f.color(f.runs.index(d))
        xs, ys, _ = curves.train_loss(d.series.steps)
        if xs:
            loss_ax.plot(xs, curves.ema(ys), color=color, linewidth=1.6,
                         label=f.label(d, "train, smoothed"))  # fmt: skip
        exs, eys = _series(d.series.evals, "loss")
        if exs:
            loss_ax.plot(exs, eys, color=color, marker="o", markersize=3.5, linestyle="--",
                         label=f.label(d, "eval"))  # fmt: skip
        txs, tys = _series(d.series.steps, "accuracy", metric=True)
        if txs:
            acc_ax.plot(txs, tys, color=color, linewidth=1.0, alpha=0.6,
                        label=f.label(d, "train (each log interval)"))  # fmt: skip
        axs, ays = _series(d.series.evals, "accuracy")
        if axs:
            acc_ax.plot(axs, ays, color=color, marker="o", markersize=3.5,
                        label=f.label(d, "eval"))  # fmt: skip
        times = whole_epoch_times(d)
        if times:
            time_ax.bar([e + i * width for e, _ in times], [s for _, s in times], width=width,
                        color=color, label=d.name if f.several else None)  # fmt: skip
    loss_ax.set_title("loss (cross-entropy)", fontsize=10)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    acc_ax.set_title("accuracy", fontsize=10)
    acc_ax.set_xlabel("step")
    acc_ax.set_ylabel("accuracy (fraction correct)")
    acc_ax.set_ylim(0, 1.02)
    time_ax.set_title("wall time of each whole epoch", fontsize=10)
    time_ax.set_xlabel("epoch")
    time_ax.set_ylabel("seconds")
    if not time_ax.patches:
        time_ax.text(0.5, 0.5, "no whole epoch logged", ha="center", va="center",
                     transform=time_ax.transAxes, color="grey")  # fmt: skip
    for ax in (loss_ax, acc_ax, time_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    f.add("training_metrics", "Training: loss, accuracy and epoch time", fig)


def _expert_activations(f: _Figures, d: RunData) -> None:
    p = placement(d)
    evals = [e for e in d.series.evals if any(k.startswith("expert_class/") for k in e)]
    if p is None or not evals:
        return
    classes = sorted({int(k.split("/")[1]) for e in evals for k in e
                      if k.startswith("expert_class/")})  # fmt: skip
    fig, axes = f.grid(len(classes), width=3.2, height=2.6)
    for ax, c in zip(axes, classes, strict=True):
        for e in range(p.num_experts):
            xs, ys = _series(evals, f"expert_class/{c}/{e}")
            ax.plot(xs, ys, color=f.color(e), marker="o", markersize=2.5, linewidth=1.2,
                    label=f"expert {e}")  # fmt: skip
        ax.set_title(f"class {c}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("share of the class's assignments")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{d.name}: expert activations per class at each eval", fontsize=11)
    f.add("expert_activations", "Expert activations per class over training", fig)


def _device_distribution(f: _Figures, d: RunData) -> None:
    p = placement(d)
    if p is None:
        return
    fig, (left, right) = f.plt.subplots(1, 2, figsize=(11, 4))
    for r, held in enumerate(p.held):
        for j, e in enumerate(held):
            left.bar(r, 1, bottom=j, color=f.color(e), edgecolor="white",
                     label=f"expert {e}" if r == 0 or p.parallel else None)  # fmt: skip
            left.text(r, j + 0.5, str(e), ha="center", va="center", fontsize=8, color="white")
    from matplotlib.ticker import MaxNLocator

    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xticks(range(len(p.devices)), p.devices, fontsize=8)
    left.set_ylabel(f"experts held (of {p.num_experts} per layer)")
    how = "expert parallel: each rank its slice" if p.parallel else "replicated: every expert"
    left.set_title(f"experts per device ({how})", fontsize=10)
    left.legend(fontsize=7)
    last = d.series.evals[-1] if d.series.evals else {}
    shares = [curves.num(last.get(f"expert_load/{e}")) for e in range(p.num_experts)]
    owner = {e: r for r, held in enumerate(p.held) for e in held} if p.parallel else {}
    for e, share in enumerate(shares):
        if share is None:
            continue
        r = owner.get(e)
        # Devices in colours after the experts' (the left panel's), so neither reads as the other.
        color = f.color(p.num_experts + r) if r is not None else "grey"
        right.bar(e, share, color=color,
                  label=p.devices[r] if r is not None else "every rank")  # fmt: skip
    right.axhline(1 / p.num_experts, color="grey", linestyle=":", linewidth=1, label="even share")
    right.set_xticks(range(p.num_experts), [f"expert {e}" for e in range(p.num_experts)])
    right.set_ylabel("share of the assignments")
    step = last.get("step")
    right.set_title(f"each expert's load at the last eval (step {step}), by device", fontsize=10)
    handles, labels = right.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))  # one entry per device
    right.legend(list(seen.values()), list(seen), fontsize=7)
    right.grid(alpha=0.3, axis="y")
    f.add("expert_device_distribution", "Experts per device", fig)


# -- the summary ---------------------------------------------------------------------------


def summary_text(runs: list[RunData]) -> str | None:
    """``performance_summary.txt``: a section per run of the task (None: no such run)."""
    mine = runs_of_task(runs)
    if not mine:
        return None
    return "\n".join(_summary(d) for d in mine)


def _summary(d: RunData) -> str:
    task = _task(d)
    lines = [f"run: {d.name}", f"task: {KIND}"]
    data = task.get("data_dir")
    lines.append(f"data: MNIST IDX files in {data}" if data else "data: scikit-learn 8x8 digits")
    evals = [e for e in d.series.evals if curves.num(e.get("accuracy")) is not None]
    if evals:
        last = evals[-1]
        lines.append(f"final accuracy: {last['accuracy']:.4f} (eval at step {last['step']})")
        if (loss := curves.num(last.get("loss"))) is not None:
            lines.append(f"final eval loss: {loss:.4f}")
    else:
        lines.append("final accuracy: - (no eval)")
    times = whole_epoch_times(d)
    if times:
        mean = sum(s for _, s in times) / len(times)
        lines.append(f"time per epoch: {mean:.3f} s (mean of {len(times)} whole epochs)")
    else:
        lines.append("time per epoch: - (no whole epoch logged)")
    rates = [v for s in d.series.steps if (v := curves.num(s.get("samples_per_s"))) is not None]
    if rates:
        lines.append(f"samples/s: {sum(rates) / len(rates):.1f} (mean of {len(rates)} log steps)")
    start = d.series.sessions[-1] if d.series.sessions else {}
    mode = start.get("compile")
    if mode:
        secs = [v for s in d.series.steps if (v := curves.num(s.get("compile_s"))) is not None]
        took = f", {secs[-1]:.1f} s compiling" if secs else ""
        lines.append(f"compile: on ({mode}){took}")
    else:
        lines.append("compile: off")
    p = placement(d)
    if p is not None:
        k, cap = task.get("top_k", "?"), task.get("capacity_factor", "?")
        lines.append(f"experts: {p.num_experts} per layer x {p.layers} layer(s), top-{k}, "
                     f"capacity factor {cap}")  # fmt: skip
        if p.parallel:
            where = "; ".join(
                f"{dev}: experts {held[0]}-{held[-1]}"
                for dev, held in zip(p.devices, p.held, strict=True)
            )
            lines.append(f"placement: expert parallel over {len(p.devices)} ranks: {where}")
        else:
            lines.append(f"placement: replicated: each of {len(p.devices)} rank(s) "
                         f"({start.get('device_type', '?')}) holds every expert")  # fmt: skip
    return "\n".join(lines) + "\n"


def write_summary(runs: list[RunData], out: Path) -> Path | None:
    from ..runs import atomic_write_text

    text = summary_text(runs)
    if text is None:
        return None
    path = out / SUMMARY
    atomic_write_text(path, text)
    return path
