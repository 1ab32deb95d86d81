"""A resume with a changed ``[task]`` key (gpu_console/resume_model.py, engine/model_match.py).

A SLURM job that gets a new scratch path resumes its own run: a task key that leaves the
checkpoint's model loadable is a warning naming it (old → new), one that changes the model is
refused in one line before anything is written, and a task's ``resume_keys`` has the last
word on the keys it declares. On one finished run of a user task that reads its data from
``task.data_dir`` (its input width is the file's), made by the engine harness
(tests/harness.py: the launch's own run.toml and meta.json, which is what a resume compares
with): the refusals through the CLI (its one line, its exit code), the resumed run on the
engine harness; the comparison itself in process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import events_of, only_run, pinned_env, write_profile
from harness import run_engine
from headless_text import headless_text

from gpu_console import resume_model
from gpu_console.engine import model_match
from gpu_console.engine.plan import TaskBuildError
from gpu_console.profile import resolve
from gpu_console.resume_changes import (
    REFUSED,
    TASK_ACCEPTS,
    TASK_DOES_NOT_LOAD,
    TASK_LOADS,
    WARNING,
    Change,
    classify,
    judge,
    line,
)

DATA_TASK = """
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_console.tasks.base import TaskOutput, TensorSet

RECORD = {record!r}


@dataclass
class DataConfig:
    data_dir: str = ""
    hidden: int = 8
    data_seed: int = 0
    label: str = ""


class DataTask:
    '''Rows of numbers from data_dir/numbers.csv (features, then a 0/1 label); the model's
    input is as wide as the file's features. Each build_model says which program built it.'''

    Config = DataConfig
    resume_keys = {{
        "data_seed": (
            "refuse", "the eval rows were drawn with it: another moves them into training"
        ),
        "label": "accept",
    }}

    def __init__(self, config):
        self.cfg = config

    def _rows(self):
        with open(os.path.join(self.cfg.data_dir, "numbers.csv")) as f:
            return torch.tensor([[float(v) for v in row.split(",")] for row in f if row.strip()])

    def build_model(self):
        with open(RECORD, "a") as f:
            f.write(getattr(sys.modules["__main__"].__spec__, "name", "?") + "\\n")
        with open(os.path.join(self.cfg.data_dir, "numbers.csv")) as f:
            width = len(f.readline().split(",")) - 1
        hidden = self.cfg.hidden
        return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def build_datasets(self):
        rows = self._rows()
        g = torch.Generator().manual_seed(self.cfg.data_seed)
        order = torch.randperm(len(rows), generator=g)
        rows = rows[order]
        x, y = rows[:, :-1], rows[:, -1].long()
        return TensorSet(x[32:], y[32:]), TensorSet(x[:32], y[:32])

    def compute(self, model, batch):
        x, y = batch
        return TaskOutput(F.cross_entropy(model(x), y), len(y))
"""

PROFILE = """
[profile]
name = "datatask"
[task]
kind = "datatask:DataTask"
data_dir = "{data_dir}"
[data]
batch_size = 16
[train]
max_steps = 4
lr = 1e-2
log_every = 1
precision = "fp32"
[hardware]
devices = "cpu:1"
"""


def write_numbers(folder: Path, features: int = 4, rows: int = 160) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(features)
    x = torch.randn(rows, features, generator=g)
    y = (x.sum(1) > 0).long()
    lines = [
        ",".join(f"{v:.4f}" for v in r.tolist()) + f",{int(c)}" for r, c in zip(x, y, strict=True)
    ]
    (folder / "numbers.csv").write_text("\n".join(lines) + "\n")
    return folder


class Finished:
    def __init__(self, run: Path, where: Path):
        self.run, self.where = run, where
        self.data = where / "data1"
        self.record = where / "built.txt"

    def copy(self, tmp_path: Path) -> tuple[Path, Path]:
        runs = tmp_path / "runs"
        runs.mkdir()
        return runs, Path(shutil.copytree(self.run, runs / self.run.name, symlinks=True))

    def built_by_the_comparison(self) -> int:
        lines = self.record.read_text().splitlines() if self.record.exists() else []
        return lines.count("gpu_console.engine.model_match")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Finished:
    """One finished run of the data task: 4 steps on one CPU rank, from data1 (4 features),
    launched from its folder on the engine harness (pinned_env: a module's fixture starts
    before no_gpu_machine pins the hardware)."""
    where = tmp_path_factory.mktemp("task_keys")
    done = Finished(where, where)
    write_numbers(done.data)
    (where / "datatask.py").write_text(DATA_TASK.format(record=str(done.record)))
    profile = write_profile(where / "datatask.toml", PROFILE.format(data_dir=done.data))
    done.run = run_engine(where, profile, runs_dir=where / "runs", cwd=where, env=pinned_env())
    assert done.run == only_run(where / "runs")
    assert [e["step"] for e in events_of(done.run, "step")] == [1, 2, 3, 4]
    assert events_of(done.run, "status")[-1]["state"] == "finished"
    assert (done.run / "checkpoints" / "LATEST").read_text().strip() == "step-00000004"
    assert done.built_by_the_comparison() == 0  # a plain launch compares nothing
    return done


def resume(procs, runs: Path, run: Path, cwd: Path, *sets: str, extra=()):
    args = ["run", "--resume", str(run), "--headless", "--runs-dir", str(runs), *extra]
    for s in sets:
        args += ["--set", s]
    return procs.cli(*args, cwd=cwd)


def untouched(run: Path) -> dict[str, tuple]:
    """Every file's size and mtime, and run.toml's and meta.json's bytes."""
    files = {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
             for p in sorted(run.rglob("*")) if p.is_file()}  # fmt: skip
    files["run.toml bytes"] = ((run / "run.toml").read_bytes(),)
    files["meta.json bytes"] = ((run / "meta.json").read_bytes(),)
    return files


def refusal(result, run: Path, before: dict) -> str:
    """Exit 2, one line on stderr, no traceback, the run as it was: that line."""
    both = result.stdout + result.stderr
    assert result.returncode == 2, both
    assert "Traceback" not in both, both
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert untouched(run) == before
    return lines[0]


# -- the resumed run, on the engine harness -------------------------------------------------


def test_a_new_data_dir_that_leaves_the_model_loadable_is_a_warning_and_the_run_goes_on(
    finished, tmp_path
):
    runs, run = finished.copy(tmp_path)
    data2 = Path(shutil.copytree(finished.data, tmp_path / "scratch2"))
    built = finished.built_by_the_comparison()
    # The launch's comparison is the product's own subprocess; the ranks run in this process
    # (their build_model is not counted as the comparison's). Launched where the run was:
    # the harness's key check imports the task from there.
    run_engine(tmp_path, None, f"task.data_dir={data2}", "train.max_steps=6", resume=run,
               runs_dir=runs, cwd=finished.where)  # fmt: skip
    change = {"key": "task.data_dir", "old": str(finished.data), "new": str(data2),
              "class": WARNING, "why": TASK_LOADS}  # fmt: skip
    # The headless start lines, old → new (headless_text wraps at 200 columns, where the
    # console off a terminal does not: compared with the breaks made spaces again).
    shown = " ".join(headless_text(run).split())
    assert " ".join(line(change).split()) in shown
    assert f"task.data_dir '{finished.data}' → '{data2}' (warning: " in shown
    start = events_of(run, "start")[-1]
    assert [c for c in start["changes"] if c["key"].startswith("task.")] == [change]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["sessions"][-1]["changes"] == start["changes"]
    assert [e["step"] for e in events_of(run, "step") if e["step"] > 4] == [5, 6]
    assert events_of(run, "status")[-1]["state"] == "finished"
    assert finished.built_by_the_comparison() == built + 1  # once, for prepare and start


# -- through the CLI -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, key, was, differs",
    [
        ("task.hidden=16", "task.hidden", "8", "0.weight: [8, 4] in the checkpoint, [16, 4] now"),
        ("task.data_dir={wide}", "task.data_dir", "'{data}'",
         "0.weight: [8, 4] in the checkpoint, [8, 6] now"),
    ],
)  # fmt: skip
def test_a_change_the_checkpoints_model_does_not_load_into_is_refused_before_anything_is_written(
    procs, finished, tmp_path, change, key, was, differs
):
    runs, run = finished.copy(tmp_path)
    wide = write_numbers(tmp_path / "wide", features=6)
    change = change.format(wide=wide)
    before = untouched(run)
    result = resume(procs, runs, run, tmp_path, change, "train.max_steps=6")
    got = refusal(result, run, before)
    was = was.format(data=finished.data)
    assert got.startswith(
        f"gpu-console: --set: {key}: a resumed run cannot change it (was {was}): "
        f"the checkpoint's model does not load into the one it builds ({differs}"
    ), got
    new = "16" if key == "task.hidden" else repr(str(wide))
    assert got.endswith(f") (got {new})"), got
    assert only_run(runs) == run


def test_a_model_that_cannot_be_built_is_one_line_naming_the_key(procs, finished, tmp_path):
    runs, run = finished.copy(tmp_path)
    before = untouched(run)
    gone = tmp_path / "not-mounted"
    result = resume(procs, runs, run, tmp_path, f"task.data_dir={gone}", "train.max_steps=6")
    got = refusal(result, run, before)
    assert got.startswith(
        "gpu-console: --set: task.data_dir: a resumed run builds its model to compare with the "
        "checkpoint: task datatask:DataTask: build_model() failed: FileNotFoundError: "
    ), got
    assert got.endswith(f"(got {str(gone)!r})")


def test_the_tasks_resume_keys_refuse_one_the_model_would_load_with(procs, finished, tmp_path):
    runs, run = finished.copy(tmp_path)
    before = untouched(run)
    built = finished.built_by_the_comparison()
    result = resume(procs, runs, run, tmp_path, "task.data_seed=1", "train.max_steps=6")
    got = refusal(result, run, before)
    assert got == (
        "gpu-console: --set: task.data_seed: a resumed run cannot change it (was 0): the eval "
        "rows were drawn with it: another moves them into training (got 1)"
    )
    assert finished.built_by_the_comparison() == built  # the task's word: no model built


def test_the_tasks_resume_keys_accept_one_without_building_and_dry_run_agrees(
    procs, finished, tmp_path
):
    """``label`` is accepted on the task's word (no model built to compare); ``data_dir`` in
    the same resume is compared; ``--dry-run`` shows what the resume would do."""
    runs, run = finished.copy(tmp_path)
    data2 = Path(shutil.copytree(finished.data, tmp_path / "scratch2"))
    before = untouched(run)
    built = finished.built_by_the_comparison()
    result = resume(procs, runs, run, tmp_path, "task.label=requeued", "train.max_steps=6",
                    extra=("--dry-run", "--json", "--no-step"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    changes = {c["key"]: c for c in json.loads(result.stdout)["resume"]["changes"]}
    assert changes["task.label"] == {"key": "task.label", "old": "", "new": "requeued",
                                     "class": WARNING, "why": TASK_ACCEPTS}  # fmt: skip
    assert finished.built_by_the_comparison() == built
    assert untouched(run) == before

    result = resume(procs, runs, run, tmp_path, "task.label=requeued", f"task.data_dir={data2}",
                    "train.max_steps=6", extra=("--dry-run", "--json", "--no-step"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    changes = {c["key"]: c for c in json.loads(result.stdout)["resume"]["changes"]}
    assert (changes["task.label"]["class"], changes["task.label"]["why"]) == (WARNING, TASK_ACCEPTS)
    assert (changes["task.data_dir"]["class"], changes["task.data_dir"]["why"]) == (
        WARNING, TASK_LOADS,
    )  # fmt: skip
    assert finished.built_by_the_comparison() == built + 1  # data_dir's, once
    assert untouched(run) == before


# -- the comparison, in process -------------------------------------------------------------


def test_mismatch_names_the_first_differences_in_the_models_order():
    saved = {"a.weight": [4, 2], "a.bias": [4], "old.weight": [1], "n": []}
    assert model_match.mismatch(saved, dict(saved)) is None
    built = {"a.weight": [8, 2], "a.bias": [4], "new.weight": [1], "n": []}
    assert model_match.mismatch(saved, built) == (
        "a.weight: [4, 2] in the checkpoint, [8, 2] now; new.weight: not in the checkpoint; "
        "and 1 more"
    )
    assert (
        model_match.mismatch({"x": [1]}, {}) == "x: in the checkpoint, not in the model it builds"
    )


class Declares:
    resume_keys = {"data_dir": "accept", "vocab": ("refuse", "the tokenizer is fixed"),
                   "cache": ("refuse",)}  # fmt: skip


def test_declared_keys_are_the_tasks_word_and_a_bad_entry_is_named():
    got = model_match.declared(
        Declares, "t", ["task.data_dir", "task.vocab", "task.cache", "task.n"]
    )
    assert got == {
        "task.data_dir": (WARNING, TASK_ACCEPTS),
        "task.vocab": (REFUSED, "the tokenizer is fixed"),
        "task.cache": (REFUSED, model_match.VERDICTS["refuse"][1]),
    }
    assert model_match.declared(object, "t", ["task.x"]) == {}

    class Bad:
        resume_keys = {"data_dir": "maybe"}

    with pytest.raises(TaskBuildError, match=r"resume_keys\['data_dir'\] must be 'accept'"):
        model_match.declared(Bad, "t", ["task.hidden"])


def _checkpoint(folder: Path, model: torch.nn.Module, sharded: bool = False) -> Path:
    folder.mkdir(parents=True)
    if sharded:
        import torch.distributed.checkpoint as dcp

        with pytest.warns(UserWarning):  # "assuming ... a single process": no process group
            dcp.save({"model": model.state_dict(), "optimizers": {"default": {"s": torch.ones(3)}}},
                     checkpoint_id=folder)  # fmt: skip
        torch.save({"step": 3, "sharded": "dcp"}, folder / "state.pt")
    else:
        torch.save({"model": model.state_dict(), "step": 3}, folder / "state.pt")
    (folder / "meta.json").write_text('{"step": 3}\n')
    return folder


@pytest.mark.parametrize("sharded", [False, True], ids=["state.pt", "dcp"])
def test_checkpoint_shapes_read_both_formats_without_the_weights(tmp_path, sharded):
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    ckpt = _checkpoint(tmp_path / "step-00000003", model, sharded)
    assert model_match.checkpoint_shapes(ckpt) == {
        "0.weight": [5, 3], "0.bias": [5], "1.weight": [5], "1.bias": [5],
        "1.running_mean": [5], "1.running_var": [5], "1.num_batches_tracked": [],
    }  # fmt: skip


@pytest.mark.parametrize(
    "kind, same, other, key",
    [
        ("mlp", {"noise": 2.0, "data_seed": 7}, {"hidden_dim": 16}, "task.hidden_dim"),
        ("transformer", {"train_samples": 99}, {"d_model": 32, "n_heads": 4}, "task.d_model"),
    ],
)
def test_built_in_tasks_are_judged_by_the_model_their_keys_build(tmp_path, kind, same, other, key):
    small = {"mlp": {"hidden_dim": 8}, "transformer": {"d_model": 16, "n_heads": 2}}[kind]
    p = resolve({"task": {"kind": kind, **small}}, "x")
    p_task = model_match._task(p)[1]
    ckpt = _checkpoint(tmp_path / "step-00000003", p_task.build_model())
    built = model_match.model_shapes(p, 3)
    assert built == model_match.checkpoint_shapes(ckpt)

    def judged(keys: dict) -> dict:
        doc = resolve({"task": {"kind": kind, **small, **keys}}, "x").to_dict()
        names = [f"task.{k}" for k in keys]
        return model_match.judge({"profile": doc, "checkpoint": str(ckpt), "keys": names})

    assert judged(same)["verdicts"] == dict.fromkeys(
        [f"task.{k}" for k in same], (WARNING, TASK_LOADS)
    )
    refused = judged(other)["verdicts"][key]
    assert refused[0] == REFUSED
    assert refused[1].startswith(TASK_DOES_NOT_LOAD.format("")[:-1])


def test_only_a_changed_task_key_is_judged_and_once_per_process(tmp_path, monkeypatch):
    asked = []

    def ask(profile, ckpt, keys, cwd):
        asked.append([c.key for c in keys])
        return {c.key: (WARNING, TASK_LOADS) for c in keys}

    monkeypatch.setattr(resume_model, "_ask", ask)
    monkeypatch.setattr(resume_model, "_verdicts", {})
    run = tmp_path / "run"
    ckpt = _checkpoint(run / "checkpoints" / "step-00000003", torch.nn.Linear(2, 2))
    (run / "checkpoints" / "LATEST").write_text(ckpt.name + "\n")
    old = resolve({"task": {"kind": "mlp"}}, "x").to_dict()
    new = resolve({"task": {"kind": "mlp", "noise": 2.0}, "train": {"lr": 0.5}}, "x").to_dict()

    plain = classify(old, resolve({"train": {"lr": 0.5}}, "x").to_dict())
    assert resume_model.judged(plain, run, new, None) == plain and asked == []
    changes = classify(old, new)
    assert {c.key: c.cls for c in changes} == {"train.lr": "applied", "task.noise": REFUSED}
    for _ in range(2):  # prepare, then start (or the dry run's plan)
        got = {c.key: (c.cls, c.why) for c in resume_model.judged(changes, run, new, None)}
        assert got["task.noise"] == (WARNING, TASK_LOADS)
        assert got["train.lr"][0] == "applied"
    assert asked == [["task.noise"]]
    # Another task: nothing judged (task.kind is refused, and every key with it).
    other = classify(old, resolve({"task": {"kind": "transformer"}}, "x").to_dict())
    assert resume_model.judged(other, run, new, None) == other and len(asked) == 1


def test_judge_replaces_only_the_judged_keys():
    changes = [Change("task.a", 1, 2, REFUSED, "x"), Change("train.lr", 1, 2, "applied", "y")]
    got = judge(changes, {"task.a": (WARNING, "loads")})
    assert got == [Change("task.a", 1, 2, WARNING, "loads"), changes[1]]
