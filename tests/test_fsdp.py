"""``distributed.strategy = "fsdp"``: FSDP2 on 2 CPU ranks (gloo), every run in the harness
(tests/harness.py), a stop among them (the command appended while the run trains); the
launch's refusals and the export through the CLI, which start no torchrun.

The installed torch runs ``fully_shard`` and ``torch.distributed.checkpoint`` on CPU with
gloo, so these tests run the real thing: the transformer sharded per block and at the root,
the MLP at the root only, fp32 losses against DDP's, a stop and resume continuing bit for bit,
sharded checkpoints, their export, and a resume on one rank. The CUDA path with bf16 is
tests/test_gpu.py's.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    POISONED_TASK,
    Procs,
    events_of,
    only_run,
    pinned_env,
    task_profile,
)
from conftest import test_env as cli_env
from harness import run_engine
from headless_text import headless_text

from gpu_console.engine.nonfinite import ENV
from gpu_console.runs import HOLD, list_checkpoints

# fp32 on both: FSDP reduce-scatters where DDP all-reduces, so sums may round differently in
# the last bits; over a few steps the losses agree to this relative tolerance (measured: equal
# to every printed digit).
REL = 1e-5

SMALL = """
[profile]
name = "{name}"
[task]
kind = "{kind}"
{task}
[data]
batch_size = 16
[train]
max_steps = {steps}
lr = 1e-3
log_every = 1
precision = "fp32"
eval_every = {steps}
[checkpoint]
keep_last = 0
[hardware]
devices = "cpu:2"
[distributed]
strategy = "{strategy}"
"""

TRANSFORMER = (
    "d_model = 32\nn_heads = 2\nn_layers = 2\nseq_len = 16\ntrain_samples = 1024\n"
    "eval_samples = 33\ndropout = 0.1"  # 33: 17 and 16 eval samples, 2 and 1 batches
)


def profile(tmp_path: Path, strategy: str, steps: int = 6, kind: str = "transformer") -> Path:
    path = tmp_path / f"{kind}-{strategy}.toml"
    task = TRANSFORMER if kind == "transformer" else "hidden_dim = 64\ntrain_samples = 4096"
    path.write_text(
        SMALL.format(name=f"{kind}-{strategy}", kind=kind, task=task, steps=steps,
                     strategy=strategy)
    )  # fmt: skip
    return path


def losses(run: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(run, "step")}


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=REL) for k in a)


@pytest.fixture(scope="module")
def transformer_runs(tmp_path_factory):
    """The transformer and the MLP for 6 steps under fsdp and under ddp (the harness, 2
    ranks): by "transformer-fsdp" and so on, (run directory, what the headless console
    prints for it)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    runs = {}
    for kind in ("transformer", "mlp"):
        for strategy in ("fsdp", "ddp"):
            name = f"{kind}-{strategy}"
            # pinned_env: a module's fixture starts before no_gpu_machine pins the hardware
            run = run_engine(tmp, profile(tmp, strategy, kind=kind), ranks=2,
                             runs_dir=tmp / name, env=pinned_env())  # fmt: skip
            runs[name] = (run, headless_text(run))
    return runs


def test_fsdp_shards_the_transformers_blocks_and_trains_as_ddp_does(transformer_runs):
    (run, stdout), (ddp, _) = (transformer_runs[f"transformer-{s}"] for s in ("fsdp", "ddp"))
    start = events_of(run, "start")[0]
    assert start["strategy"] == "fsdp" and start["ddp"] is None
    assert start["fsdp"]["sharded_blocks"] == 2 and not start["fsdp"]["root_only"]
    assert start["fsdp"]["reshard_after_forward"] is True
    assert events_of(ddp, "start")[0]["strategy"] == "ddp"
    assert "fsdp (2 blocks + root)" in stdout
    assert len(losses(run)) == 6 and close(losses(run), losses(ddp))
    # The eval set splits 17/16 over the ranks: 2 eval batches on rank 0, 1 on rank 1, yet the
    # eval ends (evaluate.py levels them) and agrees with DDP's.
    (ev,), (ev_ddp,) = events_of(run, "eval"), events_of(ddp, "eval")
    assert math.isclose(ev["loss"], ev_ddp["loss"], rel_tol=REL)
    assert ev["accuracy"] == ev_ddp["accuracy"]


def test_a_resume_cannot_change_the_strategy(transformer_runs, procs, tmp_path):
    run, _ = transformer_runs["transformer-fsdp"]
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    result = procs.cli(
        "run", "--resume", str(run), "--headless", "--set", "train.max_steps=8",
        "--set", "distributed.strategy=ddp", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "distributed.strategy" in line and "start a new run" in line
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before


@pytest.mark.torch_floor
def test_the_mlp_without_a_blocks_hook_is_sharded_at_its_root_and_trains_as_ddp_does(
    transformer_runs,
):
    (run, stdout), (ddp, _) = (transformer_runs[f"mlp-{s}"] for s in ("fsdp", "ddp"))
    fsdp = events_of(run, "start")[0]["fsdp"]
    assert fsdp["root_only"] and fsdp["sharded_blocks"] == 0
    assert "fsdp (root only)" in stdout
    assert len(losses(run)) == 6 and close(losses(run), losses(ddp))


def test_the_dry_run_says_what_fsdp_would_shard(procs, tmp_path):
    result = procs.cli(
        "run", str(profile(tmp_path, "fsdp")), "--dry-run",
        "--set", "distributed.fsdp_reshard_after_forward=false", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.split(None, 1) for line in result.stdout.splitlines()]
    assert ["strategy", "fsdp (2 blocks + root, kept gathered after forward)"] in rows


def test_an_fsdp_checkpoint_is_sharded_and_named_only_when_complete(transformer_runs):
    run, _ = transformer_runs["transformer-fsdp"]
    ckpts = run / "checkpoints"
    (ckpt,) = [p for p in ckpts.iterdir() if p.name.startswith("step-")]
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "state.pt"]
    assert json.loads((ckpt / "meta.json").read_text())["strategy"] == "fsdp"
    assert (ckpts / "LATEST").read_text().strip() == ckpt.name == "step-00000006"
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # no temporary left
    (event,) = events_of(run, "checkpoint")
    total = sum(p.stat().st_size for p in ckpt.iterdir())
    assert event["sharded"] is True and event["bytes"] == total
    assert [c["bytes"] for c in list_checkpoints(run)] == [total]  # the console's figure


def test_an_fsdp_checkpoint_exports_to_a_plain_state_dict(transformer_runs, tmp_path):
    run, _ = transformer_runs["transformer-fsdp"]
    out = tmp_path / "weights.pt"
    procs = Procs(tmp_path / "runs")
    try:
        result = procs.cli("export", str(run), "--out", str(out), cwd=tmp_path)
    finally:
        procs.cleanup()
    assert result.returncode == 0, result.stdout + result.stderr
    # Plain torch, no gpu-console: the file loads into the bare model, strictly.
    code = (
        "import sys, torch\n"
        "from gpu_console.tasks.configs import TransformerConfig\n"
        "from gpu_console.tasks.transformer import Encoder\n"
        "m = Encoder(TransformerConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16))\n"
        "sd = torch.load(sys.argv[1], weights_only=True)\n"
        "m.load_state_dict(sd, strict=True)\n"
        "print(sorted(sd)[0], float(sum(v.float().abs().sum() for v in sd.values())))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=cli_env()
    )
    assert loaded.returncode == 0, loaded.stderr
    weights = torch.load(out, weights_only=True)
    assert all(type(v) is torch.Tensor for v in weights.values())  # no DTensor left
    assert "blocks.0.qkv.weight" in weights and "head.weight" in weights


STOPS_ITSELF = """
from gpu_console.events import append_control
from gpu_console.tasks.transformer import TransformerTask


class StopsAt4(TransformerTask):
    def on_step_end(self, model, output, ctx):
        if ctx.step == 4 and ctx.rank == 0:
            append_control(ctx.run_dir, "stop")
"""


@pytest.mark.torch_floor
def test_fsdp_stop_and_resume_continue_bit_for_bit_and_resume_on_one_rank(tmp_path):
    steps = 12
    prof = profile(tmp_path, "fsdp", steps)
    evals_every_step = prof.read_text().replace(f"eval_every = {steps}", "eval_every = 1")
    prof.write_text(evals_every_step)  # evals draw no random numbers
    whole = run_engine(tmp_path, prof, ranks=2, runs_dir=tmp_path / "w")
    expected = losses(whole)
    evals = {e["step"]: e["loss"] for e in events_of(whole, "eval")}
    assert len(expected) == steps and len(evals) == steps

    # The engine's half of a stop and a resume (the process tree's: test_engine.py): the
    # stop command is appended while the run trains, as `gpu-console stop` appends it.
    (tmp_path / "stops_tf.py").write_text(STOPS_ITSELF)
    stopping = prof.read_text().replace('kind = "transformer"', 'kind = "stops_tf:StopsAt4"')
    runs = tmp_path / "s"
    run = run_engine(tmp_path, stopping, "train.eval_every=0", ranks=2, runs_dir=runs,
                     name="stopping")  # fmt: skip
    assert events_of(run, "status")[-1]["state"] == "stopped"
    stopped_at = events_of(run, "checkpoint")[-1]["step"]
    assert 4 <= stopped_at < steps and events_of(run, "eval") == []
    one_rank = tmp_path / "one" / run.name
    shutil.copytree(run, one_rank)

    run_engine(tmp_path, None, ranks=2, resume=run, runs_dir=runs)
    assert events_of(run, "status")[-1]["state"] == "finished"
    assert losses(run) == expected  # every step, bit for bit the uninterrupted run's

    # The 2 ranks' shards, loaded on 1 rank (DCP reshards): its eval at the resumed step is
    # the uninterrupted run's there (one rank sums the same samples in another order).
    run_engine(tmp_path, None, "train.eval_at_start=true", ranks=1, resume=one_rank,
               runs_dir=one_rank.parent)  # fmt: skip
    assert "resumed on 1 ranks from 2: RNG reseeded" in headless_text(one_rank)
    (start,) = events_of(one_rank, "start")[-1:]
    assert start["world_size"] == 1 and start["start_step"] == stopped_at
    first = next(e for e in events_of(one_rank, "eval") if e["t"] >= start["t"])
    assert first["step"] == stopped_at
    assert math.isclose(first["loss"], evals[stopped_at], rel_tol=REL)
    assert events_of(one_rank, "status")[-1]["state"] == "finished"


SHARDED_GAN = """
import os

import torch
import torch.distributed as dist

import gan_task
from gan_task import GanStepTask


def same_on_every_rank(model):
    flat = torch.cat([q.detach().full_tensor().reshape(-1) for q in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    if not all(torch.equal(every[0], other) for other in every[1:]):
        raise AssertionError("the ranks' weights differ")


# The gathered weights (shards differ); a rank's process only, as above.
if "RANK" in os.environ:
    gan_task._same_on_every_rank = same_on_every_rank


class ShardedGan(GanStepTask):
    def blocks(self, model):
        return [model.g, model.d]
"""


def test_a_tasks_own_gan_step_runs_on_the_sharded_model(tmp_path):
    # train_step calls the generator and the discriminator directly, not the root's forward.
    (tmp_path / "gan_task.py").write_text((Path(__file__).parent / "gan_task.py").read_text())
    (tmp_path / "sharded_gan.py").write_text(SHARDED_GAN)
    prof = profile(tmp_path, "fsdp", steps=4)
    prof.write_text(
        prof.read_text()
        .replace('kind = "transformer"', 'kind = "sharded_gan:ShardedGan"')
        .replace(TRANSFORMER, "")
        .replace("max_steps = 4", "max_steps = 4\ngrad_accum = 2")
    )
    run = run_engine(tmp_path, prof, ranks=2)
    assert events_of(run, "start")[0]["train_step"] == "task"
    steps = events_of(run, "step")
    assert len(steps) == 4 and set(steps[-1]["grad_norms"]) == {"d", "g"}
    assert all(math.isfinite(s["grad_norms"]["d"]) and s["grad_norms"]["d"] > 0 for s in steps)
    assert events_of(run, "eval")  # the root's forward, after the blocks ran on their own


def test_a_non_finite_loss_stops_an_fsdp_run_at_its_last_finite_state(tmp_path):
    # The deferred check: the verdict gates the fused optimizer's update on the device,
    # sharded parameters and all; the loop rewinds to step 4 and checkpoints it, sharded.
    prof = task_profile(tmp_path, "poisoned", POISONED_TASK, "Poisoned", max_steps=12, ranks=2)
    prof.write_text(prof.read_text() + '[distributed]\nstrategy = "fsdp"\n')
    run = run_engine(tmp_path, prof, "train.log_every=3", ranks=2, runs_dir=tmp_path / "r",
                     env={ENV: "deferred"})  # fmt: skip
    # The engine's end (the supervisor takes its reason as the failure's summary).
    ended = events_of(run, "status")[-1]
    assert ended["state"] == "failed"
    assert "loss is nan in step 5 (train.nan_policy = 'stop')" in ended["reason"]
    assert "checkpoint step-00000004 holds the last finite state" in ended["reason"]
    ckpt = run / "checkpoints" / "step-00000004"
    assert (ckpt / ".metadata").is_file()
    weights = subprocess.run(
        [sys.executable, "-m", "gpu_console", "export", str(run), "--out", str(tmp_path / "w.pt")],
        capture_output=True, text=True, env=cli_env(), cwd=tmp_path,
    )  # fmt: skip
    assert weights.returncode == 0, weights.stderr
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(bool(torch.isfinite(v).all()) for v in state.values())


# Rank 1's shards stop fitting on its disk from the second checkpoint on.
FULL_SHARD_DISK = """
import errno
import os

from torch.distributed.checkpoint import FileSystemWriter
from gpu_console.tasks.mlp import MLPTask

_write = FileSystemWriter.write_data
writes = 0


def full(self, plan, planner):
    global writes
    writes += 1
    if os.environ["RANK"] == "1" and writes > 1:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _write(self, plan, planner)


# A rank's process only: the launch imports the task in its own to check it (the
# harness: in the pytest worker, which must not keep the patch for later tests).
if "RANK" in os.environ:
    FileSystemWriter.write_data = full


class FullShardDisk(MLPTask):
    pass
"""


def test_one_ranks_failed_shard_write_leaves_latest_on_the_complete_checkpoint(tmp_path):
    prof = task_profile(
        tmp_path, "fullshard", FULL_SHARD_DISK, "FullShardDisk", max_steps=12, ranks=2
    )
    prof.write_text(
        prof.read_text() + '[checkpoint]\nevery_steps = 5\n[distributed]\nstrategy = "fsdp"\n'
    )
    run = run_engine(tmp_path, prof, ranks=2)
    assert events_of(run, "status")[-1]["state"] == "finished"
    failed = [e["checkpoint_failed"] for e in events_of(run, "log") if e.get("checkpoint_failed")]
    assert [(f["step"], f["latest"]) for f in failed] == [
        (10, "step-00000005"),
        (12, "step-00000005"),
    ]
    assert "no space left on " in failed[0]["error"]
    ckpts = run / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step-00000005"
    # No debris: the readers' hold file (runs.HOLD, made by the pruning) is no checkpoint's.
    left = sorted(p.name for p in ckpts.iterdir() if p.name != HOLD)
    assert left == ["LATEST", "step-00000005"]


def test_bad_fsdp_values_are_one_line_exit_2(procs, tmp_path):
    prof = profile(tmp_path, "fsdp")
    for key, value in (("strategy", "zero3"), ("fsdp_cpu_offload", "maybe")):
        result = procs.cli(
            "run", str(prof), "--headless", "--runs-dir", str(tmp_path / "r"),
            "--set", f"distributed.{key}={value}",
        )  # fmt: skip
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert f"distributed.{key}" in line and "Traceback" not in result.stderr
        assert not (tmp_path / "r").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text(prof.read_text().replace('strategy = "fsdp"', 'strategy = "zero"'))
    result = procs.cli("run", str(bad), "--headless", "--runs-dir", str(tmp_path / "r"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "bad.toml" in line and "distributed.strategy" in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_on_gpu_0_trains_in_mixed_precision_and_resumes(procs, tmp_path, precision):
    """The CUDA path: FSDP's mixed-precision policy (and fp16's sharded GradScaler), NCCL,
    sharded checkpoints written from GPU memory, and a resume."""
    few = ["--set", "train.max_steps=20", "--set", "train.warmup_steps=5"]
    result = procs.cli(
        "run", "transformer", "--headless", "--devices", "0", "--runs-dir", str(tmp_path / "r"),
        "--precision", precision, "--set", "distributed.strategy=fsdp", *few, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(tmp_path / "r")
    start = events_of(run, "start")[0]
    assert start["device_type"] == "cuda" and start["precision"] == precision
    assert start["fsdp"]["param_dtype"] == precision and start["fsdp"]["sharded_blocks"] == 2
    steps = events_of(run, "step")
    assert all(math.isfinite(s["loss"]) for s in steps) and steps[-1]["step"] == 20
    ckpt = run / "checkpoints" / "step-00000020"
    assert (ckpt / ".metadata").is_file() and (ckpt / "__0_0.distcp").is_file()
    again = procs.cli(
        "run", "--resume", str(run), "--headless", "--set", "train.max_steps=30", cwd=tmp_path
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert events_of(run, "step")[-1]["step"] == 30
