"""The console at the sizes people use (80×24 first), and what it says while a run starts, in
its log and on the launch screen (issue 42, point 11). Pilot tests on synthetic run
directories, and the feed read without Textual."""

from __future__ import annotations

import json
import os
import time

import pytest
import synthetic
from test_telemetry_fake import FakeNvml, install
from tui_support import screen_text, until

from gpu_console.events import EventWriter
from gpu_console.tui import rank_log
from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.feed import RunFeed
from gpu_console.tui.screens.launch import LaunchScreen
from gpu_console.tui.screens.run import RunScreen
from gpu_console.tui.task_source import uses_train_lr

pytestmark = pytest.mark.quick
EXPERTS = 8
SHARES = [0.3] + [0.7 / (EXPERTS - 1)] * (EXPERTS - 1)


def app_on(run_dir, **kw) -> ConsoleApp:
    kw.setdefault("telemetry", False)
    kw.setdefault("refresh_s", 0.05)
    return ConsoleApp(runs_dir=run_dir.parent, run_dir=run_dir, **kw)


def moe_run(tmp_path, keep_best: str = "", shares=SHARES, dropped=0.0123, aux=1.5):
    """A live mixture of experts' run at step 320: eight experts, three checkpoints on disk."""
    run = synthetic.write_run(tmp_path / "runs" / "moe-20260101-000000", state="running",
                              steps=300, max_steps=1000, supervisor_pid=os.getpid(),
                              task="moe")  # fmt: skip
    if keep_best:
        with open(run / "run.toml", "a") as f:
            f.write(f'\n[checkpoint]\nkeep_best = "{keep_best}"\nbest_mode = "max"\n')
    out = EventWriter(run / "events.jsonl")
    for step in range(310, 321, 10):
        metrics = {f"expert_load/{i}": share for i, share in enumerate(shares)}
        out.emit("step", step=step, loss=2.0, lr=1e-3, samples_per_s=100.0, step_time_s=0.1,
                 memory=[], metrics={**metrics, "dropped": dropped, "aux_loss": aux})  # fmt: skip
    out.close()
    return run


async def shown(pilot, app, experts: bool = True) -> RunScreen:
    def ready():
        s = app.screen
        return (
            isinstance(s, RunScreen)
            and s.snapshot is not None
            and s.snapshot.step == (320 if experts else s.snapshot.step)
            and s.has_class("-experts") == experts
        )

    await until(pilot, ready, 10, "the run's newest step")
    await pilot.pause()
    await pilot.pause()  # the panels refit to the size they were laid out at
    return app.screen


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40)])
@pytest.mark.asyncio
async def test_a_moe_run_keeps_a_log_of_40_columns_and_every_expert_in_view(tmp_path, size):
    run = moe_run(tmp_path)
    app = app_on(run)
    async with app.run_test(size=size) as pilot:
        screen = await shown(pilot, app)
        log = screen.query_one("#log").region
        assert log.width >= 40 and log.right <= size[0], log
        box = screen.query_one("#experts-box")
        rows = screen.query_one("#experts").render().plain.splitlines()
        # Every expert on a row of its own or compacted, and every row in view (no scroll).
        named = [w for row in rows[1:] for w in row.split() if w.startswith("e")]
        assert named == [f"e{i}" for i in range(EXPERTS)], rows
        assert len(rows) <= box.scrollable_content_region.height, (rows, box.region)
        assert rows[0] == "dropped 1.2%  aux_loss 1.5"  # a percent, as the shares are
        assert rows[1].split()[2] in ("30%", "30.0%")  # one decimal where a row each fits
        # The even share marked in every expert's bar.
        assert all(row.count("│") == sum(w[0] == "e" for w in row.split()) for row in rows[1:])
        text = screen_text(app)
        assert "│ even share 12.5%" in text
        if size[0] < 100:  # the checkpoints gave way: the log's subtitle names the newest
            assert not screen.query_one("#checkpoints-box").display
            assert "▶ ckpt 300" in str(screen.query_one("#log").border_subtitle)
        else:  # a title and legend that fit, not cut
            assert "checkpoints on disk ─" in text and "▶ LATEST  ★ BEST" in text
            assert screen.query_one("#checkpoints-box").region.width >= 30


@pytest.mark.asyncio
async def test_the_panels_follow_a_resized_terminal(tmp_path):
    run = moe_run(tmp_path)
    app = app_on(run)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await shown(pilot, app)
        log, checkpoints = screen.query_one("#log"), screen.query_one("#checkpoints-box")

        def expert_rows() -> int:
            return len(screen.query_one("#experts").render().plain.splitlines())

        assert "▶ ckpt 300" in str(log.border_subtitle) and expert_rows() == 1 + EXPERTS // 2
        await pilot.resize_terminal(120, 40)
        await until(pilot, lambda: checkpoints.display, 10, "the checkpoints panel")
        await until(pilot, lambda: not log.border_subtitle, 10, "the log's subtitle cleared")
        await until(pilot, lambda: expert_rows() == 1 + EXPERTS, 10, "a row per expert")
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: "▶ ckpt 300" in str(log.border_subtitle), 10, "the subtitle")
        await until(pilot, lambda: expert_rows() == 1 + EXPERTS // 2, 10, "two to a row")


@pytest.mark.asyncio
async def test_a_long_first_row_of_the_experts_panel_is_shortened_never_wrapped(tmp_path):
    # What a real moe run of four experts showed at 80×24: "dropped 22.4%  aux_loss 1.088"
    # wrapped onto a second row, and the last expert went out of view.
    run = moe_run(tmp_path, shares=[0.355, 0.432, 0.057, 0.156], dropped=0.224, aux=1.088)
    app = app_on(run)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await shown(pilot, app)
        box = screen.query_one("#experts-box")
        rows = screen.query_one("#experts").render().plain.splitlines()
        assert rows[0] == "drop 22.4%  aux 1.088", rows
        assert [row.split()[0] for row in rows[1:]] == ["e0", "e1", "e2", "e3"]
        assert len(rows) <= box.scrollable_content_region.height
        assert "e3 " in screen_text(app) and "43.2%" in screen_text(app)


@pytest.mark.asyncio
async def test_80x24_without_experts_keeps_the_checkpoints_in_fewer_columns(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "mlp-20260101-000000", steps=300,
                              checkpoint_every=100)  # fmt: skip
    app = app_on(run)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await shown(pilot, app, experts=False)
        assert screen.query_one("#log").region.width >= 40
        text = screen_text(app)
        assert "checkpoints on disk ─" in text and "▶ LATEST  ★ BEST" in text
        rows = screen.query_one("#checkpoints").render().plain.splitlines()
        assert rows[0].split()[:3] == ["▶", "300", "end"] and "B" not in rows[0]  # no size
    async with app_on(run).run_test(size=(120, 40)) as pilot:
        screen = await shown(pilot, pilot.app, experts=False)
        rows = screen.query_one("#checkpoints").render().plain.splitlines()
        assert "B" in rows[0]  # wide enough: the size is back


@pytest.mark.asyncio
async def test_the_chart_says_which_metric_keep_best_watches(tmp_path):
    run = moe_run(tmp_path, keep_best="accuracy")
    app = app_on(run)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await shown(pilot, app)
        chart = screen.query_one("#loss")
        title, subtitle = str(chart.border_title), str(chart.border_subtitle)
        assert "eval loss" in title  # what the chart draws, named
        assert "best by accuracy 0.675" in subtitle and "whole run" in subtitle


# -- start-up ----------------------------------------------------------------------------------


def starting_run(tmp_path):
    run = tmp_path / "runs" / "quickstart-20260101-000000"
    (run / "logs").mkdir(parents=True)
    (run / "run.toml").write_text("[train]\nmax_steps = 100\n")
    now = time.time()
    meta = {"id": run.name, "started": now - 5, "launched": now - 6,
            "placement": {"device_type": "cpu", "nproc": 2}, "world_size": 2}  # fmt: skip
    (run / "meta.json").write_text(json.dumps(meta))
    return run


def write_status(run, **pids):
    status = {"state": "starting", "reason": "", "started": time.time() - 4,
              "pids": {"supervisor": os.getpid(), **pids}}  # fmt: skip
    (run / "status.json").write_text(json.dumps(status))


def stage(run) -> str:
    feed = RunFeed(run, telemetry=False)
    try:
        feed.load()
        return feed.snapshot().startup
    finally:
        feed.close()


def test_each_start_up_stage_is_read_from_what_the_run_directory_shows(tmp_path):
    run = starting_run(tmp_path)
    assert stage(run) == "launching: starting the supervisor"
    write_status(run)
    assert stage(run) == "supervisor up: starting torchrun"
    write_status(run, torchrun=os.getpid())
    assert stage(run).startswith("torchrun started")
    beat = {"rank": 0, "local_rank": 0, "pid": os.getpid(), "host": os.uname().nodename,
            "restart": 0, "step": 0, "phase": "starting", "detail": "", "since": time.time(),
            "t": time.time()}  # fmt: skip
    (run / "heartbeats").mkdir()
    (run / "heartbeats" / "rank-00000.json").write_text(json.dumps(beat))
    assert stage(run) == "1/2 ranks up: importing torch, then joining the process group"
    out = EventWriter(run / "events.jsonl")
    out.emit("status", state="starting", reason="")
    assert stage(run) == "building the model and data"
    out.emit("start", world_size=2, device_type="cpu", max_steps=100, start_step=0)
    out.emit("status", state="running", reason="")
    assert stage(run) == "first step…"
    out.emit("step", step=10, loss=1.0, lr=1e-3, samples_per_s=10.0, memory=[])
    out.close()
    assert stage(run) == ""


@pytest.mark.asyncio
async def test_the_run_screen_says_what_a_starting_run_is_doing(tmp_path):
    run = starting_run(tmp_path)
    write_status(run, torchrun=os.getpid())
    app = app_on(run)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot,
                    10, "the screen")  # fmt: skip
        await until(pilot, lambda: "torchrun started" in screen_text(app), 10, "the stage")
        out = EventWriter(run / "events.jsonl")
        out.emit("status", state="starting", reason="")
        out.close()
        await until(pilot, lambda: "building the model" in screen_text(app), 10, "the next one")


# -- the log pane ------------------------------------------------------------------------------

KINETO = [
    "STAGE:2026-11-29 03:06:36 2812:2812 ActivityProfilerController.cpp:314] Completed Stage: "
    "Warm Up",
    "USDT:2026-11-29 03:06:36 2812:2812 SyncActivityProfilerHandler.cpp:52] profiler_start",
    "USDT:2026-11-29 03:06:36 2812:2812 SyncActivityProfilerHandler.cpp:59] profiler_stop",
]
KINETO_WARNING = (
    "WARNING:2026-11-29 03:06:36 2812:2812 CuptiActivityProfiler.cpp:100] CUPTI: no privileges"
)


def logged(feed: RunFeed) -> list[str]:
    return [line.text for line in feed.snapshot().new_logs]


def test_a_log_line_of_the_task_shows_once_and_the_profilers_chatter_folds(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "logs-20260101-000000")
    with open(run / "events.jsonl", "a") as f:
        event = {"v": 1, "t": synthetic.T0 + 9, "kind": "log", "level": "info",
                 "message": "hello from the task", "source": "task"}  # fmt: skip
        f.write(json.dumps(event) + "\n")
    # The engine prints each log event on the rank's stderr; torchrun tees it here.
    ranks = ["[default0]:[info] hello from the task", "[default1]:[info] rank 1: its own line",
             "[default1]:[info] hello from the task"]  # fmt: skip
    ranks += [f"[default0]:{line}" for line in KINETO + [KINETO_WARNING] + KINETO]
    with open(run / "logs" / "torchrun.log", "a") as f:
        f.write("\n".join(ranks) + "\n")
    feed = RunFeed(run, telemetry=False)
    try:
        feed.load()
        lines = logged(feed)
        assert lines.count("[info] hello from the task") == 1, lines
        assert not any("hello from the task" in line for line in lines if line.startswith("r0│"))
        # Rank 1 writes no events, so its lines show at once, even one in an echo's words.
        assert "r1│ [info] rank 1: its own line" in lines
        assert "r1│ [info] hello from the task" in lines
        assert lines.count(rank_log.PROFILER_FOLDED) == 1
        assert not any("profiler_start" in line or "Warm Up" in line for line in lines)
        assert f"r0│ {KINETO_WARNING}" in lines  # a real warning stays

        # Live: the event and its echo met in one poll (the echo is printed after the event).
        with open(run / "events.jsonl", "a") as f:
            f.write(json.dumps({"v": 1, "t": synthetic.T0 + 10, "kind": "log",
                                "level": "warning", "message": "a second one"}) + "\n")  # fmt: skip
        with open(run / "logs" / "torchrun.log", "a") as f:
            f.write("[default0]:[warning] a second one\n[default0]:[warning] a second one\n")
        feed.poll()
        lines = logged(feed)
        feed.poll()
        lines += logged(feed)
        # One event, two lines printed: the second is the rank's own, and shows.
        assert lines == ["[warning] a second one", "r0│ [warning] a second one"], lines

        # The event written between the feed's two reads: its echo is read first.
        with open(run / "logs" / "torchrun.log", "a") as f:
            f.write("[default0]:[info] written between the reads\n")
        feed.poll()
        lines = logged(feed)
        with open(run / "events.jsonl", "a") as f:
            f.write(json.dumps({"v": 1, "t": synthetic.T0 + 11, "kind": "log", "level": "info",
                                "message": "written between the reads"}) + "\n")  # fmt: skip
        feed.poll()
        lines += logged(feed)
        feed.poll()
        lines += logged(feed)
        assert lines == ["[info] written between the reads"], lines
    finally:
        feed.close()


# -- the launch screen -------------------------------------------------------------------------


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    install(monkeypatch, FakeNvml(0))
    return tmp_path


async def launch_screen(pilot, app) -> LaunchScreen:
    await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the launch screen")
    screen = app.screen
    await until(pilot, lambda: screen.preview and screen._devices_ready, 10, "profiles, devices")
    await pilot.pause()
    return screen


@pytest.mark.asyncio
async def test_a_profile_in_the_working_directory_is_offered(here):
    (here / "exp.toml").write_text(
        '[profile]\ndescription = "mine, here"\n[train]\nmax_steps = 5\n'
    )
    (here / "pyproject.toml").write_text('[project]\nname = "x"\n')  # not a profile
    (here / "broken.toml").write_text("[train\n")
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await launch_screen(pilot, app)
        listed = {p.name: p.origin for p in screen.profiles}
        assert listed["exp"] == "here" and "pyproject" not in listed and "broken" not in listed
        assert "(./exp.toml)" in screen_text(app)
        screen.query_one("#profiles").highlighted = [p.name for p in screen.profiles].index("exp")
        await until(pilot, lambda: "max_steps = 5" in (screen.preview.toml or ""), 10, "exp")


@pytest.mark.asyncio
async def test_the_first_enter_in_the_device_list_or_the_precisions_launches(here):
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await launch_screen(pilot, app)
        launched = []
        screen._launch = lambda *args: launched.append(args)  # the launch itself: elsewhere
        devices = screen.query_one("#device-list")
        before = list(devices.selected)
        devices.focus()
        await pilot.press("enter")  # the first Enter, nothing highlighted in the list yet
        assert len(launched) == 1 and launched[0][0].stem == "quickstart"
        assert list(devices.selected) == before  # Enter launches; Space toggles
        screen.launching = False
        screen.query_one("#precision").focus()
        await pilot.press("enter")
        assert len(launched) == 2


@pytest.mark.asyncio
async def test_the_lr_field_says_whether_the_task_takes_train_lr(here):
    (here / "own_opt.py").write_text(
        "class Task:\n    def configure_optimizers(self, model, ctx):\n        return None\n"
    )
    (here / "plain_task.py").write_text("class Task:\n    pass\n")
    for name, kind in (("own", "own_opt:Task"), ("plain", "plain_task:Task")):
        (here / f"{name}.toml").write_text(f'[task]\nkind = "{kind}"\n')
    assert uses_train_lr("mlp") is True
    assert uses_train_lr("own_opt:Task") is False
    assert uses_train_lr("plain_task:Task") is None  # a base class may define it: unknown
    assert uses_train_lr("nowhere.at_all:Task") is None
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await launch_screen(pilot, app)
        label = screen.query_one("#label-lr")
        assert str(label.render()) == "lr"  # quickstart: a built-in task
        names = [p.name for p in screen.profiles]
        for name, expected in (("own", "lr unused"), ("plain", "lr if used")):
            screen.query_one("#profiles").highlighted = names.index(name)
            await until(pilot, lambda n=name: screen.preview.path.stem == n, 10, name)
            await pilot.pause()
            assert str(label.render()) == expected
            if name == "own":  # not the profile's train.lr, as if it applied
                assert screen.query_one("#set-lr").placeholder == "its own optimizer"


def test_every_share_draws_a_bar_of_its_width():
    # A share a hair under a whole cell rounded up to the ninth eighth and failed the
    # panel (and the console with it) on a real moe run: e.g. 0.2083 of the tokens for four.
    from gpu_console.tui.widgets.experts import experts_text

    for k in range(0, 1001):
        shares = [k / 1000, 0.25, 0.25, 0.25]
        metrics = {f"expert_load/{i}": s for i, s in enumerate(shares)}
        for width, height in ((None, None), (27, 5), (27, 3)):
            rows = experts_text(metrics, width, height).plain.splitlines()
            assert all(len(row) <= (width or 24) for row in rows), rows
            marks = [row.index("│") for row in rows]  # every bar as wide: the mark in line
            assert len(set(marks)) == 1, rows
