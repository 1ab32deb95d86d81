"""``train.max_epochs`` and ``train.eval_every_epochs``: lengths in epochs, turned into steps
at launch for the run's ranks and batch (batching.epochs_to_steps), with a note saying what
they became; run.toml then holds the steps. Given beside the same length in steps, the one
given last wins (``--set`` over the file); both in one place is refused."""

from __future__ import annotations

import pytest
from conftest import events_of, set_args, task_profile, write_profile
from harness import run_engine
from headless_text import headless_text

from gpu_console import launch
from gpu_console.profile import ProfileError, load_profile, parse_toml


def test_both_lengths_in_one_place_are_refused(tmp_path):
    with pytest.raises(ProfileError) as info:
        load_profile("quickstart", ["train.max_epochs=2", "train.max_steps=50"])
    assert "--set: train.max_epochs: give train.max_epochs or train.max_steps, not both" in str(
        info.value
    )
    both = write_profile(tmp_path / "both.toml", "[train]\nmax_epochs = 2\nmax_steps = 50\n")
    with pytest.raises(ProfileError, match=r"both.toml: train.max_epochs: give .* not both"):
        load_profile(str(both))


def test_the_length_given_last_wins(tmp_path):
    # quickstart.toml says max_steps = 300: --set train.max_epochs takes its place.
    p = load_profile("quickstart", ["train.max_epochs=2"])
    assert p.train.max_epochs == 2 and not p.notes
    # A profile in epochs, shortened with --set train.max_steps (the usual quick try).
    epochs = write_profile(tmp_path / "e.toml", "[train]\nmax_epochs = 4\neval_every_epochs = 1\n")
    p = load_profile(str(epochs), ["train.max_steps=10", "train.eval_every=5"])
    assert (p.train.max_epochs, p.train.max_steps) == (0, 10)
    assert (p.train.eval_every_epochs, p.train.eval_every) == (0, 5)
    assert p.notes[0] == "--set train.max_steps=10: the profile's train.max_epochs = 4 is left out"


@pytest.mark.parametrize(
    ("sets", "steps", "every"),
    [
        # 1000 samples over 2 ranks, 32 per batch: (1000 // 2) // 32 = 15 batches per epoch.
        ([], 45, 15),
        # The ragged tail kept: ceil(ceil(1000 / 2) / 32) = 16.
        (["data.drop_last=false"], 48, 16),
        # 2 micro-batches per step: 7.5 steps per epoch, the last epoch trained to its end.
        (["train.grad_accum=2"], 23, 7),
    ],
)
def test_epochs_become_steps_for_the_ranks_and_the_batch(tmp_path, sets, steps, every):
    base = ["task.train_samples=1000", "data.batch_size=32", "train.warmup_steps=0"]
    profile, _, _ = launch.prepare(
        "quickstart", devices="cpu:2", runs_dir=tmp_path / "runs",
        overrides=[*base, *sets, "train.max_epochs=3", "train.eval_every_epochs=1"],
    )  # fmt: skip
    t = profile.train
    assert (t.max_steps, t.max_epochs, t.eval_every, t.eval_every_epochs) == (steps, 0, every, 0)
    assert profile.notes[0].startswith(f"train.max_epochs = 3: {steps} steps; ")
    assert "1,000 samples over 2 ranks × 32 per batch" in profile.notes[0]
    assert profile.notes[1].startswith(f"train.eval_every_epochs = 1: an eval every {every} steps")


def test_epochs_need_a_batch_size_known_before_launch(tmp_path):
    with pytest.raises(launch.LaunchError) as info:
        launch.prepare("quickstart", devices="cpu:2", runs_dir=tmp_path / "runs",
                       overrides=["train.max_epochs=3", "data.batch_size=auto"])  # fmt: skip
    assert str(info.value) == (
        "--set: train.max_epochs: needs a fixed data.batch_size (auto is searched after launch, "
        "so an epoch's steps are not known before) (got 3)"
    )
    assert not (tmp_path / "runs").exists()


def test_a_user_task_in_epochs_trains_them_and_evaluates_at_each_epochs_end(procs, tmp_path):
    # A user task's size is found by the launch's data check: 70 samples over 2 ranks, 8 per
    # batch: 4 steps per epoch. The plan (the console's) says so; the run (the harness's
    # launch and ranks) trains and evaluates so.
    source = "from gpu_console.tasks.mlp import MLPTask\n\n\nclass Mine(MLPTask):\n    pass\n"
    profile = task_profile(tmp_path, "mine", source, "Mine", ranks=2)
    sets = ["task.train_samples=70", "data.batch_size=8", "train.max_epochs=2",
            "train.eval_every_epochs=1", "train.warmup_steps=0"]  # fmt: skip
    plan = procs.cli("run", str(profile), "--dry-run", *set_args(*sets), cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    rows = {line[:12].strip(): line[12:] for line in plan.stdout.splitlines()}
    assert rows["steps"] == "8 (2 epochs)", plan.stdout
    assert rows["eval"] == "every 4 steps and at the end", plan.stdout
    assert "train.max_epochs = 2: 8 steps; 4 steps per epoch" in plan.stderr, plan.stderr
    run = run_engine(tmp_path, profile, *sets, ranks=2)
    assert [e["step"] for e in events_of(run, "step")][-1] == 8
    assert [e["step"] for e in events_of(run, "eval")] == [4, 8]
    train = parse_toml(run / "run.toml")["train"]
    assert (train["max_steps"], train["max_epochs"], train["eval_every"]) == (8, 0, 4)


PACE_S = 0.05


def test_each_epochs_end_is_an_event_with_its_wall_time(tmp_path):
    """256 samples, 2 ranks of 32: an epoch is 4 steps; each end is an ``epoch`` event with
    the epoch's wall time (paced steps: at least 4 paces), its steps, and whole."""
    from conftest import paced_profile

    profile = paced_profile(tmp_path, max_steps=12, ranks=2)
    sets = ("task.train_samples=256", "data.batch_size=32", "train.eval_every=0")
    run = run_engine(tmp_path, profile, *sets, ranks=2, env={"PACE_S": str(PACE_S)})
    (start,) = events_of(run, "start")
    epochs = events_of(run, "epoch")
    assert [(e["epoch"], e["step"], e["steps"], e["whole"]) for e in epochs] == [
        (0, 4, 4, True), (1, 8, 4, True), (2, 12, 4, True),
    ]  # fmt: skip
    assert all(e["seconds"] >= 4 * PACE_S for e in epochs), epochs
    # Timed from the loop's first step: inside the span from the start event to the last
    # (the events' times are rounded to the millisecond, and the loop starts right after).
    assert sum(e["seconds"] for e in epochs) <= epochs[-1]["t"] - start["t"] + 0.002
    mean = sum(e["seconds"] for e in epochs) / 3
    assert f"time per epoch: {mean:.3g} s (mean of 3 whole epochs)" in headless_text(run)

    # Resumed mid-epoch (step 6 of epoch 1's steps 5-8): the session's part of epoch 1 is
    # not whole; epoch 2 is.
    cut = run_engine(tmp_path, profile, *sets, "train.max_steps=6", ranks=2,
                     runs_dir=tmp_path / "cut")  # fmt: skip
    run_engine(tmp_path, None, "train.max_steps=12", ranks=2, resume=cut,
               runs_dir=tmp_path / "cut")  # fmt: skip
    got = [(e["epoch"], e["step"], e["steps"], e["whole"]) for e in events_of(cut, "epoch")]
    assert got == [(0, 4, 4, True), (1, 8, 2, False), (2, 12, 4, True)]
    assert "(mean of 2 whole epochs)" in headless_text(cut)  # epoch 1's part is left out
