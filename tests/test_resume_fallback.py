"""A resume goes on from a good checkpoint when LATEST is lost or the newest one is damaged.

Runs on 2 CPU ranks. One finished run through the real CLI (30 steps, a checkpoint every 10)
is the reference and the source of each case's copy: its LATEST deleted or naming a missing
step, its newest state.pt truncated (os.truncate) or damaged inside an intact zip. Each
resume says in one line which checkpoint it took instead and why, never a traceback, and goes
on from there bit for bit as the uninterrupted run did. Which checkpoint a resume takes is
the launch's and the engine's: those resumes run on the engine harness (tests/harness.py);
what the CLI says when none can be loaded, and a session that cannot start, through it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import Procs, events_of, fast_profile, only_run, read_status
from harness import launch_notes, run_engine
from headless_text import headless_text

from gpu_console import launch

MAX_STEPS = 30
EVERY = 10


def step_name(step: int) -> str:
    return f"step-{step:08d}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run: checkpoints at steps 10, 20 and 30 (the end), all kept."""
    tmp = tmp_path_factory.mktemp("fallback")
    profile = fast_profile(
        tmp, max_steps=MAX_STEPS, extra=f"[checkpoint]\nevery_steps = {EVERY}\nkeep_last = 0\n"
    )
    procs = Procs(tmp / "ref")
    try:
        result = procs.cli(
            "run", str(profile), "--headless", "--devices", "cpu:2", "--runs-dir", str(tmp / "ref")
        )
        assert result.returncode == 0, result.stdout + result.stderr
        run = only_run(tmp / "ref")
        assert (run / "checkpoints" / "LATEST").read_text().strip() == step_name(MAX_STEPS)
        yield run
    finally:
        procs.cleanup()


def losses(run: Path, since: float = 0.0) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(run, "step") if e["t"] >= since}


def damage(state: Path) -> None:
    """Garbage over the start of the pickle (protocol 2's opcode, after the zip's first local
    header): the zip's directory stays whole, so only loading it tells."""
    data = bytearray(state.read_bytes())
    start = data.index(b"\x80\x02", 30)
    data[start : start + 64] = b"\xff" * 64
    state.write_bytes(bytes(data))


def at_step_20(run: Path) -> Path:
    """The run as if stopped at step 20 (its end checkpoint gone): a resume has steps left."""
    shutil.rmtree(run / "checkpoints" / step_name(MAX_STEPS))
    (run / "checkpoints" / "LATEST").write_text(step_name(20) + "\n")
    return run


def copy_of(reference: Path, runs_dir: Path) -> Path:
    run = runs_dir / reference.name
    shutil.copytree(reference, run)
    return run


def resume(procs: Procs, run: Path, tmp_path: Path):
    result = procs.cli("run", "--resume", str(run), "--headless", "--devices", "cpu:2",
                       cwd=tmp_path)  # fmt: skip
    both = result.stdout + result.stderr
    assert "Traceback" not in both, both
    return result


def resumed(run: Path, tmp_path: Path, monkeypatch) -> tuple[list[str], str]:
    """``run`` resumed on 2 ranks of the engine harness (a rank's exception is raised here):
    the launch's notes (the lines ``gpu-console run`` prints on stderr before it starts the
    run) and the headless console's text of the run."""
    notes = launch_notes(monkeypatch)
    run_engine(tmp_path, None, ranks=2, resume=run, runs_dir=run.parent)
    shown = headless_text(run)
    assert "Traceback" not in "\n".join([*notes, shown]), shown
    return notes, shown


def assert_went_on_from(run: Path, reference: Path, step: int, shown: str) -> None:
    """The resumed session started at ``step`` and matched the reference from there on;
    ``shown``: the headless console's text of the run."""
    second = events_of(run, "start")[-1]
    assert second["start_step"] == step
    assert second["resumed_from"].endswith(step_name(step))
    after = losses(run, second["t"])
    assert sorted(after) == list(range(step + 1, MAX_STEPS + 1))
    expected = losses(reference)
    assert after == {s: expected[s] for s in after}, "resumed losses differ from the reference"
    status = events_of(run, "status")[-1]
    assert status["state"] == "finished" and status["step"] == MAX_STEPS
    assert f"{MAX_STEPS}/{MAX_STEPS}" in shown, shown  # the summary's steps


@pytest.mark.parametrize(
    "latest, why",
    [
        (None, "checkpoints/LATEST is missing"),
        (
            "step-00000999\n",
            "checkpoints/LATEST names 'step-00000999', which is not a complete checkpoint",
        ),
    ],
    ids=["deleted", "names-a-missing-step"],
)
def test_a_lost_latest_resumes_from_the_newest_complete_checkpoint(
    reference, runs_dir, tmp_path, monkeypatch, latest, why
):
    run = copy_of(reference, runs_dir)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / step_name(MAX_STEPS))  # else the newest is already at max_steps
    (ckpts / "LATEST").unlink()
    if latest is not None:
        (ckpts / "LATEST").write_text(latest)

    notes, shown = resumed(run, tmp_path, monkeypatch)
    said = [line for line in notes if "resuming from" in line]
    assert said == [
        f"--resume: {run.name}: {why}; resuming from {step_name(20)}, the newest complete "
        "checkpoint that can be loaded"
    ], notes
    assert_went_on_from(run, reference, 20, shown)
    logged = [e["message"] for e in events_of(run, "log") if "resuming from" in e["message"]]
    assert logged and why in logged[-1], "the run's own log says it too"


def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(
    reference, runs_dir, tmp_path, monkeypatch
):
    run = copy_of(reference, runs_dir)
    state = run / "checkpoints" / step_name(MAX_STEPS) / "state.pt"
    os.truncate(state, state.stat().st_size // 2)  # what a full disk or a cut copy leaves

    notes, shown = resumed(run, tmp_path, monkeypatch)
    said = [line for line in notes if "cannot be loaded" in line]
    assert said == [
        f"--resume: {run.name}: {step_name(MAX_STEPS)} cannot be loaded: its state.pt is not a "
        f"whole torch file (truncated?); resuming from {step_name(20)}, the newest complete "
        "checkpoint that can be loaded"
    ], notes
    assert_went_on_from(run, reference, 20, shown)


def test_a_checkpoint_the_ranks_cannot_load_gives_way_to_the_previous_one(
    reference, runs_dir, tmp_path, monkeypatch
):
    """Damaged inside an intact zip (the launch's cheap check passes): the ranks' load fails,
    every rank agrees on the one before, and it is said in one warning line."""
    run = at_step_20(copy_of(reference, runs_dir))
    damage(run / "checkpoints" / step_name(20) / "state.pt")

    _, shown = resumed(run, tmp_path, monkeypatch)
    warned = [e["message"] for e in events_of(run, "log") if e.get("level") == "warning"]
    fallback = [m for m in warned if m.startswith(f"checkpoint {step_name(20)} cannot")]
    assert fallback == [
        f"checkpoint {step_name(20)} cannot be loaded on rank 0 (UnpicklingError: Unsupported "
        f"operand 255); resuming from {step_name(10)}, the previous complete checkpoint"
    ], warned
    assert f"warning: {fallback[0]}" in shown, shown
    assert_went_on_from(run, reference, 10, shown)


def test_a_run_whose_checkpoints_all_fail_to_load_fails_in_one_line(
    reference, procs, runs_dir, tmp_path
):
    run = at_step_20(copy_of(reference, runs_dir))
    for step in (10, 20):
        damage(run / "checkpoints" / step_name(step) / "state.pt")

    result = resume(procs, run, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    status = read_status(run)
    assert status["state"] == "failed"
    assert status["reason"].startswith("ResumeFailed: no checkpoint of ")
    assert len(status["reason"].splitlines()) == 1
    # It failed before its first step: the run stays at the step it resumed from, not 0.
    assert events_of(run, "status")[-1]["step"] == 20
    assert status["step"] == 20, status
    (row,) = json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)
    shown = json.loads(procs.cli("status", str(run), "--json").stdout)
    assert (row["state"], row["step"]) == (shown["state"], shown["step"]) == ("failed", 20)


def test_no_loadable_checkpoint_is_refused_at_launch_in_one_line(
    reference, procs, runs_dir, tmp_path
):
    run = copy_of(reference, runs_dir)
    for step in (10, 20, 30):
        state = run / "checkpoints" / step_name(step) / "state.pt"
        os.truncate(state, 100)
    before = sorted(p.name for p in run.iterdir())

    result = resume(procs, run, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"gpu-console: --resume: {run}: no complete checkpoint can be loaded: "
        f"{step_name(30)} its state.pt is not a whole torch file (truncated?) (and 2 older)"
    ]
    assert sorted(p.name for p in run.iterdir()) == before, "nothing written"


def test_a_session_that_cannot_start_leaves_the_run_as_it_ended(reference, tmp_path, monkeypatch):
    """The fork of the new supervisor fails (EAGAIN: no process to be had): run.toml,
    status.json and meta.json are as the last session left them, the lock is free, one line."""
    import errno

    from gpu_console import runs, session_lock

    run = at_step_20(copy_of(reference, tmp_path / "runs"))
    kept = {f: (run / f).read_bytes() for f in ("run.toml", "status.json", "meta.json")}
    profile, placement, resume_from = launch.prepare(
        None, resume=str(run), runs_dir=tmp_path / "runs", devices="cpu:2"
    )

    def no_fork(*args, **kwargs):
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(launch, "spawn_supervisor", no_fork)
    with pytest.raises(runs.RunDirError, match="cannot continue the run"):
        launch.continue_run(profile, placement, run, resume_from)
    assert {f: (run / f).read_bytes() for f in kept} == kept
    assert session_lock.is_held(run) is False
