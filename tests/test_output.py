"""Output a person can copy and read: the summary and ``profiles`` never cut a path, plain
progress lines come on a steady beat, an early failure's summary says what was known, ``ls``
names what its times measure, and ``--help`` names every value (``RUN``, not ``<str>``)."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from pathlib import Path

import pytest
import typer
from conftest import (
    FinishedRun,
    Procs,
    deadline,
    events_of,
    fast_profile,
    only_run,
    paced_profile,
    pinned_env,
    read_events,
    task_profile,
)
from conftest import test_env as cli_env
from rich.console import Console
from typer.testing import CliRunner

from gpu_console.cli import app
from gpu_console.commands import profiles as profiles_cmd
from gpu_console.format import fmt
from gpu_console.headless import PLAIN_EVERY_S, Rhythm
from gpu_console.state import RunState
from gpu_console.summary import print_summary

BOX = set("│┃─━┌┐└┘├┤┬┴┼")
LONG = "a-run-directory-whose-name-alone-is-wider-than-a-narrow-terminal"


def long_run(tmp_path: Path) -> tuple[RunState, Path]:
    """A failed run with a checkpoint, in a directory whose path no narrow terminal fits."""
    run = tmp_path / LONG / "runs" / f"{LONG}-20261124-070000"
    st = RunState()
    st.apply({"kind": "start", "t": 10.0, "world_size": 2, "device_type": "cpu"}
             | {"precision": "fp32", "task": "mlp", "params": 76810, "max_steps": 300})  # fmt: skip
    st.apply({"kind": "step", "t": 11.0, "step": 100, "loss": 0.5, "samples_per_s": 10.0})
    checkpoint = run / "checkpoints" / "step-00000100"
    st.apply({"kind": "checkpoint", "t": 12.0, "step": 100, "reason": "interval"}
             | {"path": str(checkpoint), "bytes": 1, "seconds": 0.1})  # fmt: skip
    # On disk, as the summary names it from there (an empty zip: state.pt looks whole).
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    (checkpoint / "meta.json").write_text(json.dumps({"step": 100, "reason": "interval"}))
    (checkpoint.parent / "LATEST").write_text("step-00000100\n")
    why = "rank 1 failed: RuntimeError: " + " ".join(f"word{i}" for i in range(30))
    failure = {"summary": why, "traceback": f"Traceback\n  x\n{why}"}
    st.apply_status({"state": "failed", "reason": why, "started": 10.0, "ended": 20.0,
                     "failure": failure})  # fmt: skip
    return st, run


def words_of(text: str) -> str:
    """The text without borders and line breaks: what a folded value reads as."""
    return " ".join("".join(" " if c in BOX else c for c in text).split())


@pytest.mark.parametrize("width", [40, 200])
def test_on_a_terminal_the_summary_wraps_and_every_path_is_one_whole_line(tmp_path, width):
    st, run = long_run(tmp_path)
    console = Console(force_terminal=True, width=width, record=True, color_system=None)
    print_summary(console, st, run)
    text = console.export_text()
    lines = text.splitlines()
    assert "…" not in text
    assert any(c in BOX for c in text), "a terminal gets the table"
    # Named relative to the run directory, which is printed whole below it.
    assert "checkpoint: checkpoints/step-00000100 (step 100, interval)" in lines
    assert f"run dir: {run}" in lines
    # Long values (the failure) fold onto more lines of the table: every word is there.
    flat = words_of(text)
    assert st.reason in flat and "word29" in flat
    assert "steps 100/300" in flat and "devices 2 × cpu, fp32" in flat
    if width == 40:
        table = [ln for ln in lines if ln[:1] in BOX]
        assert table and all(len(ln) <= 40 for ln in table)


@pytest.mark.parametrize("width", [40, 200])
def test_off_a_terminal_the_summary_is_key_value_lines(tmp_path, width):
    st, run = long_run(tmp_path)
    out = io.StringIO()
    print_summary(Console(file=out, width=width), st, run)
    lines = out.getvalue().splitlines()
    assert not any(c in BOX for c in out.getvalue())
    assert lines[0] == f"{run.name}: failed"
    pairs = [ln.split(": ", 1) for ln in lines[1:] if not ln.startswith("  ")]
    assert all(len(p) == 2 or p[0].endswith(":") for p in pairs), lines
    values = {p[0]: p[1] for p in pairs if len(p) == 2}
    assert values["checkpoint"] == "checkpoints/step-00000100 (step 100, interval)"
    assert values["run dir"] == str(run)
    assert values["failure"] == st.reason
    assert values["steps"] == "100/300" and values["devices"] == "2 × cpu, fp32"
    assert values["task"] == "mlp (76,810 parameters)"
    # A multi-line value (the traceback's tail) is indented under its key.
    at = lines.index("traceback:")
    assert lines[at + 1 :][:3] == ["  Traceback", "    x", f"  {st.reason}"]


def test_the_rhythm_is_the_first_step_then_a_fixed_beat_then_the_end():
    rhythm = Rhythm(5.0)
    shown = []

    def poll(now, step, ended=False):
        if rhythm.due(now, step, ended):
            rhythm.shown(now, step)
            shown.append(now)

    poll(0.0, 0)  # no step yet: nothing to say
    poll(3.0, 1)  # the first step, at once; the beat is 8, 13, 18, 23, 28, ...
    for t in range(4, 15):
        poll(t + 0.2, t * 10)
    assert shown == [3.0, 8.2, 13.2]
    poll(24.5, 240)  # a slow poll: it misses the beats at 18 and 23 and says the step once
    poll(25.5, 240)
    assert shown[-1] == 24.5  # the next beat is still 28, not 24.5 + 5
    poll(28.2, 240)  # a beat without a new step (paused): nothing new to say
    poll(29.2, 260)  # the step moved: the beat it missed is due
    poll(30.2, 270)
    poll(31.0, 280, ended=True)  # the end: its final step, off the beat
    poll(31.2, 280, ended=True)  # said once
    assert shown == [3.0, 8.2, 13.2, 24.5, 29.2, 31.0]


def test_off_a_terminal_progress_lines_come_at_a_steady_beat(procs, runs_dir, tmp_path):
    """With the default beat (2 s), a run of a few seconds prints several lines, evenly."""
    every = PLAIN_EVERY_S
    profile = paced_profile(tmp_path, max_steps=60)
    env = cli_env(PACE_S="0.12")  # 60 steps: about 7 s of training
    del env["GPU_CONSOLE_PLAIN_EVERY_S"]  # the suite's faster beat: this test wants the default
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                          cwd=tmp_path, env=env)  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in console.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    console.wait(timeout=deadline(120))  # stretched, as every deadline is (tests/README.md)
    reader.join(timeout=deadline(30))
    assert console.returncode == 0, "\n".join(ln for _, ln in lines) + console.stderr.read()
    progress = [(t, int(m[1])) for t, ln in lines if (m := re.match(r"step (\d+)/60 ", ln))]
    steps = events_of(only_run(runs_dir), "step")
    training_s = steps[-1]["t"] - steps[0]["t"]
    assert len(progress) >= max(4, int(training_s / every)), (training_s, lines)
    # The first line follows the first step; the last one is the final step.
    assert progress[0][0] - steps[0]["t"] < 1.0, (progress, steps[0])
    assert progress[-1][1] == 60
    # Up to the end line, a steady beat: lines `every` apart (a slow poll may skip one).
    gaps = [b[0] - a[0] for a, b in zip(progress[:-1], progress[1:-1], strict=False)]
    assert gaps and max(gaps) < 2.5 * every, gaps
    assert every * 0.8 < sorted(gaps)[len(gaps) // 2] < every * 1.25, gaps


@pytest.mark.quick
def test_help_names_every_value(tmp_path):
    """Every command's --help: metavars like RUN and KEY=VALUE, never Typer's <str>, {run}."""
    group = typer.main.get_command(app)
    runner = CliRunner()
    names = ["", *group.commands]
    assert {"run", "status", "ls", "stop", "profiles", "check"} <= set(names)
    for name in names:
        result = runner.invoke(app, [*([name] if name else []), "--help"])
        assert result.exit_code == 0, (name, result.output)
        help_text = result.output
        assert not re.search(r"<[a-z][^>]*>", help_text), (name, help_text)
        assert not re.search(r"\{\w+\}", help_text), (name, help_text)
        assert not re.search(r"\[[a-z_]+\]", help_text.splitlines()[0]), (name, help_text)
    shown = {n: runner.invoke(app, [n, "--help"]).output for n in ("run", "check", "status")}
    assert "--set KEY=VALUE" in shown["run"] and "--runs-dir DIR" in shown["run"]
    assert "run [OPTIONS] [PROFILE]" in shown["run"] and "--resume RUN" in shown["run"]
    assert "--timeout SECONDS" in shown["check"]
    assert "status [OPTIONS] RUN" in shown["status"] and "\n  RUN  " in shown["status"]


def _ended_run(runs_dir: Path, name: str, started: float, ended: float) -> Path:
    run = runs_dir / name
    run.mkdir(parents=True)
    (run / "run.toml").write_text("[train]\nmax_steps = 50\n")
    status = {"state": "finished", "reason": "max_steps reached", "step": 50, "max_steps": 50,
              "loss": 0.25, "started": started, "ended": ended}  # fmt: skip
    (run / "status.json").write_text(json.dumps(status))
    return run


def test_ls_says_when_a_run_started_and_when_it_last_moved(procs, runs_dir):
    now = time.time()
    _ended_run(runs_dir, "old-run", started=now - 3 * 3600, ended=now - 2 * 3600)
    table = procs.cli("ls", "--runs-dir", str(runs_dir)).stdout.splitlines()
    assert table[0].split() == ["run", "state", "step", "loss", "started", "updated"]
    assert re.search(r"old-run +finished +50/50 +0\.2500 +3:00:0\d ago +2:00:0\d ago", table[1])
    (row,) = json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)
    assert row["started"] == pytest.approx(now - 3 * 3600)
    assert row["updated"] == pytest.approx(now - 2 * 3600)
    assert row["age_s"] == pytest.approx(2 * 3600, abs=60)  # since `updated`, as before


@pytest.mark.quick
def test_profiles_never_cut_a_path(tmp_path, monkeypatch):
    here = tmp_path / LONG / LONG
    (here / "profiles").mkdir(parents=True)
    (here / "profiles" / "mine.toml").write_text(
        '[profile]\nname = "mine"\ndescription = "a profile of my own, described at length"\n'
    )
    monkeypatch.chdir(here)
    path = str(here / "profiles" / "mine.toml")
    out = io.StringIO()
    profiles_cmd.main(Console(file=out, width=40))  # off a terminal: natural width
    assert any(path in line for line in out.getvalue().splitlines()), out.getvalue()
    for width in (40, 200):
        tty = Console(force_terminal=True, width=width, record=True, color_system=None)
        profiles_cmd.main(tty)
        text = tty.export_text()
        assert "…" not in text  # folded onto more lines where it does not fit, never cut
        rest = iter("".join(text.split()))
        assert all(c in rest for c in path), text  # its characters all there, in order


TINY_LOSS_TASK = """
from gpu_console.tasks.mlp import MLPTask


class TinyLoss(MLPTask):
    def compute(self, model, batch):
        out = super().compute(model, batch)
        out.loss = out.loss * 1e-5  # a loss near 1e-5, as an LBFGS fit's
        out.metrics["tiny"] = out.loss.detach() * 0.01
        return out
"""

EVERY_STEP_STEPS = 40


@pytest.fixture(scope="module")
def every_step(tmp_path_factory) -> FinishedRun:
    """One headless run read by the tests below: the tiny-loss task, unpaced, a checkpoint at
    every step (all kept), a fast beat (0.1 s); one CPU rank (pinned_env: a module's fixture
    starts before no_gpu_machine pins the hardware)."""
    tmp = tmp_path_factory.mktemp("every_step")
    profile = task_profile(tmp, "tiny_loss", TINY_LOSS_TASK, "TinyLoss", max_steps=EVERY_STEP_STEPS)
    profile.write_text(profile.read_text() + "[checkpoint]\nevery_steps = 1\nkeep_last = 0\n")
    runs = tmp / "runs"
    procs = Procs(runs)
    try:
        result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs), cwd=tmp,
                           env=pinned_env(GPU_CONSOLE_PLAIN_EVERY_S="0.1"))  # fmt: skip
    finally:
        procs.cleanup()
    assert result.returncode == 0, result.stdout + result.stderr
    return FinishedRun(only_run(runs), profile, result)


def test_a_fast_profile_summary_off_a_terminal_has_the_checkpoint_whole(every_step):
    # The module's run of a fast profile (its task the tiny-loss one): its summary's lines.
    result, run = every_step.result, every_step.run
    assert result.returncode == 0, result.stderr
    assert run == only_run(every_step.runs_dir)
    latest = Path("checkpoints") / (run / "checkpoints" / "LATEST").read_text().strip()
    assert latest.name == f"step-{EVERY_STEP_STEPS:08d}"
    assert re.search(rf"^checkpoint: {re.escape(str(latest))} \(step {EVERY_STEP_STEPS}, \w+\)$",
                     result.stdout, re.M), result.stdout  # fmt: skip
    assert f"run dir: {run}" in result.stdout.splitlines()


def test_losses_near_1e_5_print_with_their_digits_everywhere(procs, every_step):
    """Four decimals would print them as 0.0000: headless lines, summary and ls keep four
    significant digits instead; a loss of 2.03 still prints as 2.0300."""
    assert [fmt(v) for v in (2.03, 0.0523, 0.001234, 1.2345e-5, 0.0, None, float("nan"))] == [
        "2.0300", "0.0523", "0.001234", "1.234e-05", "0.0000", "-", "nan"
    ]  # fmt: skip
    result, run = every_step.result, every_step.run
    assert result.returncode == 0, result.stdout + result.stderr
    final = events_of(run, "step")[-1]["loss"]
    assert 1e-6 < final < 1e-4
    shown = fmt(final)
    assert re.fullmatch(r"\d\.\d{3}e-0[56]", shown), shown
    assert f"loss {shown}" in result.stdout  # the progress line
    assert re.search(rf"final loss:? +{re.escape(shown)}", result.stdout), result.stdout
    assert "0.0000" not in result.stdout.split("eval @")[0]  # no loss or metric shown as 0
    table = procs.cli("ls", "--runs-dir", str(every_step.runs_dir)).stdout
    assert shown in table, table


def test_with_a_checkpoint_every_step_lines_come_in_step_order_each_with_its_own_figures(
    every_step,
):
    """Background writes settle after later steps; neither events.jsonl nor the headless
    lines go back a step, and no progress line carries another step's loss. Unpaced, with a
    fast beat: a poll often reads a checkpoint's event together with its step's."""
    steps = EVERY_STEP_STEPS
    result, run = every_step.result, every_step.run
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # The engine writes a checkpoint's event before the next step's (a write still in flight
    # settles before a checkpoint step's log).
    kinds = ("step", "checkpoint")
    written = [(e["step"], kinds.index(e["kind"])) for e in read_events(run) if e["kind"] in kinds]
    assert written == sorted(written), written
    assert {s for s, _ in written} == set(range(1, steps + 1)) and len(set(written)) == 2 * steps, (
        written
    )
    losses = {e["step"]: fmt(e["loss"]) for e in events_of(run, "step")}
    shown: list[tuple[int, int]] = []  # (step, 0: its progress line, 1: a checkpoint's)
    for line in out.splitlines():
        if m := re.match(rf"step (\d+)/{steps}  loss (\S+) ", line):
            step = int(m[1])
            assert m[2] == losses[step], (line, losses)  # its own step's loss
            shown.append((step, 0))
        elif m := re.match(r"checkpoint @ step (\d+) \((interval|end)\): ", line):
            shown.append((int(m[1]), 1))
    assert shown == sorted(shown), out  # in step order; a step's checkpoint after its line
    assert sorted({s for s, what in shown if what == 1}) == list(range(1, steps + 1)), out
    assert shown[-1] == (steps, 1) and (steps, 0) in shown, out


def test_a_checkpoint_settled_after_later_steps_never_moves_the_step_back():
    st = RunState()
    st.apply({"kind": "start", "start_step": 0, "max_steps": 10, "t": 1.0})
    st.apply({"kind": "step", "step": 5, "loss": 0.5, "t": 2.0})
    st.apply({"kind": "checkpoint", "step": 4, "reason": "interval", "t": 3.0})
    assert (st.step, st.loss) == (5, 0.5)
    st.apply({"kind": "checkpoint", "step": 7, "reason": "end", "t": 4.0})
    assert st.step == 7  # the true last step, beyond the last logged one


def test_a_reader_who_leaves_the_pipe_does_not_fail_the_console(procs, runs_dir, tmp_path):
    # `gpu-console run ... --headless | head -1`: the reader leaves after a line. The run goes
    # on (its supervisor is detached), and so does the console, silently, to the run's end:
    # its exit code is the run's, 0, not 1 for a closed pipe.
    profile = fast_profile(tmp_path, max_steps=30)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    assert console.stdout.readline().startswith("run ")
    console.stdout.close()  # the reader's end of the pipe, gone
    err = console.stderr.read()
    assert console.wait(timeout=deadline(120)) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err, err
    run = only_run(runs_dir)
    assert events_of(run, "status")[-1]["state"] == "finished"
    assert json.loads((run / "status.json").read_text())["exit_code"] == 0
