"""``train.max_steps = 0``: a run with no end, trained until it is stopped. No ETA, no end
checkpoint or eval, ``N/∞`` where a length would show; its schedule needs a length of its own
(``lr_decay_steps``) or none (``constant``). A stopped one resumes and goes on."""

from __future__ import annotations

import pytest
from conftest import deadline, events_of, fast_profile, read_status, the_run, wait_for

from gpu_console.events import append_control
from gpu_console.format import steps_text
from gpu_console.profile import ProfileError, load_profile

ENDLESS = ["--set", "train.max_steps=0", "--set", "train.schedule=constant", "--set",
           "checkpoint.every_steps=20"]  # fmt: skip


def test_a_run_without_end_needs_a_schedule_that_has_a_length_of_its_own():
    with pytest.raises(ProfileError) as info:
        load_profile("quickstart", ["train.max_steps=0"])
    assert (
        "--set: train.max_steps: 0 (until stopped) needs a decay of its own length "
        "(train.lr_decay_steps > 0) or train.schedule = 'constant' (got schedule 'cosine')"
    ) in str(info.value)
    assert load_profile("quickstart", ["train.max_steps=0", "train.schedule=constant"])
    p = load_profile("quickstart", ["train.max_steps=0", "train.lr_decay_steps=500"])
    assert p.train.max_steps == 0 and p.train.warmup_steps > 0  # no clamp against 0 steps


def test_the_length_shows_as_unknown_endless_or_steps():
    assert steps_text(5, None) == "5/-"
    assert steps_text(5, 0) == "5/∞"
    assert steps_text(1234, 5000, commas=True) == "1,234/5,000"


def test_the_plan_says_until_stopped(procs, tmp_path):
    plan = procs.cli("run", "quickstart", "--dry-run", "--devices", "cpu:2", *ENDLESS,
                     "--runs-dir", str(tmp_path / "runs"))  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr
    rows = {line[:12].strip(): line[12:] for line in plan.stdout.splitlines()}
    assert rows["steps"] == "until stopped (train.max_steps = 0)"
    assert rows["eval"] == "every 100 steps", "no end to evaluate at"
    assert "at the end" not in rows["checkpoint"]


def test_a_run_until_stopped_trains_until_stopped_and_resumes(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=0)
    args = ["--headless", "--runs-dir", str(runs_dir), *ENDLESS]
    console = procs.start("run", str(profile), *args)
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    # Past any length a default would give a fast run, and past the profile's log steps.
    wait_for(lambda: events_of(run, "step") and events_of(run, "step")[-1]["step"] >= 45,
             what="45 steps")  # fmt: skip
    assert events_of(run, "start")[0]["max_steps"] == 0
    listed = procs.cli("ls", "--runs-dir", str(runs_dir)).stdout
    assert "/∞" in listed, listed
    append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    stopped = read_status(run)
    assert stopped["state"] == "stopped"
    reasons = [c["reason"] for c in events_of(run, "checkpoint")]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {"interval"}, reasons  # no "end"
    assert [c["step"] for c in events_of(run, "checkpoint")][:2] == [20, 40]
    assert f"steps: {stopped['step']}/∞" in out.replace("  ", " "), out

    again = procs.start("run", "--resume", str(run), *args)
    wait_for(lambda: events_of(run, "step")[-1]["step"] > stopped["step"] + 5,
             what="steps after the resume")  # fmt: skip
    append_control(run, "stop")
    out, err = again.communicate(timeout=deadline(120))
    assert again.returncode == 0, out + err
    assert read_status(run)["step"] > stopped["step"]
