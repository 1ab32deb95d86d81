"""A checkpoint request on a step that was just checkpointed is answered with that checkpoint
(real torchrun, 2 CPU ranks): the CLI prints its path and nothing is written a second time."""

from __future__ import annotations

from conftest import events_of, paced_profile, read_status, the_run, wait_for
from conftest import test_env as cli_env

from gpu_console.events import append_control


def _checkpoint_files(run):
    ckpts = run / "checkpoints"
    return {str(p.relative_to(ckpts)): p.stat().st_mtime_ns for p in sorted(ckpts.rglob("*"))}


def test_a_request_on_a_checkpointed_step_gets_that_checkpoint(procs, runs_dir, tmp_path):
    # Every step is checkpointed (an interval of 1): any request lands on a checkpointed step.
    profile = paced_profile(tmp_path, max_steps=1_000_000,
                            extra="[checkpoint]\nevery_steps = 1\nkeep_last = 2\n")  # fmt: skip
    env = cli_env(PACE_S="0.02")
    procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir), env=env,
                cwd=tmp_path)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "checkpoint"), what="a first interval checkpoint")
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    rd = ["--runs-dir", str(runs_dir)]

    # Running: the request is answered with the interval checkpoint of the step it lands on.
    running = procs.cli("checkpoint", run.name, *rd, cwd=tmp_path)
    assert running.returncode == 0, running.stderr
    assert running.stdout.rstrip().endswith(", interval)"), running.stdout
    done = [e for e in events_of(run, "control") if e.get("state") == "done"]
    (ack,) = done
    held = ack["checkpoint"]
    assert held["step"] == ack["step"] and held["reason"] == "interval"
    assert running.stdout.startswith(f"{held['path']} (step {ack['step']}, ")
    assert [c for c in events_of(run, "checkpoint") if c["reason"] != "interval"] == []

    # Paused: the step stays, so a request lands on it for certain; nothing is written.
    append_control(run, "pause")
    wait_for(lambda: read_status(run).get("state") == "paused", what="the run paused")
    (paused_at,) = [e["step"] for e in events_of(run, "control")
                    if e.get("cmd") == "pause" and e.get("state") == "done"]  # fmt: skip
    # The paused step's interval checkpoint may still be being written (asynchronously) when
    # the state says paused; the answers and the files are compared once it is on disk.
    latest = f"step-{paused_at:08d}"
    wait_for(lambda: (run / "checkpoints" / "LATEST").read_text().strip() == latest,
             what=f"LATEST naming {latest}")  # fmt: skip
    before = _checkpoint_files(run)
    for _ in range(2):
        again = procs.cli("checkpoint", run.name, *rd, cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert again.stdout.startswith(f"{run / 'checkpoints' / latest} (step "), again.stdout
    assert _checkpoint_files(run) == before
    assert [c for c in events_of(run, "checkpoint") if c["reason"] != "interval"] == []
