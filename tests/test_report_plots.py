"""``gpu-console report``'s plots read at a glance (issue 42, point 10): the figures' axes as
matplotlib holds them before they are saved, for runs whose ``events.jsonl`` and
``telemetry.jsonl`` are written here in the engine's and the recorder's format (the shape of
a real run's lines): a steep first loss, interval means, the task's train metrics, sessions,
pauses, and a host whose recorder was down between two sessions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpu_console.results import curves, report
from gpu_console.results.plots import figures

pytestmark = pytest.mark.quick
plt = pytest.importorskip("matplotlib.pyplot", reason="the report extra (the dev extra has it)")

T0 = 1_795_910_100.0
GIB = 1024**3


def _start(t: float, step: int = 0, **kw) -> dict:
    return {"v": 1, "t": t, "kind": "start", "world_size": 2, "device_type": "cpu",
            "task": "lm", "max_steps": 100, "start_step": step, "restart": 0,
            "resumed_from": None, **kw}  # fmt: skip


def _step(step: int, t: float, loss: float, loss_avg: float | None, **metrics) -> dict:
    e = {"v": 1, "t": t, "kind": "step", "step": step, "epoch": 0, "loss": loss,
         "lr": 0.003 * (1 - step / 100), "grad_norm": 0.3, "samples_per_s": 2400.0,
         "tokens_per_s": 2400.0 * 128, "step_time_s": 0.01}  # fmt: skip
    if loss_avg is not None:
        e["loss_avg"] = loss_avg
    if metrics:
        e["metrics"] = metrics
    return e


def _status(t: float, state: str, reason: str = "") -> dict:
    return {"v": 1, "t": t, "kind": "status", "state": state, "reason": reason}


def _sample(t: float, machine_cpu: float, procs: list[tuple[float | None, int]]) -> dict:
    return {"v": 1, "t": t, "kind": "sample", "gpus": [], "every_s": 1.0,
            "host": {"cpu_percent": machine_cpu, "cores": 2, "ram_total": 24 * GIB,
                     "ram_used": 8 * GIB, "ram_available": 16 * GIB,
                     "processes": [{"pid": 100 + i, "role": "worker", "cpu_percent": c,
                                    "rss": rss} for i, (c, rss) in enumerate(procs)]}}  # fmt: skip


def _write(run: Path, events: list[dict], samples: list[dict] = ()) -> Path:
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "telemetry.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run


def _data(run: Path) -> report.RunData:
    series, telemetry = report.load_series(run)
    return report.RunData(run, series, telemetry, {}, "")


def _figures(*runs: Path) -> dict[str, object]:
    return {name: fig for name, _, fig in figures(plt, [_data(r) for r in runs])}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _lm_like(run: Path, first: float = 25.0) -> Path:
    """A language model's first loss of 25 falling to about 1.5, logged at step 1 and then
    every 5 steps: the logged batch's loss is noisy, its interval mean is not."""
    events = [_status(T0 - 5, "starting"), _start(T0), _status(T0, "running")]
    for i, step in enumerate([1, *range(5, 101, 5)]):
        mean = 1.5 + (first - 1.5) * math.exp(-(step - 1) / 12)
        noisy = mean * (1.3 if i % 2 else 0.7)
        events.append(_step(step, T0 + step / 10, noisy, mean, accuracy=min(1.0, step / 100)))
    return _write(run, events)


def _line(ax, gid: str):
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == gid]
    return line


def test_the_loss_is_the_interval_means_smoothed_as_tensorboard_does_on_a_log_scale(tmp_path):
    run = _lm_like(tmp_path / "lm")
    ax = _figures(run)["loss"].axes[0]
    means = [e["loss_avg"] for e in map(json.loads, (run / "events.jsonl").open())
             if e["kind"] == "step"]  # fmt: skip
    raw, smooth = _line(ax, f"train-raw:{run.name}"), _line(ax, f"train-ema:{run.name}")
    assert list(raw.get_ydata()) == means  # loss_avg, not one batch's loss
    # TensorBoard's debiased EMA: it starts at the first value, not pulled towards 0.
    expected, last = [], 0.0
    for n, v in enumerate(means, 1):
        last = last * curves.SMOOTHING + (1 - curves.SMOOTHING) * v
        expected.append(last / (1 - curves.SMOOTHING**n))
    assert list(smooth.get_ydata()) == pytest.approx(expected)
    assert smooth.get_ydata()[0] == pytest.approx(means[0])
    assert raw.get_alpha() < 0.5 and smooth.get_linewidth() > raw.get_linewidth()  # faint raw
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "loss (log scale)"
    assert ax.get_xlabel() == "step"


def test_a_flat_loss_stays_on_a_linear_scale_and_old_events_draw_their_loss(tmp_path):
    events = [_start(T0)] + [_step(s, T0 + s, 2.0 - s / 100, None) for s in range(1, 41)]
    run = _write(tmp_path / "flat", events)
    ax = _figures(run)["loss"].axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylabel() == "loss"
    assert list(_line(ax, f"train-raw:{run.name}").get_ydata()) == [2.0 - s / 100 for s in
                                                                     range(1, 41)]  # fmt: skip


def test_two_runs_overlaid_keep_one_colour_each_with_a_legend_by_run(tmp_path):
    a, b = _lm_like(tmp_path / "a"), _lm_like(tmp_path / "b", first=12.0)
    ax = _figures(a, b)["loss"].axes[0]
    for run in (a, b):
        raw, smooth = _line(ax, f"train-raw:{run.name}"), _line(ax, f"train-ema:{run.name}")
        assert raw.get_color() == smooth.get_color()
    assert _line(ax, "train-ema:a").get_color() != _line(ax, "train-ema:b").get_color()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["a train loss, smoothed", "b train loss, smoothed"]  # no raw entries


def test_every_axis_says_what_it_holds_and_its_unit(tmp_path):
    run = _lm_like(tmp_path / "lm")
    with (run / "events.jsonl").open("a") as f:
        f.write(json.dumps({"v": 1, "t": T0 + 11, "kind": "eval", "step": 100, "loss": 2.1,
                            "psnr": 21.5}) + "\n")  # fmt: skip
    made = _figures(run)
    assert set(made) == {"loss", "eval", "train_metrics", "throughput", "lr"}
    labels = {name: [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes if ax.get_visible()]
              for name, fig in made.items()}  # fmt: skip
    assert labels["throughput"] == [("step", "samples/s"), ("step", "tokens/s")]
    assert labels["lr"] == [("step", "learning rate")]
    assert labels["eval"] == [("step", "psnr (dB)")]
    assert labels["train_metrics"] == [("step", "accuracy")]


def test_every_train_metric_is_plotted_experts_together(tmp_path):
    events = [_start(T0)]
    for step in range(1, 21):
        load = {f"expert_load/{i}": 0.125 + (0.01 if i % 2 else -0.01) for i in range(8)}
        events.append(_step(step, T0 + step, 5.0, 5.0, ce=4.9, aux_loss=1.01, dropped=0.02,
                            **load))  # fmt: skip
    run = _write(tmp_path / "moe", events)
    fig = _figures(run)["train_metrics"]
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == [
        "train ce", "train aux_loss", "train dropped", "train expert_load (8)"
    ]  # fmt: skip
    experts = axes[3]
    assert {ln.get_gid() for ln in experts.get_lines()} == {
        f"metric:moe:expert_load/{i}" for i in range(8)
    }
    assert _line(axes[2], "metric:moe:dropped").get_ydata().tolist() == [0.02] * 20


def test_sessions_and_pauses_are_marked_on_the_step_plots(tmp_path):
    events = [_start(T0)] + [_step(s, T0 + s, 3.0, 3.0) for s in range(1, 31)]
    events += [_status(T0 + 31, "paused", "requested"), _status(T0 + 90, "running", "resumed")]
    events += [_step(s, T0 + 60 + s, 2.5, 2.5) for s in range(31, 41)]
    events += [{"v": 1, "t": T0 + 101, "kind": "checkpoint", "step": 40, "path": "x"}]
    events += [_start(T0 + 200, step=40, resumed_from="step-00000040")]
    events += [_step(s, T0 + 200 + s, 2.0, 2.0) for s in range(41, 51)]
    run = _write(tmp_path / "paused", events)
    series, _ = report.load_series(run)
    assert series.pauses == [(T0 + 31, T0 + 90, 30)]
    ax = _figures(run)["loss"].axes[0]
    vertical = [ln for ln in ax.get_lines() if ln.get_gid() is None]  # axvline's
    marks = {(ln.get_linestyle(), ln.get_xdata()[0]) for ln in vertical}
    assert marks == {("-.", 30), ("--", 40), (":", 40)}  # pause, session, checkpoint
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[-3:] == ["checkpoint", "resumed or restarted session", "paused"]


def test_the_host_plot_breaks_between_sessions_skips_the_first_reading_and_shows_the_run(
    tmp_path,
):
    events = [_start(T0), _step(1, T0 + 1, 1.0, 1.0)]
    events += [_start(T0 + 600, step=1, resumed_from="step-1"), _step(2, T0 + 601, 1.0, 1.0)]
    first = [_sample(T0 + i, 0.0 if i == 0 else 60.0 + i, [(None if i == 0 else 90.0, GIB)] * 2)
             for i in range(5)]  # fmt: skip
    summary = {"v": 1, "t": T0 + 5, "kind": "summary", "gpus": []}
    second = [_sample(T0 + 600 + i, 0.0 if i == 0 else 70.0, [(None if i == 0 else 80.0, GIB)])
              for i in range(5)]  # fmt: skip
    run = _write(tmp_path / "host", events, [*first, summary, *second])
    fig = _figures(run)["host"]
    cpu, ram = fig.axes
    machine = _line(cpu, "host:host:cpu_percent").get_ydata().tolist()
    assert 0.0 not in machine  # each session's first reading has no interval behind it
    assert machine[:4] == [61.0, 62.0, 63.0, 64.0] and math.isnan(machine[4])
    assert machine[5:] == [70.0] * 4  # the line breaks over the downtime, no bridge
    own = _line(cpu, "host:host:run_cpu").get_ydata().tolist()
    assert own[:4] == [90.0] * 4 and math.isnan(own[4]) and own[5:] == [40.0] * 4  # of 2 cores
    rss = _line(ram, "host:host:run_rss").get_ydata().tolist()
    assert rss[:5] == [2.0] * 5 and math.isnan(rss[5]) and rss[6:] == [1.0] * 5
    assert cpu.get_ylabel() == "% of the machine (2 cores)" and ram.get_ylabel() == "GiB"
    assert cpu.get_xlabel() == "time since the run's first sample (min)"
    legend = [t.get_text() for t in ram.get_legend().get_texts()]
    assert legend[:2] == ["run's processes (RSS)", "machine (used)"]


def test_a_gap_in_one_sessions_samples_breaks_the_line_too(tmp_path):
    samples = [_sample(T0 + t, 50.0, [(50.0, GIB)]) for t in (0, 1, 2, 60, 61)]
    t = curves.Telemetry()
    for s in samples:
        t.add(s)
    xs = [p[0] for p in t.host["ram_used"]]
    assert xs[:3] == [0, 1, 2] and xs[4:] == [60, 61]
    assert math.isnan(t.host["ram_used"][3][1])
    cpu = [p[1] for p in t.host["cpu_percent"]]
    assert cpu[:2] == [50.0, 50.0] and math.isnan(cpu[2]) and cpu[3:] == [50.0]


def test_ema_skips_non_finite_values_and_wants_log_needs_positive_values():
    assert math.isnan(curves.ema([4.0, float("nan"), 4.0], 0.5)[1])
    assert curves.ema([4.0, float("nan"), 4.0], 0.5)[2] == pytest.approx(4.0)
    assert curves.wants_log([25.0, 2.0]) and not curves.wants_log([9.0, 1.0])
    assert not curves.wants_log([25.0, -1.0]) and not curves.wants_log([])


def test_the_gpu_plot_labels_its_units_and_breaks_between_sessions(tmp_path):
    def sample(t: float) -> dict:
        gpu = {"index": 0, "memory_used": 4 * GIB, "util_gpu": 90, "temperature_c": 60,
               "power_w": 250.0}  # fmt: skip
        return {"v": 1, "t": t, "kind": "sample", "gpus": [gpu], "every_s": 1.0, "host": {}}

    summary = {"v": 1, "t": T0 + 3, "kind": "summary", "gpus": []}
    samples = [sample(T0 + i) for i in range(3)] + [summary]
    samples += [sample(T0 + 300 + i) for i in range(3)]
    run = _write(tmp_path / "gpu", [_start(T0), _step(1, T0 + 1, 1.0, 1.0)], samples)
    fig = _figures(run)["gpus"]
    assert [ax.get_ylabel() for ax in fig.axes] == ["GiB", "%", "°C", "W"]
    assert {ax.get_xlabel() for ax in fig.axes} == {"time since the run's first sample (min)"}
    (memory,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "GPU 0"]
    ys = memory.get_ydata().tolist()
    assert ys[:3] == [4.0] * 3 and math.isnan(ys[3]) and ys[4:] == [4.0] * 3
