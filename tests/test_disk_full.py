"""A full disk, a real one: a small tmpfs mounted for the test (root only; skipped, saying
so, where it cannot be mounted). Injected OSErrors never met torch's own RuntimeError."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import conftest
import pytest
import torch
from conftest import Procs, deadline, events_of, only_run, read_status, run_dirs, wait_for
from harness import run_engine

from gpu_console import diskfull, events
from gpu_console.engine import checkpoint
from gpu_console.engine.reporter import Reporter
from gpu_console.events import EventWriter
from gpu_console.supervisor import write_status_on_full_disk

# -- classification ---------------------------------------------------------------------------


@pytest.mark.parametrize("to", ["path", "file"])
def test_torch_saves_runtime_error_into_a_full_tmpfs_is_a_full_disk(small_disk, to):
    target = small_disk.path / "state.pt"
    big = {"w": torch.randn(1 << 20)}  # 4 MiB, on a 3 MiB disk
    with pytest.raises(RuntimeError) as caught:  # torch's zip writer: no errno of its own
        if to == "path":
            torch.save(big, target)
        else:
            with open(target, "wb") as f:
                torch.save(big, f)
    assert not isinstance(caught.value, OSError)
    full = diskfull.classify(caught.value, small_disk.path)
    assert isinstance(full, diskfull.DiskFull) and full.errno == errno.ENOSPC
    assert re.fullmatch(rf"no space left on {small_disk.path} \([\d.]+ \w+ free\)", str(full))


def test_other_failures_are_not_a_full_disk(small_disk):
    where = small_disk.path  # 3 MiB free: room to spare for a write of unknown size
    small_disk.resize("64m")
    assert diskfull.classify(RuntimeError("unexpected pos 45184 vs 45136"), where) is None
    assert diskfull.classify(OSError(errno.EACCES, "Permission denied"), where) is None
    assert diskfull.classify(ValueError("no"), where) is None
    # A write that needed more than is free could not have fit, whatever it said.
    assert diskfull.classify(RuntimeError("unexpected pos"), where, need=1 << 30) is not None
    quota = diskfull.classify(OSError(errno.EDQUOT, "Disk quota exceeded"), where)
    assert quota is not None and str(quota).startswith(f"disk quota exceeded on {where} (")


def test_a_checkpoint_that_does_not_fit_leaves_latest_and_no_half_files(small_disk):
    ckpts = small_disk.path / "checkpoints"
    ranks = [{"rng": checkpoint.capture_rng(torch.device("cpu"))}]
    checkpoint._write(ckpts, 1, "interval", {"step": 1, "w": torch.zeros(1000)}, ranks, 0)
    with pytest.raises(diskfull.DiskFull) as caught:
        checkpoint._write(ckpts, 2, "interval", {"step": 2, "w": torch.randn(1 << 20)}, ranks, 0)
    assert isinstance(caught.value.__cause__, RuntimeError)  # what torch raised
    assert caught.value.free > 2 << 20  # measured once the half-written file is gone
    assert (ckpts / "LATEST").read_text() == "step-00000001\n"
    assert sorted(p.name for p in ckpts.iterdir()) == ["LATEST", "step-00000001"]
    assert checkpoint.load(ckpts / "step-00000001")["step"] == 1


# -- events and status.json ---------------------------------------------------------------------


def test_events_on_a_full_disk_wait_and_never_tear_a_line(small_disk):
    path = small_disk.path / "events.jsonl"
    w = EventWriter(path)
    w.emit("status", state="running")
    size = path.stat().st_size  # its page has room for a few KiB more: a short write
    ballast = small_disk.fill()
    assert diskfull.free_bytes(small_disk.path) == 0
    w.emit("log", level="info", message="x" * 20_000)  # fills the page's rest, then ENOSPC
    w.emit("step", step=1, loss=0.5)
    assert path.stat().st_size == size  # the half line was cut back off
    assert w.pending == 2 and w.failing is not None
    assert str(w.failing[1]).startswith(f"no space left on {small_disk.path} (")
    ballast.unlink()
    w.emit("step", step=2, loss=0.25)  # the waiting ones first, in order
    assert w.pending == 0 and w.failing is None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["kind"] for e in lines] == ["status", "log", "step", "step"]
    w.close()


def test_a_long_full_disk_loses_old_step_events_first_and_says_so(small_disk, monkeypatch):
    monkeypatch.setattr(events, "MAX_PENDING", 3)
    out = Reporter(small_disk.path, active=True)
    out.status("running")
    ballast = small_disk.fill()
    for step in range(1, 6):  # each larger than its page's rest: no room at all
        out.event("step", step=step, pad="x" * 5000)
        if step == 2:
            out.status("paused", reason="requested")  # the run's story: never given up
    out.log("error", "checkpoint @ step 5 (interval) not written")
    ballast.unlink()
    out.event("step", step=6)
    out.close()
    lines = [json.loads(line) for line in (small_disk.path / "events.jsonl").open()]
    assert [(e["kind"], e.get("step"), e.get("level")) for e in lines] == [
        ("status", None, None),
        ("status", None, None),  # small: it fit once it reached the queue's head
        ("step", 4, None),  # 1 to 3 gave way (3 kept at most), never the status
        ("step", 5, None),
        ("log", None, "error"),
        ("step", 6, None),
        ("log", None, "warning"),
    ]
    assert lines[-1]["message"] == "3 events were lost while the disk was full (3 step)"


def test_a_full_queue_never_gives_up_the_runs_story(small_disk, monkeypatch):
    """Past the bound, progress, step and log events go; checkpoint, status and eval events
    are kept however many wait (they are few)."""
    monkeypatch.setattr(events, "MAX_PENDING", 2)
    out = Reporter(small_disk.path, active=True)
    ballast = small_disk.fill()
    for step in (1, 2, 3):  # each larger than its page's rest: no room at all
        out.event("checkpoint", step=step, pad="x" * 5000)
        out.event("progress", phase="eval", step=step, pad="x" * 5000)
    ballast.unlink()
    out.close()
    lines = [json.loads(line) for line in (small_disk.path / "events.jsonl").open()]
    kinds = [(e["kind"], e.get("step")) for e in lines]
    assert kinds[:3] == [("checkpoint", 1), ("checkpoint", 2), ("checkpoint", 3)]
    assert ("progress", 1) not in kinds and ("progress", 2) not in kinds


def test_the_final_status_lands_on_a_full_disk_through_the_reserve(small_disk):
    run = small_disk.path
    write_status_on_full_disk(run, {"state": "running"})
    assert diskfull.make_reserve(run, "supervisor")
    small_disk.fill()
    status = {"state": "running", "step": 30, "pad": "x" * 8000}  # more than a page
    assert write_status_on_full_disk(run, status) is False  # late, not fatal
    assert json.loads((run / "status.json").read_text()) == {"state": "running"}
    final = {"state": "finished", "step": 200, "pad": "x" * 8000}
    assert write_status_on_full_disk(run, final, last=True) is True
    written = json.loads((run / "status.json").read_text())
    assert written["state"] == "finished" and written["step"] == 200
    assert re.fullmatch(
        rf"status.json not written at [\d:]+: no space left on {run} \(0 B free\)",
        written["disk_full"],
    )
    assert not diskfull.reserve_path(run, "supervisor").exists()
    assert [p.name for p in run.iterdir() if p.name.endswith(".tmp")] == []


# -- the run, through the real CLI --------------------------------------------------------------

# The command, shorter: quickstart's checkpoints are 925 KiB, so a 3 MiB disk holds
# two or three of them (keep_last = 0 prunes none), and every one after fails for want of space.
FULL_RUN = (
    "--devices", "cpu:2",
    "--set", "train.max_steps=60",
    "--set", "train.log_every=1",
    "--set", "checkpoint.every_steps=10",
    "--set", "checkpoint.keep_last=0",
)  # fmt: skip


def _losses(run: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(run, "step")}  # a resumed step: the last


def _ls_row(procs: Procs, runs: Path) -> dict:
    result = procs.cli("ls", "--json", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    return row


def test_a_run_on_a_full_disk_goes_on_and_resumes_exactly(small_disk, tmp_path):
    runs = small_disk.path / "runs"
    procs = Procs(runs)
    try:
        full = procs.cli("run", "quickstart", "--headless", "--runs-dir", str(runs), *FULL_RUN)
        run = only_run(runs)
        assert full.returncode == 0, full.stdout + full.stderr
        status = read_status(run)
        assert (status["state"], status["step"], status["exit_code"]) == ("finished", 60, 0)
        row = _ls_row(procs, runs)
        assert (row["state"], row["step"], row["exit_code"]) == ("finished", 60, 0)

        failed = [e for e in events_of(run, "log") if e.get("checkpoint_failed")]
        assert failed, full.stdout
        assert re.fullmatch(
            r"checkpoint @ step \d+ \(\w+\) not written: no space left on "
            rf"{small_disk.path} \([\d.]+ \w+ free\); LATEST stays at step-\d{{8}}",
            failed[0]["message"],
        ), failed[0]["message"]

        ckpts = run / "checkpoints"
        latest = (ckpts / "LATEST").read_text().strip()
        complete = sorted(p.name for p in ckpts.glob("step-*") if (p / "meta.json").is_file())
        assert latest == complete[-1] == failed[-1]["checkpoint_failed"]["latest"]
        resumed_from = checkpoint.load(ckpts / latest)["step"]
        assert 0 < resumed_from < 60
        leftovers = [p.name for p in run.rglob("*") if ".tmp" in p.name]
        assert leftovers == [], leftovers

        # Without room, a resume is refused before it writes anything.
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        refused = procs.cli(
            "run", "quickstart", "--headless", "--runs-dir", str(runs),
            "--resume", str(run), *FULL_RUN,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stdout + refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert re.search(rf"cannot continue the run: no space left on {small_disk.path} \(", line)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

        # Room again: the resume continues from LATEST as if the disk had never filled up.
        small_disk.resize("64m")
        again = procs.cli(
            "run", "quickstart", "--headless", "--runs-dir", str(runs),
            "--resume", str(run), *FULL_RUN,
        )  # fmt: skip
        assert again.returncode == 0, again.stdout + again.stderr
        assert read_status(run)["state"] == "finished"
        assert (ckpts / "LATEST").read_text().strip() == "step-00000060"
        # The uninterrupted run from the engine harness (torchrun's ranks compute the same).
        sets = [s for s in FULL_RUN[2:] if s != "--set"]
        expected = _losses(run_engine(tmp_path, "quickstart", *sets, ranks=2))
        got = _losses(run)
        after = [s for s in range(resumed_from + 1, 61)]
        assert [got[s] for s in after] == [expected[s] for s in after]  # bit for bit
    finally:
        procs.cleanup()


def test_a_run_whose_events_cannot_be_written_ends_failed_in_one_line(small_disk):
    # The disk fills up for good: no event gets out, so the run stops, every rank at once,
    # exit 1, and the reason lands in events.jsonl and status.json through the reserves.
    runs = small_disk.path / "runs"
    procs = Procs(runs)
    try:
        console = procs.start(
            "run", "quickstart", "--headless", "--runs-dir", str(runs), "--devices", "cpu:2",
            "--set", "train.max_steps=1000000", "--set", "checkpoint.every_steps=0",
            env=conftest.test_env(GPU_CONSOLE_EVENTS_GIVE_UP_S="3"),
        )  # fmt: skip
        run = wait_for(lambda: run_dirs(runs) and only_run(runs), what="the run directory")
        wait_for(lambda: len(events_of(run, "step")) >= 2, what="training")
        small_disk.fill()
        out, err = console.communicate(timeout=deadline(120))
        assert console.returncode == 1, out + err
        reason = rf"events.jsonl not written for \d+ s: no space left on {small_disk.path} \("
        assert re.search(rf"^state: failed \({reason}.*\)$", out, re.M), out
        status = read_status(run)
        row = _ls_row(procs, runs)
        for view in (status, row):
            assert (view["state"], view["step"], view["exit_code"]) == (
                "failed",
                events_of(run, "status")[-1]["step"],
                1,
            ), view
            assert re.match(reason, view["reason"]) and "\n" not in view["reason"]
    finally:
        procs.cleanup()


def test_a_new_launch_on_a_full_disk_is_refused_before_anything_is_written(small_disk, procs):
    """A new run gets the check a resume gets (diskfull.SESSION_ROOM free on the runs
    directory's file system): one line, exit 2, no runs directory made. A dry run makes every
    launch check, so it shows the refusal without training anything; with the room back, the
    same command plans the run."""
    runs = small_disk.path / "runs"
    ballast = small_disk.fill()
    args = ("run", "quickstart", "--dry-run", "--no-step", "--runs-dir", str(runs))
    done = procs.cli(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gpu-console: {runs}: cannot start a run: no space left on ")
    assert line.endswith("free); free some first")
    assert not runs.exists()
    ballast.unlink()
    again = procs.cli(*args)
    assert again.returncode == 0, again.stderr
    assert "would be created" in again.stdout and not runs.exists()
