"""``train.activation_checkpointing`` on the built-in transformer, 2 CPU ranks (the harness,
tests/harness.py; the launch's refusal through the CLI).

Recomputing activations changes what is kept, not the maths: the losses of ``blocks`` and
``selective`` are bit-identical to a run without (dropout included: the recomputation
replays the RNG). The start event carries the bytes one micro-batch holds for the backward
without and with, measured; a task that does not name its blocks is refused at launch.
"""

from __future__ import annotations

import pytest
from conftest import events_of, fast_profile, run_dirs, task_profile, write_profile
from harness import run_engine
from headless_text import headless_text

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

TINY = """
[profile]
name = "tiny"
[task]
kind = "transformer"
vocab_size = 64
seq_len = 16
d_model = 32
n_heads = 2
n_layers = 2
train_samples = 1024
eval_samples = 0
dropout = 0.1
[data]
batch_size = 16
[train]
max_steps = 5
log_every = 1
precision = "fp32"
[hardware]
devices = "cpu:2"
"""


def _run(tmp_path, mode: str):
    """(the run, what the headless console prints for it)."""
    profile = write_profile(tmp_path / "tiny.toml", TINY)
    run = run_engine(tmp_path, profile, f"train.activation_checkpointing={mode!r}", ranks=2,
                     name=mode)  # fmt: skip
    return run, headless_text(run)


def test_blocks_and_selective_train_the_same_losses_on_less_memory(tmp_path):
    runs = {mode: _run(tmp_path, mode) for mode in ("none", "blocks", "selective")}
    losses = {m: [e["loss"] for e in events_of(run, "step")] for m, (run, _) in runs.items()}
    assert len(losses["none"]) == 5
    assert losses["blocks"] == losses["none"]  # bit-identical
    assert losses["selective"] == losses["none"]

    assert events_of(runs["none"][0], "start")[0]["activation_checkpointing"] == "none"
    held = {m: events_of(runs[m][0], "start")[0]["activation_checkpointing"] for m in runs}
    for mode in ("blocks", "selective"):
        h = held[mode]
        assert h["mode"] == mode and h["blocks"] == 2
        # Measured without and with: the same model and batch, so the same "without".
        assert h["held_without"] == held["blocks"]["held_without"] > 0
        assert 0 < h["held_with"] < h["held_without"], h
        assert f"activation checkpointing: {mode}: " in runs[mode][1], runs[mode][1]
    # selective keeps the matmul outputs that blocks recomputes.
    assert held["blocks"]["held_with"] < held["selective"]["held_with"]


def test_a_task_without_blocks_is_refused_at_launch(procs, runs_dir, tmp_path):
    built_in = procs.cli(
        "run", str(fast_profile(tmp_path)), "--headless", "--runs-dir", str(runs_dir),
        "--set", "train.activation_checkpointing='blocks'", cwd=tmp_path,
    )  # fmt: skip
    assert built_in.returncode == 2, built_in.stderr
    assert "--set: train.activation_checkpointing: task 'mlp' has no blocks" in built_in.stderr

    source = "from gpu_console.tasks.mlp import MLPTask\n\n\nclass Mine(MLPTask):\n    pass\n"
    profile = task_profile(tmp_path, "mine", source, "Mine")
    user = procs.cli(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir),
        "--set", "train.activation_checkpointing='selective'", cwd=tmp_path,
    )  # fmt: skip
    assert user.returncode == 2, user.stderr
    (line,) = user.stderr.strip().splitlines()
    assert "train.activation_checkpointing: mine:Mine has no blocks(model)" in line
    assert "(docs/performance.md: Activation checkpointing)" in line  # where to read on
    assert "Traceback" not in user.stderr
    assert run_dirs(runs_dir) == []  # nothing written


def test_an_auto_batch_size_is_searched_on_the_checkpointed_model(tmp_path):
    # The search must measure the model as it will train: its blocks checkpointed first.
    profile = write_profile(tmp_path / "tiny.toml", TINY)
    run = run_engine(
        tmp_path, profile, "train.activation_checkpointing='blocks'", "data.batch_size='auto'",
        ranks=2, env={"GPU_CONSOLE_FAKE_OOM_ABOVE": "24"},
    )  # fmt: skip
    start = events_of(run, "start")[0]
    assert start["batch_size"] == 24 and start["auto_batch"]["chosen"] == 24
    held = start["activation_checkpointing"]
    assert held["mode"] == "blocks" and held["blocks"] == 2
    assert held["held_without"] is None and "before the search" in held["not_measured"]
