"""``train.deterministic``: the profile rule, and what reaches every rank (2 CPU ranks, the
harness: tests/harness.py).

The GPU half (identical runs, bit-exact resume on a GPU) is tests/test_gpu_determinism.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import events_of, task_profile, write_profile
from harness import run_engine

from gpu_console.profile import NOT_DETERMINISTIC, ProfileError, load_profile

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

IN_EFFECT = {
    "enabled": True,
    "algorithms": True,
    "cublas_workspace_config": ":4096:8",
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "tf32_matmul": False,
    "tf32_cudnn": False,
}


def test_deterministic_turns_the_default_cudnn_benchmark_and_tf32_off(tmp_path):
    path = write_profile(tmp_path / "p.toml", "[train]\ndeterministic = true\n")
    prof = load_profile(str(path))
    assert prof.train.deterministic is True
    assert (prof.hardware.cudnn_benchmark, prof.hardware.tf32) == (False, False)
    # run.toml says what the run does, and loads again as the same profile.
    again = write_profile(tmp_path / "again.toml", prof.to_toml())
    assert load_profile(str(again)).hardware == prof.hardware
    # Without it, the defaults stand.
    plain = load_profile(str(write_profile(tmp_path / "q.toml", "[train]\nmax_steps = 3\n")))
    assert (plain.train.deterministic, plain.hardware.cudnn_benchmark, plain.hardware.tf32) == (
        False,
        True,
        True,
    )


@pytest.mark.parametrize("key", ["cudnn_benchmark", "tf32"])
def test_deterministic_with_an_explicit_true_is_a_profile_error(tmp_path, key):
    path = write_profile(
        tmp_path / "p.toml", f"[train]\ndeterministic = true\n[hardware]\n{key} = true\n"
    )
    with pytest.raises(ProfileError) as e:
        load_profile(str(path))
    assert e.value.problems == [
        f"{path}: hardware.{key}: must be false with train.deterministic = true "
        f"({NOT_DETERMINISTIC[key]}) (got true)"
    ]
    # An explicit false is what deterministic mode wants: no error.
    ok = write_profile(
        tmp_path / "ok.toml", f"[train]\ndeterministic = true\n[hardware]\n{key} = false\n"
    )
    assert getattr(load_profile(str(ok)).hardware, key) is False


def test_the_conflict_from_set_is_blamed_on_set_and_nothing_is_written(procs, runs_dir, tmp_path):
    profile = write_profile(tmp_path / "p.toml", "[train]\nmax_steps = 3\n")
    result = procs.cli(
        "run", str(profile), "--headless", "--devices", "cpu:1", "--runs-dir", str(runs_dir),
        "--set", "train.deterministic=true", "--set", "hardware.tf32=true",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "gpu-console: --set: hardware.tf32: must be false with train.deterministic = true"
    ), lines
    assert "Traceback" not in result.stderr
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


# Every rank writes what it runs with, from inside the task (after the engine's setup).
PROBE = """
import json
import os
from pathlib import Path

import torch

from gpu_console.tasks.mlp import MLPTask


class Probe(MLPTask):
    def build_model(self):
        if "RANK" not in os.environ:  # the launch's data count, not a rank
            return super().build_model()
        Path(os.environ["PROBE_DIR"], f"rank-{os.environ['RANK']}.json").write_text(
            json.dumps(
                {
                    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                    "algorithms": torch.are_deterministic_algorithms_enabled(),
                    "cudnn_benchmark": torch.backends.cudnn.benchmark,
                }
            )
        )
        return super().build_model()
"""


def test_every_rank_runs_deterministic_and_the_start_event_says_so(tmp_path, monkeypatch):
    profile = task_profile(tmp_path, "probe", PROBE, "Probe", max_steps=3, ranks=2)
    probes = tmp_path / "probes"
    probes.mkdir()
    env = {"PROBE_DIR": str(probes)}
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the engine's to set
    run = run_engine(tmp_path, profile, "train.deterministic=true", ranks=2,
                     runs_dir=tmp_path / "a", env=env)  # fmt: skip
    start = events_of(run, "start")[0]
    assert start["world_size"] == 2
    assert start["deterministic"] == IN_EFFECT
    ranks = {p.name: json.loads(p.read_text()) for p in probes.iterdir()}
    assert ranks == {
        f"rank-{r}.json": {"cublas": ":4096:8", "algorithms": True, "cudnn_benchmark": False}
        for r in (0, 1)
    }
    # Two deterministic runs on CPU: the same losses (as without it, on CPU).
    other = run_engine(tmp_path, run / "run.toml", ranks=2, runs_dir=tmp_path / "b", env=env)
    losses = [[e["loss"] for e in events_of(r, "step")] for r in (run, other)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert events_of(other, "start")[0]["deterministic"] == IN_EFFECT
