"""The best checkpoint (``checkpoint.keep_best``) and ``gpu-console export``: the runs on the
engine harness, ``ls``, ``status`` and ``export`` through the real CLI. The best survives
``keep_last`` pruning and a resume, and the exported weights load into a plain copy of the
model class in a Python where gpu_console cannot be imported, giving the run's own outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import events_of, task_profile, write_profile
from harness import run_engine
from headless_text import headless_text

from gpu_console.engine import checkpoint
from gpu_console.engine.export import ExportInputError, plain_keys, split
from gpu_console.profile import ProfileError, load_profile
from gpu_console.runs import best_checkpoint, latest_checkpoint, list_checkpoints
from gpu_console.tasks.configs import MLPConfig
from gpu_console.tasks.mlp import MLPTask

# An eval metric that improves until step 20 and worsens after it: |training steps - 20|,
# counted by each rank's task (one compute per step). A resumed session counts from 0 again,
# so its evals (|5 - 20|, |10 - 20|) are worse than the best, but would be a "best" to a run
# that forgot the best value.
WOBBLY = """
import torch
from gpu_console.tasks.mlp import MLPTask


class Wobbly(MLPTask):
    trained = 0

    def compute(self, model, batch):
        out = super().compute(model, batch)
        if model.training:
            self.trained += 1
        else:
            out.metrics["dist"] = torch.tensor(float(abs(self.trained - 20)))
        return out


class Parts(Wobbly):
    def export_modules(self):
        return {"first": "0", "whole": ""}
"""

BEST = """
[checkpoint]
keep_last = 1
every_steps = 10
keep_best = "eval.dist"
best_mode = "min"
"""

# The model as the user's own script has it: no gpu_console anywhere (MLPTask's layers).
PLAIN = """
import sys
sys.modules["gpu_console"] = None  # any import of it fails: loading must not need it
import torch
from torch import nn


class Net(nn.Sequential):
    def __init__(self, input_dim=32, hidden=64, classes=10, layers=3):
        mods, width = [], input_dim
        for _ in range(layers - 1):
            mods += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        super().__init__(*mods, nn.Linear(width, classes))


exported, x_file, expected_file = sys.argv[1:4]
state = torch.load(exported)  # weights_only by default: plain tensors and dicts only
net = Net()
if len(sys.argv) > 4:  # a file of named state_dicts: the one named
    state = state[sys.argv[4]]
net.load_state_dict(state, strict=True)
net.eval()
with torch.no_grad():
    got = net(torch.load(x_file))
assert torch.equal(got, torch.load(expected_file)), (got, torch.load(expected_file))
print("same outputs")
"""


def _run(procs, runs_dir, *args):
    return procs.cli(*args, "--runs-dir", str(runs_dir))


def _run_outputs(checkpoint, x):
    """What the run's model (built by the task, its checkpoint loaded) gives for ``x``."""
    model = MLPTask(MLPConfig(hidden_dim=64)).build_model()
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    model.eval()
    with torch.no_grad():
        return model(x)


def _load_plainly(tmp_path, exported, checkpoint, name=None):
    """Load ``exported`` in ``python -I`` with gpu_console blocked; compare with the run."""
    script = tmp_path / "plain_load.py"
    script.write_text(PLAIN)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(7))
    torch.save(x, tmp_path / "x.pt")
    torch.save(_run_outputs(checkpoint, x), tmp_path / "expected.pt")
    args = [str(exported), str(tmp_path / "x.pt"), str(tmp_path / "expected.pt")]
    args += [name] if name else []
    done = subprocess.run(
        [sys.executable, "-I", str(script), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0 and "same outputs" in done.stdout, done.stdout + done.stderr


def test_the_best_survives_pruning_and_resume_and_exports_load_plainly(procs, runs_dir, tmp_path):
    # The runs on the engine harness (tests/harness.py); ls, status and export through the CLI.
    profile = task_profile(tmp_path, "wobbly", WOBBLY, "Wobbly", max_steps=30, extra=BEST)
    run = run_engine(tmp_path, profile, "train.eval_every=5", "train.log_every=5",
                     runs_dir=runs_dir)  # fmt: skip
    printed = headless_text(run)
    ckpts = run / "checkpoints"

    # Best at 5, 10, 15, 20 (values 15, 10, 5, 0), never after: each supersedes the last.
    saved = events_of(run, "checkpoint")
    best = [(e["step"], e["reason"], e["value"]) for e in saved if e.get("best")]
    assert best == [(5, "best", 15.0), (10, "interval", 10.0), (15, "best", 5.0),
                    (20, "interval", 0.0)]  # fmt: skip
    assert all(e["metric"] == "eval.dist" for e in saved if e.get("best"))
    assert "checkpoint @ step 20 (interval): " in printed, printed
    assert ", best eval.dist 0.0000" in printed, printed
    # keep_last = 1 keeps the newest (30) and the best (20); every earlier best was pruned.
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000020", "step-00000030"]
    assert (ckpts / "BEST").read_text() == "step-00000020\n"
    assert json.loads((ckpts / "step-00000020" / "meta.json").read_text())["best"] is True
    assert [(c["step"], c["best"]) for c in list_checkpoints(run)] == [(20, True), (30, False)]
    (entry,) = json.loads(_run(procs, runs_dir, "ls", "--json").stdout)
    expected = {"path": str(ckpts / "step-00000020"), "step": 20, "metric": "eval.dist",
                "value": 0.0}  # fmt: skip
    assert entry["best_checkpoint"] == expected

    # A resumed run keeps the best value: its worse evals (15 at 35, 10 at 40) are not best.
    run_engine(tmp_path, None, "train.max_steps=40", resume=run, runs_dir=runs_dir)
    later = [e for e in events_of(run, "checkpoint") if e["step"] > 30]
    assert [e["step"] for e in later] == [40] and not any(e.get("best") for e in later)
    assert (ckpts / "BEST").read_text() == "step-00000020\n"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000020", "step-00000040"]
    status = json.loads(_run(procs, runs_dir, "status", run.name, "--json").stdout)
    assert status["best_checkpoint"] == expected

    # Export the newest and the best; each loads strictly into the user's own class.
    latest, best_file = tmp_path / "latest.pt", tmp_path / "best.pt"
    out = _run(procs, runs_dir, "export", run.name, "--out", str(latest))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{latest}: ") and "step 40" in out.stdout, out.stdout
    out = _run(procs, runs_dir, "export", run.name, "--best", "--out", str(best_file))
    assert out.returncode == 0, out.stderr
    assert "step 20 (best)" in out.stdout and "6 keys" in out.stdout, out.stdout
    _load_plainly(tmp_path, latest, ckpts / "step-00000040")
    _load_plainly(tmp_path, best_file, ckpts / "step-00000020")
    assert not torch.equal(torch.load(latest)["0.weight"], torch.load(best_file)["0.weight"])
    assert [p.name for p in tmp_path.glob(".*.tmp")] == []  # no temporary file left behind

    # Bad inputs: one line, exit 2, nothing written.
    target = tmp_path / "never.pt"
    for args, says in [
        (["export", run.name, "--step", "7", "--out", str(target)],
         "no complete checkpoint at step 7 (on disk: 20, 40)"),
        (["export", run.name, "--best", "--step", "20", "--out", str(target)],
         "--best and --step: give one of them"),
        (["export", "no-such-run", "--out", str(target)], "no such run"),
        (["export", run.name, "--out", str(tmp_path / "absent" / "x.pt")], "does not exist"),
        (["export", run.name, "--out", str(tmp_path)], "a directory; give a file name"),
    ]:  # fmt: skip
        bad = _run(procs, runs_dir, *args)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert bad.stderr.count("\n") == 1 and says in bad.stderr, (args, bad.stderr)
        assert "Traceback" not in bad.stderr
    assert not target.exists() and not (tmp_path / "absent").exists()


@pytest.mark.quick
def test_export_of_named_submodules_and_of_a_run_without_best(procs, runs_dir, tmp_path):
    # The run on the engine harness (tests/harness.py), its export through the CLI.
    profile = task_profile(tmp_path, "wobbly", WOBBLY, "Parts", max_steps=5)
    run = run_engine(tmp_path, profile, runs_dir=runs_dir)
    assert not (run / "checkpoints" / "BEST").exists()
    assert not any(e.get("best") for e in events_of(run, "checkpoint"))

    out_file = tmp_path / "parts.pt"
    out = _run(procs, runs_dir, "export", run.name, "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    assert "first: 2 keys, whole: 6 keys" in out.stdout, out.stdout
    parts = torch.load(out_file)
    assert sorted(parts) == ["first", "whole"] and sorted(parts["first"]) == ["bias", "weight"]
    assert torch.equal(parts["first"]["weight"], parts["whole"]["0.weight"])
    _load_plainly(tmp_path, out_file, run / "checkpoints" / "step-00000005", name="whole")

    bad = _run(procs, runs_dir, "export", run.name, "--best", "--out", str(tmp_path / "b.pt"))
    assert bad.returncode == 2 and "checkpoint.keep_best is off" in bad.stderr, bad.stderr
    assert bad.stderr.count("\n") == 1 and not (tmp_path / "b.pt").exists()


def test_prefixes_of_ddp_and_compile_are_dropped_and_a_module_path_must_exist():
    wrapped = {"module._orig_mod.0.weight": 1, "module.0.block._orig_mod.bias": 2}
    assert plain_keys(wrapped) == {"0.weight": 1, "0.block.bias": 2}
    own = {"module.w": 1, "head.w": 2}  # the model's own submodule named "module": kept
    assert plain_keys(own) == own
    state = {"g.0.weight": 1, "g.0.bias": 2, "d.weight": 3}
    assert split(state, {"gen": "g", "all": ""}) == {
        "gen": {"0.weight": 1, "0.bias": 2},
        "all": state,
    }
    with pytest.raises(ExportInputError, match="'gen' names 'G', no submodule with weights"):
        split(state, {"gen": "G"})


@pytest.mark.parametrize(
    "lines, says",
    [
        ('keep_best = "val_loss"', "checkpoint.keep_best: expected eval.<metric>"),
        ('keep_best = "eval."', "checkpoint.keep_best: expected eval.<metric>"),
        ('keep_best = "eval.accuracy"', "checkpoint.best_mode: say min or max for eval.accuracy"),
        ('keep_best = "eval.loss"\nbest_mode = "lowest"', "checkpoint.best_mode: expected one of"),
    ],
)
def test_bad_best_keys_are_one_line_each(tmp_path, lines, says):
    path = write_profile(tmp_path / "p.toml", f"[checkpoint]\n{lines}\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(path))
    (problem,) = e.value.problems
    assert problem.startswith(f"{path}: ") and says in problem, problem


def test_best_mode_auto_is_min_for_a_loss_and_explicit_otherwise(tmp_path):
    path = write_profile(tmp_path / "p.toml", '[checkpoint]\nkeep_best = "eval.val_loss"\n')
    assert load_profile(str(path)).checkpoint.best_direction() == "min"
    path.write_text('[checkpoint]\nkeep_best = "eval.accuracy"\nbest_mode = "max"\n')
    assert load_profile(str(path)).checkpoint.best_direction() == "max"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _save(run, step, reason, best_step, w=0.0):
    """Save ``step`` with a best record at ``best_step`` (None: no best yet)."""
    record = {"metric": "eval.loss", "mode": "min", "value": float(best_step or 0),
              "step": best_step} if best_step else None  # fmt: skip
    best = {"so_far": record, "is_best": best_step == step}
    state = {"model": {"w": torch.full((2,), w)}, "step": step}
    return checkpoint.save(run, step, reason, state, {}, 1, True, None, best)


def test_the_best_is_pruned_only_once_superseded_and_never_left_unnamed(one_rank, tmp_path):
    run = tmp_path / "run"
    assert _save(run, 10, "best", 10)["event"]["best"] is True
    _save(run, 20, "interval", 10)
    _save(run, 30, "interval", 10)
    assert best_checkpoint(run).name == "step-00000010"  # kept through keep_last = 1
    assert [c["step"] for c in list_checkpoints(run)] == [10, 30]
    meta = json.loads((run / "checkpoints" / "step-00000030" / "meta.json").read_text())
    assert meta["best"] is False and meta["best_so_far"]["step"] == 10

    # The best's step saved again (a stop right after a best eval), and the rename that puts
    # it back in place fails: BEST still names a complete checkpoint of that step's weights.
    _save(run, 40, "best", 40, w=4.0)
    real_rename = os.rename

    def fail_staging(src, dst):
        if ".link-" in str(src):
            raise OSError("rename failed")
        return real_rename(src, dst)

    checkpoint.os.rename = fail_staging
    try:
        assert _save(run, 40, "stop", 40, w=4.0)["ok"] is False
    finally:
        checkpoint.os.rename = real_rename
    named = best_checkpoint(run)
    assert named is not None and named == latest_checkpoint(run)
    assert torch.equal(checkpoint.load(named)["model"]["w"], torch.full((2,), 4.0))

    # The next save puts both names back on the step directory, and prunes the old best.
    assert _save(run, 40, "stop", 40, w=4.0)["ok"] is True
    assert best_checkpoint(run).name == "step-00000040" == latest_checkpoint(run).name
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert listing == ["BEST", "LATEST", "step-00000040"]


def test_a_set_keep_best_without_a_mode_is_blamed_on_set(tmp_path):
    path = write_profile(tmp_path / "p.toml", "[checkpoint]\nkeep_last = 2\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(path), ["checkpoint.keep_best=eval.accuracy"])
    (problem,) = e.value.problems
    assert problem.startswith("--set: checkpoint.keep_best: eval.accuracy needs "), problem
