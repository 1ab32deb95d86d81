"""``gpu-console run PROFILE --dry-run``: the plan a run would start from, and nothing written.

The plan's numbers are checked against the ``start`` event of a run with the same flags
(2 CPU ranks of the engine harness, tests/harness.py: the launch and the engine a run makes,
without torchrun and the supervisor), so the dry run describes what a run builds, not a
guess. The dry runs themselves go through the real CLI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import events_of, fast_profile, only_run, task_profile
from harness import run_engine

TIMEOUT_S = 120.0


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``path`` with its size and modification time."""
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
    }


def dry_run(procs, *args: str, cwd: Path | None = None, as_json: bool = False):
    extra = ["--json"] if as_json else []
    return procs.cli("run", *args, "--dry-run", *extra, cwd=cwd, timeout=TIMEOUT_S)


def line(text: str, key: str) -> str:
    """The value on the plan's line for ``key`` (keys are left-aligned, values in a column)."""
    found = re.findall(rf"^{re.escape(key)} {{2,}}(.*)$", text, flags=re.MULTILINE)
    assert len(found) == 1, text
    return found[0]


@pytest.mark.parametrize(
    "profile, sets",
    [
        ("quickstart", ["train.max_steps=4", "train.warmup_steps=2", "train.grad_accum=2",
                        "distributed.lr_scaling=sqrt"]),
        ("transformer", ["train.max_steps=3", "train.warmup_steps=3"]),
    ],
)  # fmt: skip
def test_the_plan_is_what_a_run_builds_and_nothing_is_written(
    procs, runs_dir, tmp_path, profile, sets
):
    args = [profile, "--devices", "cpu:2", "--runs-dir", str(runs_dir)]
    args += [a for s in sets for a in ("--set", s)]
    before = tree(tmp_path)
    as_json = dry_run(procs, *args, as_json=True)
    text = dry_run(procs, *args)
    assert as_json.returncode == 0, as_json.stderr
    assert text.returncode == 0, text.stderr
    assert "Traceback" not in as_json.stderr + text.stderr
    # Nothing written: no run directory, not even the runs directory, nothing beside them.
    assert not runs_dir.exists()
    assert tree(tmp_path) == before
    plan = json.loads(as_json.stdout)

    run = run_engine(tmp_path, profile, *sets, ranks=2, runs_dir=runs_dir)
    assert run == only_run(runs_dir)
    assert events_of(run, "status")[-1]["state"] == "finished"
    start = events_of(run, "start")[0]
    for key in ("params", "optimizer", "weight_decay", "global_batch", "precision"):
        assert plan[key] == start[key], key
    assert plan["lr"] == pytest.approx(start["lr"])
    assert plan["devices"]["world_size"] == start["world_size"] == 2
    assert plan["devices"]["device_type"] == start["device_type"] == "cpu"
    assert sum(g["params"] for g in plan["param_groups"]) == plan["trainable"] == plan["params"]
    warmup = plan["schedule"]["warmup_steps"]
    assert plan["schedule"]["first_lr"] == pytest.approx(start["lr"] / warmup)
    # The run directory it named is where the run went, but for the second it was made in.
    assert Path(plan["run_dir"]).parent == run.parent.absolute()
    assert Path(plan["run_dir"]).name.rpartition("-")[0] == run.name.rpartition("-")[0]

    out = text.stdout
    assert out.splitlines()[0] == f"dry run of {profile}: nothing was written"
    assert line(out, "parameters").startswith(f"{start['params']:,} ")
    assert line(out, "devices").startswith("2 × cpu (cpu:2, from --devices)")
    assert line(out, "precision").startswith(f"{start['precision']} ")
    per_rank = plan["batch_size"]
    ga = plan["grad_accum"]
    assert line(out, "batch") == (
        f"{per_rank} per rank × 2 ranks × {ga} grad_accum = {start['global_batch']:,} global"
    )
    assert per_rank * 2 * ga == start["global_batch"]
    assert line(out, "optimizer").startswith(f"{start['optimizer']}, lr {start['lr']:.3g}")
    assert line(out, "steps").startswith(f"{start['max_steps']} ")
    assert line(out, "run dir").startswith(f"{runs_dir.absolute()}/{profile}-")
    assert line(out, "run dir").endswith("(would be created)")


def test_a_resume_plan_lists_the_changes_and_writes_nothing(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=4, ranks=2)
    run = run_engine(tmp_path, profile, ranks=2, runs_dir=runs_dir)
    assert run == only_run(runs_dir)
    assert events_of(run, "status")[-1]["state"] == "finished"
    before = tree(tmp_path)
    args = ["--resume", str(run), "--devices", "cpu:1", "--set", "train.max_steps=8"]
    as_json = dry_run(procs, *args, as_json=True)
    text = dry_run(procs, *args)
    assert as_json.returncode == 0, as_json.stderr
    assert text.returncode == 0, text.stderr
    assert tree(tmp_path) == before
    plan = json.loads(as_json.stdout)
    assert plan["run_dir"] == str(run.absolute()) and not plan["creates_run_dir"]
    assert plan["resume"]["step"] == 4
    assert Path(plan["resume"]["checkpoint"]).name == "step-00000004"
    changes = {c["key"]: (c["old"], c["new"], c["class"]) for c in plan["resume"]["changes"]}
    assert changes["train.max_steps"] == (4, 8, "applied")
    assert changes["world_size"] == (2, 1, "warning")
    assert plan["global_batch"] == 32  # one rank now
    assert line(text.stdout, "changes") == "train.max_steps 4 → 8 (applied)"
    assert line(text.stdout, "run dir") == f"{run.absolute()} (continued in place)"


BROKEN = """
from gpu_console.tasks.mlp import MLPTask


class Broken(MLPTask):
    def build_model(self):
        raise ValueError("the model cannot be built:\\nhidden_dim must be even (got 63)")


class NoData(MLPTask):
    def build_datasets(self):
        raise FileNotFoundError("/data/train.bin")


class BadReduce(MLPTask):
    metric_reduce = {"acc": "average"}
"""


@pytest.mark.quick
@pytest.mark.parametrize(
    "cls, expected",
    [
        ("Broken", "task broken:Broken: build_model() failed: "
                   "ValueError: hidden_dim must be even (got 63)"),
        ("NoData", "task broken:NoData: build_datasets() failed: "
                   "FileNotFoundError: /data/train.bin"),
        ("BadReduce", "task broken:BadReduce: metric_reduce failed: MetricReduceError: "
                      "task.metric_reduce['acc'] = 'average': expected one of mean_samples, "
                      "mean_tokens, sum, max, rank0"),
    ],
)  # fmt: skip
def test_a_task_that_cannot_build_is_one_line_and_exit_2(procs, runs_dir, tmp_path, cls, expected):
    profile = task_profile(tmp_path, "broken", BROKEN, cls)
    before = tree(tmp_path)
    result = dry_run(procs, str(profile), "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"gpu-console: {expected}"]
    assert not runs_dir.exists()
    assert tree(tmp_path) == before


def test_json_is_only_for_a_dry_run(procs, runs_dir):
    result = procs.cli("run", "quickstart", "--json", "--runs-dir", str(runs_dir))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "gpu-console: --json: only with --dry-run (a run reports with --headless)"
    ]
    assert not runs_dir.exists()
