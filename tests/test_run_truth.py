"""status.json is a cache of what the run directory holds (issue 42): a finished run stays
finished whatever happened to its status.json, in every view, and the file is repaired from
the events rather than overwritten with a worse answer; a signal after the run finished
never changes its recorded end."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
from conftest import (
    FinishedRun,
    Procs,
    deadline,
    events_of,
    only_run,
    pinned_env,
    read_status,
    task_profile,
    the_run,
    wait_for,
)

from gpu_console.format import human_duration
from gpu_console.runs import STATUS


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_a_finished_run_with_a_damaged_status_reads_finished_and_is_repaired(
    fast_run, procs, tmp_path, damage
):
    run = fast_run.copy(tmp_path / "runs")
    before = read_status(run)
    assert before["state"] == "finished"
    path = run / STATUS
    if damage == "truncated":
        text = path.read_text()
        path.write_text(text[: len(text) // 2])
    elif damage == "empty":
        path.write_text("")
    else:
        path.unlink()

    status = procs.cli("status", str(run), "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["state"] == "finished"
    (entry,) = json.loads(procs.cli("ls", "--json", "--runs-dir", str(run.parent)).stdout)
    assert (entry["state"], entry["exit_code"]) == ("finished", 0)
    repaired = read_status(run)
    assert repaired["state"] == "finished"
    assert repaired["exit_code"] == 0
    assert repaired["step"] == before["step"]
    assert repaired["repaired"]["from"] == "events.jsonl"
    assert "lost_recorded" not in repaired


# Its close() holds the ranks after the end is recorded, until the test lets them go: the
# moment a scheduler's SIGTERM can reach a job step that has finished its work.
HELD_AT_CLOSE = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class HeldAtClose(MLPTask):
    def close(self):
        go = os.environ["GO_FILE"]
        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    """A run of HeldAtClose (one CPU rank, 3 steps, ``--name "my run"``) through the real CLI,
    whose supervisor and torchrun get a SIGTERM once the engine said finished, while its ranks
    are held at close; read by the tests, copied by one that adds runs beside it."""
    tmp = tmp_path_factory.mktemp("held")
    runs_dir = tmp / "runs"
    profile = task_profile(tmp, "held", HELD_AT_CLOSE, "HeldAtClose", max_steps=3)
    go = tmp / "go"
    procs = Procs(runs_dir)
    try:
        proc = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                           "--name", "my run", cwd=tmp,
                           env=pinned_env(GO_FILE=str(go)))  # fmt: skip
        # the_run: None until run.toml is written (only_run failed on a directory without one).
        run = wait_for(lambda: the_run(runs_dir), what="the run directory")
        wait_for(lambda: [e for e in events_of(run, "status") if e.get("state") == "finished"],
                 what="the engine's finished event")  # fmt: skip
        supervisor = read_status(run)["pids"]["supervisor"]
        os.kill(supervisor, signal.SIGTERM)  # as SLURM signals every process of the job step
        torchrun = read_status(run)["pids"].get("torchrun")
        if torchrun:
            with contextlib.suppress(ProcessLookupError):  # it may have ended already
                os.kill(torchrun, signal.SIGTERM)
        go.write_text("")
        proc.communicate(timeout=deadline(120))
        wait_for(lambda: read_status(run).get("ended"), what="the end")
        yield FinishedRun(run, profile, proc)
    finally:
        procs.cleanup()


def test_a_sigterm_after_the_run_finished_keeps_it_finished(held_run):
    status = read_status(held_run.run)
    assert status.get("ended"), status
    assert status["state"] == "finished", status
    assert status["exit_code"] == 0
    assert held_run.result.returncode == 0


@pytest.mark.parametrize("trouble", ["read-only", "full"])
def test_report_on_a_run_it_cannot_write_is_one_line(fast_run, procs, small_disk, trouble):
    import shutil

    from conftest import _mount

    run = small_disk.path / "runs" / fast_run.run.name
    shutil.copytree(fast_run.run, run, ignore=shutil.ignore_patterns("checkpoints"))
    if trouble == "read-only":
        _mount("-o", "remount,ro", str(small_disk.path))
    else:
        small_disk.fill()
    result = procs.cli("report", str(run))
    # Exit 2 where the report's folder cannot be made (the --out check), 1 where a write fails.
    assert result.returncode in (1, 2), result.stdout + result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    cause = "Read-only file system" if trouble == "read-only" else "no space left on"
    assert str(run) in line and cause in line, line


def test_export_falls_back_as_resume_does_and_says_which(fast_run, procs, tmp_path):
    import shutil

    run = fast_run.copy(tmp_path / "runs")
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step-00000012", ckpts / "step-00000006")  # an older complete one
    (ckpts / "LATEST").unlink()
    out = tmp_path / "weights.pt"
    result = procs.cli("export", str(run), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    note, line = result.stdout.strip().splitlines()
    assert note == (
        "note: checkpoints/LATEST is missing; exporting step-00000012, the newest complete "
        "checkpoint that can be loaded"
    )
    assert "(from " in line and line.endswith("step-00000012)"), line
    # A truncated newest one: the one before it, as --resume would take.
    state = ckpts / "step-00000012" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    result = procs.cli("export", str(run), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step-00000012 cannot be loaded: its state.pt is not a whole torch file" in result.stdout
    assert result.stdout.strip().endswith("step-00000006)"), result.stdout


def test_a_held_run_is_not_pruned_until_released(tmp_path):
    from gpu_console.engine.checkpoint import prune
    from gpu_console.runs import hold_checkpoints

    ckpts = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        (ckpts / f"step-{step:08d}").mkdir(parents=True)
        (ckpts / f"step-{step:08d}" / "meta.json").write_text("{}")
    with hold_checkpoints(tmp_path / "run"):
        prune(ckpts, 1)  # an export reads one: the next checkpoint prunes instead
        assert sorted(p.name for p in ckpts.glob("step-*")) == [
            "step-00000001", "step-00000002", "step-00000003"
        ]  # fmt: skip
    prune(ckpts, 1)
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000003"]


def test_the_name_a_user_gave_finds_the_run(procs, runs_dir, tmp_path, held_run):
    from conftest import fast_profile

    # "my run": the module's held run (launched with --name "my run"), copied here.
    held_run.copy(runs_dir)
    profile = fast_profile(tmp_path, max_steps=2)
    for name in ("my run", "ünïcødé-✓"):
        if name != "my run":
            result = procs.cli("run", str(profile), "--headless", "--name", name, "--runs-dir",
                               str(runs_dir), cwd=tmp_path)  # fmt: skip
            assert result.returncode == 0, result.stdout + result.stderr
        status = procs.cli("status", name, "--json", "--runs-dir", str(runs_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["state"] == "finished"
    # Both are runs of the profile "fast", whatever their names, and --name is no difference.
    listed = procs.cli("ls", "--json", "--profile", "fast", "--runs-dir", str(runs_dir))
    rows = json.loads(listed.stdout)
    assert sorted(r["run_name"] for r in rows) == sorted(["my run", "ünïcødé-✓"])
    assert {r["profile"] for r in rows} == {"fast"}
    diff = procs.cli("diff", *(r["path"] for r in rows), "--json")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert "profile.name" not in [c["key"] for c in json.loads(diff.stdout)["profile"]]
    refused = procs.cli("run", str(profile), "--headless", "--name", "a/b", "--runs-dir",
                        str(runs_dir), cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip() == "gpu-console: --name: a run's name cannot hold '/' (got 'a/b')"
    assert len(list(runs_dir.iterdir())) == 2  # nothing written for the refused one


def test_a_new_run_whose_end_checkpoint_does_not_fit_fails_saying_so(procs, small_disk, tmp_path):
    from conftest import fast_profile

    # About 3.4 MB of weights and Adam moments: no checkpoint fits on the 3 MiB disk.
    profile = fast_profile(tmp_path, max_steps=3, extra="")
    text = profile.read_text().replace("hidden_dim = 64", "hidden_dim = 512")
    profile.write_text(text)
    runs = small_disk.path / "runs"
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs), cwd=tmp_path)
    both = result.stdout + result.stderr
    assert result.returncode == 1, both
    status = read_status(only_run(runs))
    assert status["state"] == "failed", status
    expected = "no checkpoint of the run was kept: checkpoint @ step 3 (end) not written: no space"
    assert status["reason"].startswith(expected), status["reason"]
    assert "there is no earlier checkpoint" in status["reason"]
    assert "Traceback" not in both


def test_a_finished_run_on_a_read_only_disk_reads_finished_in_every_view(
    fast_run, procs, small_disk
):
    import shutil

    from conftest import _mount

    run = small_disk.path / "runs" / fast_run.run.name
    shutil.copytree(fast_run.run, run, ignore=shutil.ignore_patterns("checkpoints"))
    before = read_status(run)
    path = run / STATUS
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # cut in half, then the disk is remounted ro
    _mount("-o", "remount,ro", str(small_disk.path))
    shown = procs.cli("status", str(run))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "finished" in shown.stdout and "lost" not in shown.stdout, shown.stdout
    status = procs.cli("status", str(run), "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    got = json.loads(status.stdout)
    assert (got["state"], got["step"], got["exit_code"]) == ("finished", before["step"], 0)
    (end,) = [e for e in events_of(run, "status") if e.get("state") == "finished"]
    assert got["updated"] == end["t"]  # its end, derived from the events
    assert got["wall_s"] == pytest.approx(end["t"] - got["session_started"])
    listed = procs.cli("ls", "--json", "--runs-dir", str(run.parent))
    (entry,) = json.loads(listed.stdout)
    assert (entry["state"], entry["step"], entry["exit_code"]) == ("finished", before["step"], 0)
    plain = procs.cli("ls", "--runs-dir", str(run.parent))
    assert "finished" in plain.stdout and "lost" not in plain.stdout, plain.stdout
    assert path.read_text() == text[: len(text) // 2]  # nothing written


def test_a_repaired_status_ends_when_the_engine_ended(fast_run, procs, tmp_path):
    run = fast_run.copy(tmp_path / "runs")
    before = read_status(run)
    (end,) = [e for e in events_of(run, "status") if e.get("state") == "finished"]
    path = run / STATUS
    path.write_text("")
    later = before["ended"] + 19 * 60  # emptied 19 minutes after the run ended
    os.utime(path, (later, later))
    status = procs.cli("status", str(run), "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    repaired = read_status(run)
    assert repaired["repaired"]["from"] == "events.jsonl"
    assert repaired["ended"] == end["t"]
    wall_s = end["t"] - repaired["started"]
    assert json.loads(status.stdout)["wall_s"] == pytest.approx(wall_s)
    shown = procs.cli("status", str(run)).stdout
    assert f"wall time: {human_duration(wall_s)}" in " ".join(shown.split()), shown
