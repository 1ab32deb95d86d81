"""The run screen and its keys, with Textual's Pilot: a recorded real run, synthetic ended
runs, and a live run whose engine is a stand-in thread (FakeRun) answering control.jsonl."""

from __future__ import annotations

import os
import re

import pytest
import synthetic
from tui_support import (  # noqa: F401 - fixtures
    control_lines,
    fake_live_fixture,
    screen_text,
    until,
)

from gpu_console.events import EventWriter, read_events
from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.modals import ConfirmScreen, HelpScreen, QuitScreen
from gpu_console.tui.screens.run import RunScreen
from gpu_console.tui.screens.runs import RunsScreen

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


def app_on(run_dir, **kw) -> ConsoleApp:
    kw.setdefault("telemetry", False)
    kw.setdefault("refresh_s", 0.05)
    return ConsoleApp(runs_dir=run_dir.parent, run_dir=run_dir, **kw)


async def loaded(pilot, app) -> RunScreen:
    await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot, 10,
                "the first snapshot")  # fmt: skip
    await pilot.pause()  # one more frame: the screen shows the snapshot
    return app.screen


async def test_a_recorded_quickstart_run(recorded_run):
    app = app_on(recorded_run)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        s = screen.snapshot
        assert s.state == "finished" and s.step == 300 and s.max_steps == 300
        text = screen_text(app)
        assert recorded_run.name in text and "finished" in text and "300/300" in text
        assert f"{s.loss:.4f}" in text and "samples/s" in text
        assert "interval" in text  # the checkpoints list
        assert "eval loss" in text and "2× cpu" in text
        # No control keys on an ended run: the footer leaves them out and they do nothing.
        await pilot.press("c", "p", "s", "k", "t")
        assert control_lines(recorded_run) == [] and isinstance(app.screen, RunScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_failure_shows_the_rank_its_exit_code_and_its_traceback(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "bad-20260101-000000", state="failed")
    app = app_on(run)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app)
        await until(pilot, lambda: app.screen.has_class("-failed"), 5, "the failure panel")
        text = screen_text(app)
        assert "FAILED" in text and "rank 1" in text and "exit code 1" in text
        assert "RuntimeError: synthetic crash at step 120" in text
        assert "Traceback" in text
        await pilot.press("d")  # not live: d quits with the run's code
    assert app.return_code == 1


async def test_w_changes_the_loss_window_and_help_and_runs_open(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "long-20260101-000000", steps=3000)
    app = app_on(run)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        chart = screen.query_one("#loss")
        assert "whole run" in str(chart.border_subtitle)
        await pilot.press("w")
        assert "last 10,000 steps" in str(chart.border_subtitle)
        await pilot.press("w")
        assert "last 1,000 steps" in str(chart.border_subtitle)
        assert min(x for x, _ in chart.lines[0].points) >= 2000
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen) and "checkpoint now" in screen_text(app)
        await pilot.press("escape")
        await pilot.press("r")
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("escape")
        assert app.screen is screen


async def test_checkpoint_pause_resume_and_their_acknowledgements(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        assert screen.snapshot.state == "running"
        await pilot.press("c")
        await until(pilot, lambda: "checkpoint ✓ done" in screen_text(app), 10, "the ack")
        assert [c["cmd"] for c in control_lines(fake_live.run_dir)] == ["checkpoint"]
        assert "request" in screen_text(app)  # the new checkpoint in the list

        await pilot.press("p")
        await until(pilot, lambda: screen.snapshot.state == "paused", 10, "paused")
        # "done" is written after the paused status: the feed may show one before the other.
        await until(pilot, lambda: "pause ✓ done" in screen_text(app), 10, "the pause ack")
        await pilot.press("p")
        await until(pilot, lambda: screen.snapshot.state == "running", 10, "resumed")
        cmds = [c["cmd"] for c in control_lines(fake_live.run_dir)]
        assert cmds == ["checkpoint", "pause", "resume"]


async def test_t_asks_for_a_profile_and_shows_where_the_trace_went(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        # The footer names the key (it may be drawn a frame after the snapshot on a busy machine).
        await until(pilot, lambda: "trace" in screen_text(app), 10, "the footer's trace key")
        await pilot.press("t")
        await until(pilot, lambda: control_lines(fake_live.run_dir), 5, "a control line")
        (line,) = control_lines(fake_live.run_dir)
        assert line["cmd"] == "profile" and line["steps"] == 5
        await until(pilot, lambda: "profile ✓ done" in screen_text(app), 10, "the ack")
        ack = next(e for e in read_events(fake_live.run_dir / "events.jsonl")
                   if e.get("id") == line["id"] and e["state"] == "done")  # fmt: skip
        log = "\n".join(strip.text for strip in screen.query_one("#log").lines)
        assert f"profile ✓ done @ step {ack['step']}: {ack['path']}" in log
        assert any(ack["path"] in str(n.message) for n in app._notifications)


async def test_o_writes_the_report_and_shows_where(fake_live):
    pytest.importorskip("matplotlib", reason="the report extra (the dev extra has it)")
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        await until(pilot, lambda: "report" in screen_text(app), 10, "the footer's report key")
        await pilot.press("o")
        index = fake_live.run_dir / "report" / "index.html"

        def logged() -> str:
            return "\n".join(strip.text for strip in screen.query_one("#log").lines)

        await until(pilot, lambda: "report written" in logged(), 60, "the report's line")
        assert f"report written: {index}" in logged()
        assert index.is_file() and "<h2>Summary</h2>" in index.read_text()
        assert (fake_live.run_dir / "report" / "loss.png").is_file()
        # The toast follows the log line from the report's thread: waited for, not raced.
        await until(pilot, lambda: any(str(index) in str(n.message) for n in app._notifications),
                    30, "the report's notification")  # fmt: skip
        assert control_lines(fake_live.run_dir) == []  # nothing asked of the run


async def test_s_asks_and_y_stops_the_run(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await loaded(pilot, app)
        await pilot.press("s")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # no: nothing sent
        assert app.screen is screen and control_lines(fake_live.run_dir) == []
        await pilot.press("s", "y")
        await until(pilot, lambda: screen.snapshot.state == "stopped", 10, "stopped")
        assert [c["cmd"] for c in control_lines(fake_live.run_dir)] == ["stop"]
        await pilot.press("q")  # ended: quits at once, with the run's exit code
    assert app.return_code == 0


async def test_k_asks_and_y_has_the_supervisor_kill_the_run(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app)
        await pilot.press("k")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        marker = fake_live.run_dir / "SIGUSR2-received"  # supervisor.KILLS: killed
        await until(pilot, marker.exists, 10, "the kill signal at the supervisor")
        await until(pilot, lambda: "supervisor is killing" in screen_text(app), 5, "the ack")
        assert control_lines(fake_live.run_dir) == []  # a kill is a signal, not a command


async def test_q_while_live_asks_stop_detach_or_cancel(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("n")
        assert isinstance(app.screen, RunScreen)
        await pilot.press("q", "d")  # detach: the run keeps going
    assert app.return_code == 0 and control_lines(fake_live.run_dir) == []

    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app)
        await pilot.press("q", "y")  # stop it and quit
    assert app.return_code == 0
    assert [c["cmd"] for c in control_lines(fake_live.run_dir)] == ["stop"]


async def test_d_detaches_and_the_run_keeps_running(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app)
        await pilot.press("d")
    assert app.return_code == 0
    assert fake_live.supervisor.poll() is None and fake_live.state == "running"


async def test_a_read_only_viewer_cannot_control_the_run(fake_live):
    app = app_on(fake_live.run_dir, readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await loaded(pilot, app)
        assert "read-only" in screen_text(app)
        await pilot.press("c", "p", "s", "k", "t")
        assert app.screen is screen and control_lines(fake_live.run_dir) == []
        await pilot.press("q")  # a viewer quits without asking
    assert app.return_code == 0


async def test_the_command_palette_sends_commands_too(fake_live):
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(100, 32)) as pilot:
        await loaded(pilot, app)
        await pilot.press("ctrl+p")
        await pilot.press(*"checkp")
        await until(pilot, lambda: "Checkpoint now" in screen_text(app), 5, "the command")
        await pilot.press("enter")
        await until(pilot, lambda: control_lines(fake_live.run_dir), 5, "a control line")
        assert control_lines(fake_live.run_dir)[0]["cmd"] == "checkpoint"


async def test_80x24_shows_every_panel_and_no_color_is_honoured(fake_live, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = app_on(fake_live.run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await loaded(pilot, app)
        await until(pilot, lambda: screen.snapshot.step > 50, 10, "a live step")
        assert app.no_color
        for wid in ("#header", "#loss", "#throughput", "#lr", "#devices-box", "#log"):
            region = screen.query_one(wid).region
            assert region.height >= 2 and region.right <= 80 and region.bottom <= 24, wid
        svg = app.export_screenshot()
        # #c5c8c6 is the SVG export's own default foreground, not a colour of the app.
        colours = set(re.findall(r"fill: (#[0-9a-f]{6})", svg)) - {"#c5c8c6"}
        greys = {c for c in colours if c[1:3] == c[3:5] == c[5:7]}
        assert colours == greys  # monochrome: every colour is a grey


async def test_a_big_run_shows_fast_and_backfills_its_evals(tmp_path):
    run = tmp_path / "runs" / "big-20260101-000000"
    run.mkdir(parents=True)
    (run / "run.toml").write_text("")
    synthetic.write_big_events(run / "events.jsonl", 60_000)
    app = app_on(run)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        await until(pilot, lambda: screen.snapshot.complete, 10, "the backfill")
        events = read_events(run / "events.jsonl")
        steps = [e["step"] for e in events if e["kind"] == "step"]
        evals = [e["step"] for e in events if e["kind"] == "eval"]
        assert screen.snapshot.step == steps[-1]
        assert [x for x, _ in screen.snapshot.eval_points] == evals


async def test_the_header_and_the_loss_chart_title_show_the_same_loss(tmp_path, monkeypatch):
    # The chart lines redraw at most every CHART_EVERY_S: made long here, so that the new
    # step reaches the charts' titles only if they follow every snapshot, as the header does.
    monkeypatch.setattr("gpu_console.tui.screens.run.CHART_EVERY_S", 3600.0)
    run = synthetic.write_run(tmp_path / "runs" / "live-20260101-000000", state="running",
                              steps=50, max_steps=1000, supervisor_pid=os.getpid())  # fmt: skip
    app = app_on(run)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        assert screen.snapshot.live and screen.snapshot.loss != 0.3436
        out = EventWriter(run / "events.jsonl")
        out.emit("step", step=60, loss=0.3436, lr=1e-3, samples_per_s=1000.0, step_time_s=0.01,
                 memory=[])  # fmt: skip
        out.close()
        await until(pilot, lambda: screen.snapshot.step == 60, 10, "the new step")
        await pilot.pause()
        text = screen_text(app)
        assert "loss 0.3436" in text  # the header
        title = str(screen.query_one("#loss").border_title)
        assert "train 0.3436" in title and "train 0.3436" in text  # the loss chart's title


async def test_lr_ticks_that_differ_in_the_fourth_digit_have_labels_that_tell_them_apart(tmp_path):
    # Early in a long cosine schedule the lr moves in its 4th digit: 3.000e-03 → 2.999e-03.
    run = synthetic.write_run(tmp_path / "runs" / "long-lr-20260101-000000", steps=1200,
                              max_steps=100_000)  # fmt: skip
    app = app_on(run)
    async with app.run_test(size=(120, 48)) as pilot:
        screen = await loaded(pilot, app)
        lr = screen.query_one("#lr")
        await until(pilot, lambda: lr.lines, 5, "the lr line")
        await pilot.pause()
        rows = str(lr.render()).splitlines()
        labels = [row.split("┤")[0].strip() for row in rows if "┤" in row]
        assert len(labels) == 3, rows
        values = [float(label.replace(",", "")) for label in labels]
        assert values[0] > values[1] > values[2], labels  # top to bottom, three numbers


async def test_m_shows_a_task_train_metric_in_the_main_chart(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "gan-20260101-000000", state="running",
                              steps=50, max_steps=1000, supervisor_pid=os.getpid())  # fmt: skip
    out = EventWriter(run / "events.jsonl")
    for step in range(51, 61):
        out.emit("step", step=step, loss=0.5, lr=1e-3, samples_per_s=1000.0, step_time_s=0.01,
                 memory=[], metrics={"D(x)": step / 100, "Loss_D": 1.0})  # fmt: skip
    out.close()
    app = app_on(run)
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await loaded(pilot, app)
        await until(pilot, lambda: screen.snapshot.step == 60, 10, "the metrics' steps")
        chart = screen.query_one("#loss")
        assert [line.label for line in chart.lines] == ["train", "eval"]
        await until(pilot, lambda: "chart" in screen_text(app), 10, "the footer's chart key")
        await pilot.press("m")  # the task's first metric (by name)
        assert "D(x)" in str(chart.border_title) and "0.6" in str(chart.border_title)
        assert [line.label for line in chart.lines] == ["D(x)"]
        assert list(chart.lines[0].points) == [(s, s / 100) for s in range(51, 61)]
        await pilot.press("m")
        assert [line.label for line in chart.lines] == ["Loss_D"]
        await pilot.press("m")  # and back to the loss
        assert [line.label for line in chart.lines] == ["train", "eval"]
        assert str(chart.border_title).startswith("loss")


async def test_the_header_shows_the_eval_in_progress_until_its_event(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "evaluating-20260101-000000", state="running",
                              steps=50, max_steps=1000, supervisor_pid=os.getpid())  # fmt: skip
    app = app_on(run)
    async with app.run_test(size=(100, 32)) as pilot:
        await loaded(pilot, app)
        out = EventWriter(run / "events.jsonl")
        out.emit("progress", phase="eval", step=50, done=120, total=400)
        await until(pilot, lambda: "eval 120/400" in screen_text(app), 10, "the eval's progress")
        out.emit("eval", step=50, loss=0.5)
        out.close()
        await until(pilot, lambda: "eval 120/400" not in screen_text(app), 10, "the eval's end")


async def test_a_mixture_of_experts_run_shows_each_experts_share_of_the_tokens(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "moe-20260101-000000", state="running",
                              steps=10, max_steps=1000, supervisor_pid=os.getpid())  # fmt: skip
    out = EventWriter(run / "events.jsonl")
    shares = [0.5, 0.25, 0.125, 0.125]  # expert 0 takes twice its even share
    for step in range(11, 21):
        metrics = {f"expert_load/{i}": share for i, share in enumerate(shares)}
        out.emit("step", step=step, loss=2.0, lr=1e-3, samples_per_s=100.0, step_time_s=0.1,
                 memory=[], metrics={**metrics, "dropped": 0.0123, "aux_loss": 1.5})  # fmt: skip
    out.close()
    plain = synthetic.write_run(tmp_path / "runs" / "mlp-20260101-000000", state="finished",
                                steps=10, max_steps=10)  # fmt: skip
    app = app_on(run)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await loaded(pilot, app)
        await until(pilot, lambda: screen.snapshot.step == 20, 10, "the routed steps")
        await until(pilot, lambda: screen.has_class("-experts"), 10, "the experts panel")
        assert screen.query_one("#experts-box").display
        text = screen.query_one("#experts").render().plain
        lines = text.splitlines()
        # One unit for every share: dropped is a percent of the tokens as the experts' are.
        assert lines[0] == "dropped 1.2%  aux_loss 1.5"
        assert [line.split()[0] for line in lines[1:]] == ["e0", "e1", "e2", "e3"]
        assert lines[1].endswith("50.0%") and lines[3].endswith("12.5%")
        # Bars against the even share (25 %), marked │: twice it fills the bar (blue to the
        # mark, orange past it), half of it a quarter.
        assert lines[1].count("█") == 12 and lines[2].count("█") == 6
        assert lines[3].count("█") == 3
        assert lines[2].index("│") == lines[2].index("█") + 6  # the even share: at the mark
        assert all(line.count("│") == 1 for line in lines[1:])
        subtitle = str(screen.query_one("#experts-box").border_subtitle)
        assert subtitle == "│ even share 25.0%"
    app = app_on(plain)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await loaded(pilot, app)
        assert not screen.has_class("-experts")
        assert not screen.query_one("#experts-box").display


@pytest.mark.parametrize("damage", ["empty", "missing"])
async def test_a_finished_run_with_a_damaged_status_is_repaired_by_the_console(tmp_path, damage):
    from gpu_console.runs import read_status

    run = synthetic.write_run(tmp_path / "runs" / "fin-20260101-000000", state="finished",
                              steps=300)  # fmt: skip
    (run / ".lock").touch()  # a run made with the session lock (lost.py): none holds it
    (end,) = [e for e in read_events(run / "events.jsonl") if e.get("state") == "finished"]
    if damage == "empty":
        (run / "status.json").write_text("")
    else:
        (run / "status.json").unlink()
    app = app_on(run, telemetry=False)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await loaded(pilot, app)
        await until(pilot, lambda: read_status(run).get("ended"), 5, "the repaired status.json")
        assert screen.snapshot.state == "finished"
        assert screen.snapshot.step == 300
    repaired = read_status(run)
    assert (repaired["state"], repaired["step"], repaired["exit_code"]) == ("finished", 300, 0)
    assert repaired["ended"] == end["t"]
    assert repaired["repaired"]["from"] == "events.jsonl"
