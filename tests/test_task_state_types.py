"""A task's state must be what a resume reads back (``torch.load(weights_only=True)``).

A numpy number in it (``self.best = np.mean(losses)``) used to make checkpoints that failed
only at the resume; it is saved as the Python number it holds. What a resume could not read
back fails the checkpoint that would hold it, naming where in the state it is. The engine in
the harness (one rank in this process).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import events_of, fast_profile
from harness import run_engine

from gpu_console.engine.hooks import saveable

pytestmark = pytest.mark.quick

TASK = '''
import json

import numpy as np

from gpu_console.tasks.mlp import MLPTask


class NumpyState(MLPTask):
    """Carries a best loss and a count as numpy numbers (or, with HOLD_ARRAY, an array)."""

    def __init__(self, config):
        super().__init__(config)
        self.best, self.count = np.float64(1e9), np.int64(0)

    def compute(self, model, batch):
        out = super().compute(model, batch)
        if model.training:
            self.best = min(self.best, np.float64(out.loss.item()))
            self.count += 1
        return out

    def state_dict(self):
        import os
        state = {"best": self.best, "count": self.count, "flags": [np.bool_(True)]}
        if os.environ.get("HOLD_ARRAY"):
            state["history"] = np.zeros(3)
        return state

    def load_state_dict(self, state):
        (self.ctx.task_dir / "restored.json").write_text(json.dumps(
            {k: [type(v).__name__, v] for k, v in state.items() if k != "flags"}
            | {"flags": [type(state["flags"][0]).__name__]}
        ))
        self.best, self.count = state["best"], state["count"]
'''


def task_profile(tmp_path: Path) -> Path:
    (tmp_path / "numpy_state.py").write_text(TASK)
    extra = "[checkpoint]\nevery_steps = 3\n"
    profile = fast_profile(tmp_path, name="numpy-state", max_steps=6, extra=extra)
    profile.write_text(profile.read_text().replace('"mlp"', '"numpy_state:NumpyState"'))
    return profile


def test_numpy_numbers_in_the_state_resume_as_python_numbers(tmp_path):
    profile = task_profile(tmp_path)
    run = run_engine(tmp_path, profile, "train.max_steps=3")
    assert events_of(run, "status")[-1]["state"] == "finished"
    run_engine(tmp_path, None, "train.max_steps=6", resume=run)
    assert events_of(run, "status")[-1]["state"] == "finished"
    restored = json.loads((run / "task" / "restored.json").read_text())
    first = {e["step"]: e["loss"] for e in events_of(run, "step") if e["step"] <= 3}
    assert restored["count"] == ["int", 3]
    assert restored["best"][0] == "float"
    assert restored["best"][1] == pytest.approx(min(first.values()), rel=1e-6)
    assert restored["flags"] == ["bool"]


def test_a_state_a_resume_could_not_read_fails_its_checkpoint_naming_the_key(tmp_path):
    profile = task_profile(tmp_path)
    with pytest.raises(TypeError) as caught:
        run_engine(tmp_path, profile, env={"HOLD_ARRAY": "1"})
    assert "state_dict()['history'] (numpy.ndarray)" in str(caught.value)
    assert "torch.from_numpy" in str(caught.value)
    run = next((tmp_path / "runs").iterdir())
    assert not list((run / "checkpoints").glob("step-*"))


def test_saveable_keeps_what_loads_and_names_the_path_of_what_does_not():
    state = {
        "t": torch.ones(2),
        "n": [np.float32(0.5), np.int8(-3), np.array(2.5), None, "x", torch.float16],
        "pair": (1, np.uint16(7)),
    }
    kept = saveable(state, "state_dict()")
    assert kept["n"][:3] == [0.5, -3, 2.5] and [type(v) for v in kept["n"][:3]] == [
        float,
        int,
        float,
    ]
    assert kept["pair"] == (1, 7) and kept["n"][3:] == [None, "x", torch.float16]
    with pytest.raises(TypeError, match=r"state_dict\(\)\['n'\]\[2\] \(slice\)"):
        saveable({"n": [1, 2, slice(3)]}, "state_dict()")
