"""Resume says what it does with changes, and does it (gpu_console/resume_changes.py).

Runs on the engine harness (tests/harness.py), its headless lines read with headless_text:
a changed lr is the lr the optimizer uses, and a change of world size and batch size
continues at the next sample of the epoch's order (neither skipping nor repeating one); through
the CLI, whose exit code and line are checked: a model-shape change is refused before anything
is written.
The table and the engine's restore are also checked in process.
"""

from __future__ import annotations

import pytest
import torch
from conftest import events_of, fast_profile, only_run, task_profile
from harness import run_engine
from headless_text import headless_text

from gpu_console.engine.data import DataPosition
from gpu_console.engine.resume import Settings, data_position
from gpu_console.engine.schedule import lr_factor
from gpu_console.profile import TrainConfig, resolve
from gpu_console.resume_changes import APPLIED, REFUSED, TABLE, WARNING, classify, rule

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def _state(run, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:08d}" / "state.pt", weights_only=True)


def _files(run):
    """Every file of a run directory with its bytes: what a refused resume must not touch."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _change(event: dict, key: str) -> dict:
    (found,) = [c for c in event.get("changes") or [] if c["key"] == key]
    return found


# -- the table ------------------------------------------------------------------------------


def test_every_profile_key_is_classified_by_the_table():
    keys = [
        f"{section}.{key}"
        for section, table in resolve({}, "test.toml").to_dict().items()
        if section != "task"
        for key in table
    ]
    unclassified = [k for k in keys if k not in TABLE and f"{k.split('.')[0]}.*" not in TABLE]
    assert unclassified == []
    assert rule("train.lr")[0] == APPLIED
    assert rule("task.hidden_dim")[0] == rule("task.kind")[0] == REFUSED
    for key in ("data.batch_size", "train.grad_accum", "data.num_workers", "world_size"):
        assert rule(key)[0] == WARNING, key


def test_classify_lists_every_difference_old_to_new():
    old = resolve({}, "test.toml").to_dict()
    new = resolve({}, "test.toml").to_dict()
    new["train"]["lr"] = 0.5
    new["data"]["batch_size"] = 32
    new["task"]["hidden_dim"] = 7
    changes = {c.key: c for c in classify(old, new, old_world=2, new_world=1)}
    assert set(changes) == {"train.lr", "data.batch_size", "task.hidden_dim", "world_size"}
    assert (changes["train.lr"].old, changes["train.lr"].new) == (old["train"]["lr"], 0.5)
    assert changes["train.lr"].line() == f"train.lr {old['train']['lr']} → 0.5 (applied)"
    assert changes["task.hidden_dim"].cls == REFUSED
    assert changes["world_size"].line().startswith("world_size 2 → 1 (warning: ")
    assert classify(old, resolve({}, "test.toml").to_dict(), 2, 2) == []


# -- the engine's restore --------------------------------------------------------------------


def _trained(lr: float, steps: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True)
    cfg = TrainConfig(max_steps=20, lr=lr, warmup_steps=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    for _ in range(steps):
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, cfg


def test_restore_puts_the_new_lr_into_groups_and_schedule_and_keeps_an_unchanged_one_exact():
    _, old_opt, old_sched, _ = _trained(3e-3, 5)
    saved_opt, saved_sched = old_opt.state_dict(), old_sched.state_dict()

    _, opt, sched, cfg = _trained(0.5, 0)
    settings = Settings.of(opt, sched)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)
    assert opt.param_groups[0]["lr"] != 0.5 * lr_factor(5, cfg)  # what the load alone leaves
    settings.restore(opt, sched)
    assert sched.base_lrs == [0.5]
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 0.5 * lr_factor(5, cfg)
    assert opt.state_dict()["state"][0]["step"].item() == 5.0  # the state is the checkpoint's

    _, same_opt, same_sched, _ = _trained(3e-3, 0)
    settings = Settings.of(same_opt, same_sched)
    same_opt.load_state_dict(saved_opt)
    same_sched.load_state_dict(saved_sched)
    settings.restore(same_opt, same_sched)
    assert same_opt.state_dict()["param_groups"] == saved_opt["param_groups"]
    assert same_sched.get_last_lr() == old_sched.get_last_lr()


def test_an_old_checkpoints_position_in_micro_batches_becomes_samples():
    old = {"data": {"epoch": 1, "batch": 7}, "world_size": 2}
    assert data_position(old, [], 16) == DataPosition(1, 7 * 16 * 2)
    # Resumed with a new batch size: the old one (recorded at launch) is what it counted in.
    batch_change = [{"key": "data.batch_size", "old": 16, "new": 32, "class": WARNING}]
    assert data_position(old, batch_change, 32) == DataPosition(1, 7 * 16 * 2)
    assert data_position({"data": {"epoch": 0, "samples": 96}}, batch_change, 32).samples == 96


# -- runs: the engine harness (tests/harness.py), and the CLI for what it says ---------------


def _finished_run(tmp_path, *sets: str, max_steps: int = 10, ranks: int = 1):
    """A fast profile's run to its end on the engine harness: (its runs directory, the run)."""
    runs = tmp_path / "runs"
    profile = fast_profile(tmp_path, max_steps=max_steps, ranks=ranks)
    return runs, run_engine(tmp_path, profile, *sets, ranks=ranks, runs_dir=runs)


def test_a_changed_lr_is_the_lr_the_resumed_run_trains_at(tmp_path):
    runs, run = _finished_run(tmp_path, "train.schedule=constant")
    before = _state(run, 10)
    assert before["optimizer"]["param_groups"][0]["lr"] == 3e-3
    run_engine(tmp_path, None, "train.lr=0.5", "train.max_steps=14", resume=run, runs_dir=runs)
    assert events_of(run, "status")[-1]["state"] == "finished"
    out = headless_text(run)
    assert "train.lr 0.003 → 0.5 (applied)" in out
    assert "train.max_steps 10 → 14 (applied)" in out

    start = events_of(run, "start")[-1]
    assert _change(start, "train.lr") == {
        "key": "train.lr", "old": 3e-3, "new": 0.5, "class": APPLIED, "why": rule("train.lr")[1]
    }  # fmt: skip
    steps = [e for e in events_of(run, "step") if e["step"] > 10]
    assert [e["step"] for e in steps] == [11, 12, 13, 14]
    assert {e["lr"] for e in steps} == {0.5}
    # The optimizer really used it: its saved groups and schedule hold it, and the weights
    # moved as far as an lr of 0.5 moves them (Adam's step is about lr per parameter; at the
    # old lr four steps move no weight by more than 4 × 0.003).
    after = _state(run, 14)
    # Every parameter group (decayed and not) trains at the new lr.
    assert {g["lr"] for g in after["optimizer"]["param_groups"]} == {0.5}
    assert set(after["scheduler"]["base_lrs"]) == {0.5}
    moved = max(
        (after["model"][k] - before["model"][k]).abs().max().item() for k in before["model"]
    )
    assert moved > 0.2, moved


def test_a_model_shape_change_is_refused_before_anything_is_written(procs, tmp_path):
    runs, run = _finished_run(tmp_path, max_steps=2)
    files = _files(run)
    result = procs.cli(
        "run", "--resume", str(run), "--headless", "--runs-dir", str(runs),
        "--set", "task.hidden_dim=32", "--set", "train.max_steps=4", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(
        "gpu-console: --set: task.hidden_dim: a resumed run cannot change it (was 64)"
    )
    assert lines[0].endswith("(got 32)")
    assert _files(run) == files
    assert only_run(runs) == run


RECORDING_TASK = """
import os
import torch
from gpu_console.tasks.base import TensorSet
from gpu_console.tasks.mlp import MLPTask


class Recording(MLPTask):
    '''The MLP, whose training samples carry their index; each rank writes the ones it saw.'''

    def build_datasets(self):
        train, evals = super().build_datasets()
        x, y = train.tensors
        return TensorSet(x, y, torch.arange(len(y))), evals

    def compute(self, model, batch):
        if len(batch) == 3:
            x, y, index = batch
            name = f"rank-{{os.environ['RANK']}}-{{os.getpid()}}"
            with open(os.path.join({seen!r}, name), "a") as f:
                f.write(" ".join(map(str, index.tolist())) + "\\n")
            batch = (x, y)
        return super().compute(model, batch)
"""


def test_fewer_ranks_and_a_larger_batch_continue_at_the_next_sample(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    task = RECORDING_TASK.format(seen=str(seen))
    profile = task_profile(tmp_path, "recording", task, "Recording", max_steps=10, ranks=2)
    run = run_engine(tmp_path, profile, "data.batch_size=16", ranks=2)
    assert _state(run, 10)["data"] == {"epoch": 0, "samples": 10 * 16 * 2}

    # One rank, in this process: RANK as torchrun would set it, for the task's file name.
    run_engine(tmp_path, None, "data.batch_size=32", "train.max_steps=15", resume=run,
               env={"RANK": "0"})  # fmt: skip
    start = events_of(run, "start")[-1]
    assert start["world_size"] == 1
    for key, old, new in (("data.batch_size", 16, 32), ("world_size", 2, 1)):
        change = _change(start, key)
        assert (change["old"], change["new"], change["class"]) == (old, new, WARNING), change
        assert change["why"] == rule(key)[1]

    # 10 steps of 2 × 16, then 5 of 1 × 32: 480 samples, the first 480 of epoch 0's order,
    # each once.
    assert _state(run, 15)["data"] == {"epoch": 0, "samples": 480}
    indices = [int(i) for f in seen.iterdir() for i in f.read_text().split()]
    order = torch.randperm(8192, generator=torch.Generator().manual_seed(0)).tolist()
    assert len(indices) == 480
    assert sorted(indices) == sorted(order[:480])


def test_a_checkpoint_with_the_old_position_format_still_resumes(tmp_path):
    runs, run = _finished_run(tmp_path, max_steps=4, ranks=2)
    path = run / "checkpoints" / "step-00000004" / "state.pt"
    state = torch.load(path, weights_only=True)
    assert state["data"] == {"epoch": 0, "samples": 4 * 32 * 2}
    state["data"] = {"epoch": 0, "batch": 4}  # as gpu-console wrote it before: per rank
    torch.save(state, path)
    run_engine(tmp_path, None, "train.max_steps=6", ranks=2, resume=run, runs_dir=runs)
    assert _state(run, 6)["data"] == {"epoch": 0, "samples": 6 * 32 * 2}
