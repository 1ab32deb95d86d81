"""The launch screen with Textual's Pilot: profiles, devices (through the fake-NVML seam),
precision, overrides validated as typed, launch errors, and one real launch of quickstart
whose keys then checkpoint, pause, resume and stop it."""

from __future__ import annotations

import pynvml
import pytest
from conftest import events_of, read_status, run_dirs
from test_telemetry_fake import FakeGpu, FakeNvml, install
from tui_support import kill_runs, screen_text, until

from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.messages import Preview, PreviewReady
from gpu_console.tui.screens.launch import LaunchScreen, key_lines
from gpu_console.tui.screens.run import RunScreen

pytestmark = pytest.mark.asyncio
GIB = 2**30


def resolved_toml(screen) -> str:
    """The resolved profile the preview pane renders (all of it: the pane scrolls, and the
    profile has more keys than 32 rows show)."""
    return screen.preview.toml if screen.preview is not None and screen.preview.toml else ""


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory of the test's own (./profiles is looked up from it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_gpu(monkeypatch):
    return install(monkeypatch, FakeNvml(0, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))


async def ready(pilot, app) -> LaunchScreen:
    await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the launch screen")
    screen = app.screen
    await until(pilot, lambda: screen.preview and screen._devices_ready, 10, "profiles, devices")
    await pilot.pause()  # one more frame: the screen shows what the handlers set
    return screen


async def test_opens_on_the_profiles_with_quickstart_first_and_its_resolved_toml(here, no_gpu):
    (here / "profiles").mkdir()
    (here / "profiles" / "mine.toml").write_text(
        '[profile]\ndescription = "a local one"\n[train]\nmax_steps = 7\n'
    )
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await ready(pilot, app)
        profiles = screen.query_one("#profiles")
        assert app.focused is profiles and profiles.highlighted == 0
        assert [p.name for p in screen.profiles][:1] == ["quickstart"]
        assert {"mine", "transformer"} <= {p.name for p in screen.profiles}
        text = screen_text(app)
        assert "resolved: quickstart" in text and 'kind = "mlp"' in text
        assert "a local one" in text and "(local)" in text
        # No GPU: a CPU choice, the reason, and fp16 off with its reason.
        assert "CPU × 2 ranks" in text and "NVML library not found" in text
        assert screen.query_one("#prec-fp16").disabled and "fp16 needs a GPU" in text
        await pilot.press("down")
        await until(pilot, lambda: "resolved: mine" in screen_text(app), 5, "the next preview")
        assert "max_steps = 7" in resolved_toml(screen)


async def test_overrides_are_validated_as_typed_with_the_messages_of_set(here, no_gpu):
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await ready(pilot, app)
        field = screen.query_one("#set-max_steps")
        assert field.placeholder == "300"
        field.focus()
        await pilot.press("0")
        await until(pilot, lambda: field.has_class("-bad"), 5, "the field marked")
        assert "--set: train.max_steps:" in screen_text(app)
        await pilot.press("enter")  # refused: nothing is launched
        assert not run_dirs(here / "runs") and isinstance(app.screen, LaunchScreen)
        await pilot.press("backspace", "4", "2")
        await until(pilot, lambda: not field.has_class("-bad"), 5, "the field cleared")
        await until(pilot, lambda: "max_steps = 42" in resolved_toml(screen), 5, "the preview")
        lr = screen.query_one("#set-lr")
        lr.focus()
        await pilot.press(*"fast")
        await until(pilot, lambda: "--set: train.lr:" in screen_text(app), 5, "the lr message")


async def test_a_preview_of_overrides_since_retyped_is_dropped(here, no_gpu):
    # Resolving runs in thread workers that always run to their end, so the answer for an
    # older text can arrive after the newest one; it must not show, nor block a launch. (Typing
    # 1000000 into max steps passes through 1 and 10, below quickstart's warmup_steps.)
    app = ConsoleApp(runs_dir=here / "blocked")
    (here / "blocked").write_text("a file: a launch that gets past the problems fails here")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await ready(pilot, app)
        field = screen.query_one("#set-max_steps")
        field.focus()
        await pilot.press("4", "2")
        await until(pilot, lambda: "max_steps = 42" in resolved_toml(screen), 5, "the preview")
        stale = Preview(screen.selected_path(), sets=["train.max_steps=4x"])
        stale.problems = ["--set: train.max_steps: expected an integer (got '4x')"]
        screen.post_message(PreviewReady(stale))
        await pilot.pause()
        await pilot.pause()
        assert "expected an integer" not in screen_text(app) and not field.has_class("-bad")
        assert screen.preview.sets == ["train.max_steps=42"]
        # Enter pressed while the newest answer is still resolving: the one before it (here a
        # real problem of max_steps 4: below warmup_steps) does not judge the launch.
        screen.preview = Preview(screen.selected_path(), sets=["train.max_steps=4"])
        screen.preview.problems = ["train.warmup_steps: must not exceed train.max_steps=4"]
        await pilot.press("enter")  # the launch goes ahead (and fails on the runs directory)
        await until(pilot, lambda: "cannot create the runs directory" in screen_text(app), 10,
                    "the launch attempted")  # fmt: skip


async def test_a_preview_of_the_profile_highlighted_before_does_not_judge_the_launch(here, no_gpu):
    app = ConsoleApp(runs_dir=here / "blocked")
    (here / "blocked").write_text("a file: a launch that gets past the problems fails here")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await ready(pilot, app)
        other = next(p.path for p in screen.profiles if p.path != screen.selected_path())
        # Enter before the highlighted profile's own answer: the other profile's problem stays
        # with the other profile.
        screen.preview = Preview(other, sets=screen.overrides())
        screen.preview.problems = ["train.lr: must be > 0 (got 0.0)"]
        screen.query_one("#set-max_steps").focus()
        await pilot.press("enter")
        await until(pilot, lambda: "cannot create the runs directory" in screen_text(app), 10,
                    "the launch attempted")  # fmt: skip
        assert "train.lr" not in screen_text(app)


async def test_gpus_are_listed_live_toggled_with_space_and_bf16_needs_ampere(here, monkeypatch):
    gpus = [
        FakeGpu(0, name="NVIDIA A100-SXM4-80GB", memory_used=3 * GIB, util_gpu=41,
                temperature=52, processes=[(999_999, GIB)]),
        FakeGpu(1, name="Tesla V100-SXM2-32GB", memory_total=32 * GIB, capability=(7, 0)),
    ]  # fmt: skip
    fake = install(monkeypatch, FakeNvml(gpus))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing restricts the GPUs: both are yours
    app = ConsoleApp(runs_dir=here / "runs", devices_every_s=0.2)
    async with app.run_test(size=(120, 32)) as pilot:
        screen = await ready(pilot, app)
        text = screen_text(app)
        assert "GPU 0 A100-SXM4-80GB  3.0/80 GiB  41% 52°C  busy: pid 999999" in text
        assert "GPU 1 Tesla V100-SXM2-32GB" in text
        assert screen.devices_spec() == "0,1" and "→ GPU 0,1" in text
        assert screen.query_one("#prec-bf16").disabled
        assert "bf16 needs compute capability ≥ 8.0 (GPU 1 is 7.0)" in text
        fake.gpus[0].util_gpu = 97
        await until(pilot, lambda: "97%" in screen_text(app), 5, "a live refresh")
        devices = screen.query_one("#device-list")
        devices.focus()
        devices.highlighted = 1
        await pilot.press("space")  # GPU 1 off
        assert screen.devices_spec() == "0" and "→ GPU 0" in screen_text(app)
        assert not screen.query_one("#prec-bf16").disabled
        devices.highlighted = 2
        await pilot.press("space")  # the CPU choice clears the GPUs
        assert screen.devices_spec().startswith("cpu:") and "→ CPU ×" in screen_text(app)
        await pilot.press("minus", "minus", "minus")
        assert screen.devices_spec() == "cpu:1" and "CPU × 1 rank" in screen_text(app)


@pytest.mark.parametrize(
    "env, yours",
    [({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]), ({"SLURM_STEP_GPUS": "1"}, ["1"])],
)
async def test_gpus_outside_the_grant_are_not_yours_and_never_picked(here, monkeypatch, env, yours):
    install(monkeypatch, FakeNvml(4))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(120, 32)) as pilot:
        screen = await ready(pilot, app)
        text = screen_text(app)
        devices = screen.query_one("#device-list")
        for i in range(4):
            line = next(ln for ln in text.splitlines() if f"GPU {i} A100" in ln)
            assert ("not yours" in line) == (str(i) not in yours), line
            assert devices.get_option_at_index(i).disabled == (str(i) not in yours)
        assert screen.devices_spec() == ",".join(yours), "auto takes the granted GPUs only"
        assert f"→ GPU {','.join(yours)}" in text
        devices.focus()
        devices.highlighted = 0  # GPU 0 is never yours here: Space cannot pick it
        await pilot.press("space")
        assert screen.devices_spec() == ",".join(yours)


async def test_a_launch_error_is_shown_and_the_app_keeps_going(here, no_gpu):
    blocker = here / "runs"
    blocker.write_text("a file where the runs directory should be")
    app = ConsoleApp(runs_dir=blocker)
    async with app.run_test(size=(100, 32)) as pilot:
        await ready(pilot, app)
        await pilot.press("enter")
        await until(pilot, lambda: "cannot create the runs directory" in screen_text(app), 10,
                    "the launch error")  # fmt: skip
        assert isinstance(app.screen, LaunchScreen) and not app.screen.launching


async def test_enter_launches_quickstart_and_the_keys_control_it(here, no_gpu):
    runs = here / "runs"
    app = ConsoleApp(runs_dir=runs, refresh_s=0.1)
    try:
        async with app.run_test(size=(100, 32)) as pilot:
            screen = await ready(pilot, app)
            screen.query_one("#set-max_steps").value = "1000000"  # long enough to control
            screen.query_one("#profiles").focus()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, RunScreen), 15, "the run screen")
            run = app.screen
            assert run.owner
            await until(pilot, lambda: run.snapshot and run.snapshot.step > 0, 90, "a step")
            # The devices panel reads what the run's supervisor records; it samples nothing.
            await until(pilot, lambda: run.snapshot.devices.source == "file", 30, "recorded")
            assert "samples/s" in screen_text(app) and "running" in screen_text(app)

            await pilot.press("c")
            # Answered with a checkpoint: a new one, or the interval's of the step it landed on.
            answered = lambda: [  # noqa: E731
                e for e in events_of(run.run_dir, "control")
                if e.get("cmd") == "checkpoint" and e.get("state") == "done" and e.get("checkpoint")
            ]  # fmt: skip
            await until(pilot, answered, 60, "a checkpoint answering the request")
            await until(pilot, lambda: "checkpoint ✓ done" in screen_text(app), 10, "its ack")

            await pilot.press("p")
            await until(pilot, lambda: run.snapshot.state == "paused", 30, "paused")
            await until(pilot, lambda: read_status(run.run_dir).get("state") == "paused", 10,
                        "status.json paused")  # fmt: skip
            await pilot.press("p")
            await until(pilot, lambda: run.snapshot.state == "running", 30, "resumed")

            await pilot.press("s", "y")
            await until(pilot, lambda: read_status(run.run_dir).get("ended"), 60, "the end")
            assert read_status(run.run_dir)["state"] == "stopped"
            await until(pilot, lambda: run.snapshot.state == "stopped", 10, "stopped shown")
            # The run's supervisor recorded the device samples (this console only read them).
            assert (run.run_dir / "telemetry.jsonl").stat().st_size > 0
            await pilot.press("q")
        assert app.return_code == 0
    finally:
        kill_runs(runs)


async def test_a_quit_as_soon_as_it_starts_leaves_cleanly(here, no_gpu):
    # The controls mount after the first frame: a screen that goes away first is left alone.
    class QuitAtOnce(ConsoleApp):
        def on_ready(self) -> None:
            self.exit(0)

    app = QuitAtOnce(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)):
        pass
    assert app.return_code == 0


async def test_an_override_is_scrolled_into_view_and_marked(here, no_gpu):
    # The resolved profile is longer than the pane: an overridden key further down than the
    # first rows (train.lr, then data.batch_size above it) is brought into view.
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await ready(pilot, app)
        assert "lr = 0.25" not in screen_text(app)  # below the pane's rows before the override
        field = screen.query_one("#set-lr")
        field.focus()
        await pilot.press(*"0.25")
        await until(pilot, lambda: "lr = 0.25" in screen_text(app), 5, "the override in view")
        pane = screen.query_one("#resolved")
        assert pane.scroll_y > 0
        assert key_lines(screen.preview.toml, ["train.lr"]) == [
            screen.preview.toml.splitlines().index("lr = 0.25") + 1
        ]


async def test_a_max_steps_below_the_warmup_says_the_warmup_is_clamped(here, no_gpu):
    # What a launch would change (the run's own warmup shortened to the run) is said on the
    # launch screen, before the launch, in the words of the headless run's note.
    app = ConsoleApp(runs_dir=here / "runs")
    async with app.run_test(size=(100, 32)) as pilot:
        screen = await ready(pilot, app)
        assert "warmup_steps" not in screen_text(app)
        field = screen.query_one("#set-max_steps")
        field.focus()
        await pilot.press("5")
        await until(pilot, lambda: "max_steps = 5" in resolved_toml(screen), 5, "the preview")
        await pilot.pause()
        text = screen_text(app)
        assert "train.warmup_steps" in text and "→ 5" in text and not field.has_class("-bad")
        assert "warmup_steps = 5" in resolved_toml(screen)
