"""A clean run prints no warning: not in the console's output, not in any file of its logs/.

The ranks run inside torchrun, where pytest's ``filterwarnings`` (pyproject: a Deprecation- or
FutureWarning raised from gpu_console code fails the suite) does not reach: reading every log
file of a real run is what covers them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import only_run
from torch.nn.parallel import DistributedDataParallel as DDP

from gpu_console.engine import distributed as distmod
from gpu_console.profile import DistributedConfig


def warning_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Warning" in line]


def assert_no_warning(run: Path, stdout: str, stderr: str) -> None:
    assert warning_lines(stdout + stderr) == []
    logs = sorted(p for p in (run / "logs").rglob("*") if p.is_file())
    # torchrun's own log, the supervisor's, and each rank's stdout and stderr.
    assert len([p for p in logs if p.name == "stderr.log"]) == 2, logs
    found = {str(p): warning_lines(p.read_text(errors="replace")) for p in logs}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_a_clean_quickstart_run_logs_no_warning(quickstart_run):
    """The session's quickstart run (2 ranks, 300 steps: evals and interval checkpoints on
    the way, whose code paths log too)."""
    result = quickstart_run.result
    assert_no_warning(quickstart_run.run, result.stdout, result.stderr)


def test_a_clean_transformer_run_logs_no_warning(procs, runs_dir):
    sets = ["train.max_steps=6", "train.warmup_steps=2", "train.eval_every=3"]
    result = procs.cli(
        "run", "transformer", "--headless", "--devices", "cpu:2", "--runs-dir", str(runs_dir),
        *(arg for s in sets for arg in ("--set", s)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_no_warning(only_run(runs_dir), result.stdout, result.stderr)


def test_buffer_sync_in_each_torchs_words():
    old = frozenset({"broadcast_buffers", "init_sync"})  # torch 2.11
    new = old | {"forward_sync_buffers"}  # torch 2.13: broadcast_buffers deprecated
    newer = new | {"init_sync_buffers"}
    kwargs = distmod.buffer_sync_kwargs
    assert kwargs(True, old) == {"broadcast_buffers": True}
    assert kwargs(False, old) == {"broadcast_buffers": False}
    assert kwargs(True, new) == {"forward_sync_buffers": True}
    # No init sync of buffers either, as false always meant: only the old keyword says so.
    assert kwargs(False, new) == {"broadcast_buffers": False}
    assert kwargs(False, newer) == {"forward_sync_buffers": False, "init_sync_buffers": False}


@pytest.fixture
def one_rank_group(tmp_path: Path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sync", [True, False])
def test_the_installed_torchs_ddp_takes_the_buffer_setting_without_a_warning(one_rank_group, sync):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    d = distmod.Dist(0, 1, 0, 1, torch.device("cpu"), "gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp = distmod.wrap(model, DistributedConfig(broadcast_buffers=sync), d)
    assert isinstance(ddp, DDP)
    assert ddp.broadcast_buffers is sync  # what the start event reads back (strategy_ddp.settings)
