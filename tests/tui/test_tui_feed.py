"""The console's data layer without Textual: series, the big-file reader, the run feed."""

from __future__ import annotations

import json
import math

from gpu_console.tui import reader, synthetic
from gpu_console.tui.feed import RunFeed, display_state
from gpu_console.tui.series import Series
from gpu_console.tui.widgets.chart import Line, render_chart
from gpu_console.tui.widgets.text import num, spark


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
    now = 1000.0
    assert display_state({}, "starting", now, None) == "starting"
    ended = {"state": "stopped", "ended": 5.0}
    assert display_state(ended, "running", now, None) == "stopped"
    gone = {"state": "running", "pids": {"supervisor": 2**22 + 12345}}
    assert display_state(gone, "running", now, None) == "lost"


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
