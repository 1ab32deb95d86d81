"""``train.precision = "fp64"``: the model and its batches in float64, and the step losses
reported as the task computed them (no float32 table on the way). 2 CPU ranks on the engine
harness (tests/harness.py)."""

from __future__ import annotations

import json

import pytest
from conftest import events_of, task_profile
from harness import run_engine

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

FLOAT64_TASK = """
import json
import os

import torch

from gpu_console.tasks.mlp import MLPTask


class Float64(MLPTask):
    def compute(self, model, batch):
        x = batch[0]
        weights = [p.dtype for p in model.parameters()]
        out = super().compute(model, batch)
        if model.training:  # a training micro-batch: its loss, as the task computed it
            record = {"x": str(x.dtype), "weights": sorted({str(w) for w in weights}),
                      "loss_dtype": str(out.loss.dtype), "loss": out.loss.item()}
            with open(f"losses-{os.environ['RANK']}.jsonl", "a") as f:
                f.write(json.dumps(record) + "\\n")
        return out
"""


def test_an_fp64_run_trains_in_float64_and_reports_its_losses_unrounded(tmp_path):
    profile = task_profile(tmp_path, "float64", FLOAT64_TASK, "Float64", max_steps=8, ranks=2)
    run = run_engine(tmp_path, profile, "train.precision=fp64", ranks=2)
    ranks = [
        [json.loads(line) for line in (tmp_path / f"losses-{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert [len(r) for r in ranks] == [8, 8]
    for rec in ranks[0] + ranks[1]:
        assert rec["x"] == rec["loss_dtype"] == "torch.float64"
        assert rec["weights"] == ["torch.float64"]
    assert events_of(run, "start")[0]["precision"] == "fp64"
    reported = [e["loss"] for e in events_of(run, "step")]
    # The mean over the ranks of the task's own float64 losses, to the last bit.
    assert reported == [(a["loss"] + b["loss"]) / 2 for a, b in zip(*ranks, strict=True)]
    assert any(float(f"{v:.7g}") != v for v in reported)  # float32 could not have carried them
