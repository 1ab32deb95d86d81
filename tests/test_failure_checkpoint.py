"""A run is never lost to code outside the update (issue 26): an eval that raises after an
update leaves a ``failure`` checkpoint of that step, a resume after the fix goes on exactly,
and ``--dry-run`` finds the bug in seconds, writing nothing. The runs on the engine harness
(tests/harness.py; 2 CPU ranks where the ranks must agree), the dry runs through the CLI.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import events_of, only_run, task_profile
from harness import RemoteTraceback, run_engine
from headless_text import headless_text

from gpu_console.engine.failure_checkpoint import AfterUpdateFailed

# The eval breaks while the file ``broken`` lies beside the task (the test "fixes" the task by
# removing it): on every rank, or with BREAK_RANK=r on rank r only. BREAK_TRAIN_AT=n breaks
# step n's compute instead (inside the update).
EVAL_BROKEN = """
import os
from pathlib import Path

from gpu_console.tasks.mlp import MLPTask

BROKEN = Path(__file__).with_name("broken")
RANK = os.environ.get("RANK", "0")  # the dry run has no ranks: rank 0's view


class Broken(MLPTask):
    def build_datasets(self):
        train, held_out = super().build_datasets()
        return train, {"val": held_out}

    def compute(self, model, batch):
        if model.training:
            if self.ctx.step + 1 == int(os.environ.get("BREAK_TRAIN_AT", "0")):
                raise RuntimeError("the update broke")
        elif BROKEN.exists() and os.environ.get("BREAK_RANK", RANK) == RANK:
            raise KeyError("x")
        return super().compute(model, batch)
"""


def broken_profile(tmp_path: Path, ranks: int = 1) -> Path:
    profile = task_profile(tmp_path, "eval_broken", EVAL_BROKEN, "Broken", max_steps=8, ranks=ranks)
    text = profile.read_text().replace("log_every = 1\n", "log_every = 1\neval_every = 4\n")
    profile.write_text(text.replace("[hardware]", "[checkpoint]\nevery_steps = 4\n[hardware]"))
    return profile


def losses(run: Path) -> dict[int, float]:
    """Each step's loss, the last session's where a step was logged twice."""
    return {e["step"]: e["loss"] for e in events_of(run, "step")}


def checkpoints(run: Path) -> dict[str, str]:
    """Each complete checkpoint's reason, by its directory name."""
    found = {}
    for meta in sorted((run / "checkpoints").glob("step-*/meta.json")):
        found[meta.parent.name] = json.loads(meta.read_text())["reason"]
    return found


def test_an_eval_failure_keeps_the_step_and_a_resume_goes_on_exactly(runs_dir, tmp_path):
    profile = broken_profile(tmp_path, ranks=2)
    (tmp_path / "broken").write_text("")
    # Every rank fails in the eval; the run fails with what its ranks raised (both the same).
    with pytest.raises(AfterUpdateFailed) as failed:
        run_engine(tmp_path, profile, ranks=2, runs_dir=runs_dir)
    run = only_run(runs_dir)
    reason = str(failed.value)
    assert "eval 'val' failed: KeyError: 'x'" in reason, reason
    assert "checkpoint step-00000004 (failure)" in reason, reason
    # The interval checkpoint of step 4 comes after its eval: the failure's is the only one.
    assert checkpoints(run) == {"step-00000004": "failure"}
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000004"
    said = [e["message"] for e in events_of(run, "log") if "(failure) written" in e["message"]]
    assert len(said) == 1 and said[0].startswith("checkpoint @ step 4 (failure) written: "), said
    assert "checkpoint @ step 4 (failure) written" in headless_text(run)  # the console's line
    assert sorted(losses(run)) == [1, 2, 3, 4]

    (tmp_path / "broken").unlink()  # the fix
    # Resumed from a copy in a runs directory of its own: the harness keeps each rank's
    # result beside the run (runs/.harness-<run>/), and the failed session's would be read
    # again as the resumed session's.
    run = Path(shutil.copytree(run, tmp_path / "resumed" / run.name, symlinks=True))
    run_engine(tmp_path, None, ranks=2, resume=run, runs_dir=run.parent)
    assert events_of(run, "status")[-1]["state"] == "finished"

    # The uninterrupted run.
    expected = losses(run_engine(tmp_path, profile, ranks=2, runs_dir=tmp_path / "whole"))
    assert sorted(expected) == list(range(1, 9))
    assert losses(run) == expected  # bit for bit: the same floats


def test_a_failure_inside_the_update_writes_no_checkpoint(runs_dir, tmp_path):
    # The engine harness (tests/harness.py): the rank's exception reaches the test as itself.
    profile = broken_profile(tmp_path)
    with pytest.raises(RuntimeError, match="the update broke"):
        run_engine(tmp_path, profile, runs_dir=runs_dir, env={"BREAK_TRAIN_AT": "5"})
    run = only_run(runs_dir)
    ended = events_of(run, "status")[-1]
    assert ended["state"] == "failed" and "the update broke" in ended["reason"], ended
    # Step 4's interval checkpoint only: the state of step 5's update may be half made. The
    # interval one, written in the background while step 5 ran, is complete all the same.
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert checkpoints(run) == {"step-00000004": "interval"}
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000004"


def test_an_eval_failure_on_one_rank_ends_the_run_without_a_checkpoint(runs_dir, tmp_path):
    profile = broken_profile(tmp_path, ranks=2)
    (tmp_path / "broken").write_text("")
    # Rank 1 fails alone; rank 0 waits in the eval's collective. No agreement: no
    # checkpoint, and no hang (rank 1 ends after the agreement's wait, and its peer with it).
    with pytest.raises(AfterUpdateFailed) as failed:
        run_engine(tmp_path, profile, ranks=2, runs_dir=runs_dir, env={"BREAK_RANK": "1"})
    run = only_run(runs_dir)
    cause = failed.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "rank 1's traceback" in str(cause), cause
    reason = str(failed.value)
    assert "eval 'val' failed: KeyError: 'x' (after step 4); no failure checkpoint" in reason
    assert checkpoints(run) == {}


def test_a_dry_run_runs_a_step_and_each_eval_and_names_the_broken_one(procs, runs_dir, tmp_path):
    profile = broken_profile(tmp_path)
    (tmp_path / "broken").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ("run", str(profile), "--dry-run", "--runs-dir", str(runs_dir))
    result = procs.cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "gpu-console: task eval_broken:Broken: eval 'val' failed: KeyError: 'x'"
    ]
    assert not runs_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # --no-step: the build only, which the bug does not reach.
    built = procs.cli(*args, "--no-step", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert "none (--no-step: built only)" in built.stdout
    (tmp_path / "broken").unlink()
    fixed = procs.cli(*args, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert "one training micro-batch, one batch of 'val' on the CPU: passed" in fixed.stdout
    assert not runs_dir.exists()


def test_a_dry_run_rehearses_a_tasks_own_step_with_its_collectives(procs, runs_dir, tmp_path):
    # GanStepTask's train_step updates two optimizers and all-gathers the weights.
    gan = (Path(__file__).with_name("gan_task.py")).read_text()
    profile = task_profile(tmp_path, "gan_task", gan, "GanStepTask", max_steps=4)
    text = profile.read_text().replace("train_samples = 8192\neval_samples = 512\n", "")
    profile.write_text(text.replace("hidden_dim = 64\n", ""))
    result = procs.cli("run", str(profile), "--dry-run", "--json", "--runs-dir", str(runs_dir),
                       cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["rehearsal"]["eval_splits"] == [""]
    assert not runs_dir.exists()
