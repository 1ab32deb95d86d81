"""The console's data layer without Textual: series, the big-file reader, the run feed."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import synthetic

from gpu_console.fold import shown_state
from gpu_console.tui import reader
from gpu_console.tui.feed import RunFeed, RunModel
from gpu_console.tui.series import Series
from gpu_console.tui.widgets.chart import Line, render_chart
from gpu_console.tui.widgets.text import num, spark

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def test_a_series_stays_bounded_and_keeps_its_shape():
    s = Series(capacity=64, recent=100)
    for step in range(1, 100_001):
        s.append(step, 1.0 / step)
    pts = s.view()
    assert len(pts) <= 65 and s.count == 100_000
    xs = [x for x, _ in pts]
    assert xs == sorted(xs) and xs[-1] == 100_000
    ys = [y for _, y in pts]
    assert all(a >= b for a, b in zip(ys, ys[1:], strict=False))  # still decreasing
    # A short window is raw: the last 50 steps exactly.
    assert s.view(49) == [(x, 1.0 / x) for x in range(99_951, 100_001)]


def test_the_quick_read_samples_a_big_file_and_the_backfill_finds_every_rare_event(tmp_path):
    path = tmp_path / "events.jsonl"
    synthetic.write_big_events(path, 60_000)
    size = path.stat().st_size
    quick = reader.quick_events(path, small=size // 10, tail=size // 20)
    assert quick.sampled and quick.end == size
    kinds = [e["kind"] for _, e in quick.events]
    assert kinds[:3] == ["status", "start", "status"]
    steps = [e["step"] for _, e in quick.events if e["kind"] == "step"]
    assert steps == sorted(steps) and steps[-1] >= 57_000
    assert 1_000 < len(steps) < 10_000  # sampled, not parsed in full
    offsets = [o for o, _ in quick.events]
    assert offsets == sorted(offsets)
    rare = reader.backfill_events(path, quick.gap)
    every = [json.loads(line) for line in path.read_text().splitlines()]
    in_gap = [e for e in every if e["kind"] != "step"]
    seen = rare + [(o, e) for o, e in quick.events if e["kind"] != "step"]
    assert sorted(e["step"] for _, e in seen if e["kind"] == "eval") == sorted(
        e["step"] for e in in_gap if e["kind"] == "eval"
    )


def test_a_torn_last_line_waits_for_the_next_read(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"v":1,"t":1,"kind":"step","step":1,"loss":1.0}\n{"v":1,"t":2,"kind":"st')
    quick = reader.quick_events(path)
    assert [e["step"] for _, e in quick.events] == [1] and quick.end == path.read_text().index(
        "\n"
    ) + 1


def test_tail_text_returns_whole_new_lines_and_survives_a_rewrite(tmp_path):
    path = tmp_path / "torchrun.log"
    path.write_text("a\nb\npartial")
    lines, off = reader.tail_text(path, None)
    assert lines == ["a", "b"]
    path.write_text("a\nb\npartial line\nc\n")
    lines, off = reader.tail_text(path, off)
    assert lines == ["partial line", "c"]
    path.write_text("new\n")  # shorter: rewritten
    assert reader.tail_text(path, off)[0] == ["new"]


def test_the_feed_folds_a_failed_run(tmp_path):
    run = synthetic.write_run(tmp_path / "r", state="failed", steps=300)
    feed = RunFeed(run, clock=lambda: synthetic.T0 + 60, telemetry=False)
    feed.load()
    s = feed.snapshot()
    assert s.state == "failed" and s.step == 300 and not s.live
    assert s.failure["rank"] == 1 and "synthetic crash" in s.failure["traceback"]
    assert s.eval_name == "loss" and [x for x, _ in s.eval_points] == [100, 200, 300]
    assert [c["step"] for c in s.checkpoints] == [100, 200, 300]
    levels = {line.level for line in s.new_logs}
    assert {"warning", "error", "state", "checkpoint"} <= levels
    assert feed.snapshot().new_logs == []  # each line is handed over once


def test_states_a_reader_derives():
    # The state the run screen shows: the supervisor's once the run ended, lost/stalled when
    # derived, else the engine's newest status event (ahead of status.json).
    def shown(status, engine_state):
        fold = RunModel()
        fold.state = engine_state
        return shown_state(fold, status, 1000.0)

    assert shown({}, "starting") == "starting"
    assert shown({"state": "stopped", "ended": 5.0}, "running") == "stopped"
    gone = {"state": "running", "pids": {"supervisor": 2**22 + 12345}}
    assert shown(gone, "running") == "lost"


def test_a_chart_draws_braille_and_skips_non_finite_points():
    pts = [(float(i), math.sin(i / 5)) for i in range(200)] + [(201.0, math.nan)]
    text = render_chart([Line("a", pts, "red"), Line("e", [(100.0, 0.0)], "blue", True)], 40, 8)
    plain = text.plain
    assert any(0x2800 < ord(ch) <= 0x28FF for ch in plain) and "•" in plain
    assert "0" in plain.splitlines()[-1] and "199" in plain.splitlines()[-1]
    assert render_chart([Line("a", [], "red")], 40, 8, empty="nothing").plain == "nothing"


def test_numbers_and_sparklines_read_well():
    assert num(16255.4) == "16,255" and num(0.59512) == "0.5951" and num(3e-4) == "3.00e-04"
    assert num(None) == "-" and num(0) == "0"
    assert spark([0, 50, 100], 3, 0, 100) == "▁▄█" and spark([], 3) == "   "


def _append(run, *events) -> None:
    with open(run / "events.jsonl", "a", encoding="utf-8") as f:
        for e in events:
            f.write(json.dumps({"v": 1, **e}) + "\n")


def test_the_feed_shows_the_true_last_step_of_a_stop_and_of_a_failure(tmp_path):
    # Logged every 10 steps; the run then stops at 483, or fails at 487: only the checkpoint
    # and the final status say so (the supervisor's status.json has not caught up yet).
    t = synthetic.T0 + 10
    for end in ("stopped", "failed"):
        run = synthetic.write_run(tmp_path / end, state="running", steps=470, max_steps=1000,
                                  supervisor_pid=os.getpid())  # fmt: skip
        feed = RunFeed(run, clock=lambda: t + 1, telemetry=False)
        feed.load()
        assert feed.snapshot().step == 470
        if end == "stopped":
            _append(run, {"t": t, "kind": "status", "state": "stopping", "reason": "stop"},
                    {"t": t, "kind": "checkpoint", "step": 483, "reason": "stop",
                     "path": str(run / "checkpoints" / "step-00000483")})  # fmt: skip
            feed.poll()
            assert feed.snapshot().step == 483  # the checkpoint's step
            _append(run, {"t": t, "kind": "status", "state": "stopped", "reason": "stop",
                          "step": 483, "checkpointed": True})  # fmt: skip
        else:
            _append(run, {"t": t, "kind": "status", "state": "failed", "step": 487,
                          "reason": "RuntimeError: boom"})  # fmt: skip
        feed.poll()
        s = feed.snapshot()
        assert (s.state, s.step) == (end, 483 if end == "stopped" else 487)
        assert [x for x, _ in s.loss_series.view()][-1] == 470  # the chart: logged steps only


def _resume(run, placement: dict, started: float) -> None:
    """What ``launch.continue_run`` does to an ended run before its new supervisor writes."""
    meta = json.loads((run / "meta.json").read_text())
    first = {"placement": meta["placement"], "started": synthetic.T0 - 1.0}
    size = (run / "events.jsonl").stat().st_size
    meta["sessions"] = [first, {"placement": placement, "started": started, "events_from": size}]
    (run / "meta.json").write_text(json.dumps(meta))
    (run / "status.json").unlink()


def test_a_resumed_run_is_starting_on_its_new_devices_until_its_engine_speaks(tmp_path):
    run = synthetic.write_run(tmp_path / "r", state="stopped", steps=300, max_steps=1000)
    now = synthetic.T0 + 1000  # the synthetic run's clock (the samples': time.time())
    feed = RunFeed(run, clock=lambda: now)
    feed.load()
    assert (feed.snapshot().state, feed.snapshot().device_type) == ("stopped", "cpu")

    # Resumed on two GPUs of four: the old session's end is no longer the run's state.
    _resume(run, {"device_type": "cuda", "nproc": 2, "cuda_visible_devices": "2,3"}, now)
    feed.poll()
    s = feed.snapshot()
    assert (s.state, s.reason, s.step, s.device_type) == ("starting", "", 300, "cuda")
    status = {"state": "starting", "reason": "", "started": now,
              "pids": {"supervisor": os.getpid(), "workers": []}}  # fmt: skip
    (run / "status.json").write_text(json.dumps(status))
    gpus = [{"index": i, "name": "H200", "util_gpu": 0} for i in range(4)]
    sample = {"v": 1, "t": time.time(), "kind": "sample", "every_s": 1.0, "gpus": gpus,
              "nvml": {"available": True, "reason": ""}}  # fmt: skip
    (run / "telemetry.jsonl").write_text(json.dumps(sample) + "\n")
    # The console the resume opens (and any attached one) reads the same.
    for f in (feed, RunFeed(run, clock=lambda: now)):
        f.poll() if f is feed else f.load()
        s = f.snapshot()
        assert (s.state, s.reason, s.step, s.device_type) == ("starting", "", 300, "cuda")
        assert f.snapshot().devices.source == "file"  # the supervisor's samples
        assert [c.title for c in f.snapshot().devices.cards] == ["GPU 2", "GPU 3"]
        f.close()

    # The new engine speaks: its own states and steps, on one chart with the old session's.
    t = now + 1
    _append(run, {"t": t, "kind": "status", "state": "starting", "reason": ""},
            {"t": t, "kind": "start", "start_step": 300, "max_steps": 1000, "world_size": 2,
             "device_type": "cuda", "restart": 0},
            {"t": t, "kind": "status", "state": "running", "reason": ""},
            {"t": t + 1, "kind": "step", "step": 310, "loss": 0.3, "lr": 1e-3})  # fmt: skip
    feed.poll()
    s = feed.snapshot()
    assert (s.state, s.step, s.device_type) == ("running", 310, "cuda")
    steps = [x for x, _ in s.loss_series.view()]
    assert steps[0] == 10 and steps[-2:] == [300, 310]
    # The ETA at this session's pace (0.5 s a step), not counting the time it was stopped.
    _append(run, {"t": t + 6, "kind": "step", "step": 320, "loss": 0.3, "lr": 1e-3})
    feed.poll()
    assert feed.snapshot().eta_s == pytest.approx(0.5 * (1000 - 320))


def test_the_log_pane_says_which_optimizers_were_built():
    # The start event's optimizers, in the headless run's words: one line each.
    model = RunModel()
    groups = [{"lr": 0.003, "params": 4}, {"lr": 0.003, "params": 2}]
    model.apply({"kind": "start", "t": 1.0, "world_size": 2, "optimizers": [
        {"name": "d", "class": "Adam", "impl": "foreach", "param_groups": groups[:1],
         "schedule": {"kind": "none"}},
        {"name": "g", "class": "SGD", "impl": "foreach", "param_groups": groups,
         "schedule": {"kind": "plateau", "monitor": "val/loss"}},
    ]})  # fmt: skip
    texts = [line.text for line in model.logs]
    assert texts == [
        "optimizer d: Adam (foreach), 1 group, lr 0.003, schedule none",
        "optimizer g: SGD (foreach), 2 groups, lr 0.003, schedule plateau on eval val/loss",
    ]


def test_the_log_pane_gives_a_small_checkpoint_its_own_unit():
    # A 50 KiB checkpoint (a small model) once read "0.0 MiB".
    model = RunModel()
    model.apply({"kind": "checkpoint", "t": 1.0, "step": 10, "reason": "interval",
                 "bytes": 50 * 1024})  # fmt: skip
    model.apply({"kind": "checkpoint", "t": 2.0, "step": 20, "reason": "stop",
                 "bytes": 3 * 2**30})  # fmt: skip
    texts = [line.text for line in model.logs]
    assert texts == [
        "checkpoint @ step 10 (interval, 50.0 KiB)",
        "checkpoint @ step 20 (stop, 3.0 GiB)",
    ]
