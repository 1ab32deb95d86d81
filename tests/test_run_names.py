"""A run's own name and its profile's are two things (issue 42, point 7): ``--name`` names the
run (its directory, meta.json's ``name``) and run.toml's ``[profile] name`` stays the profile's,
so ``ls --profile`` finds named runs and ``diff`` does not see ``--name`` as a difference. Run
directories are made as ``gpu-console run`` makes them (``harness.launch_dir``), with no
engine: what is read here is what the launch wrote."""

from __future__ import annotations

import json

import pytest
from conftest import fast_profile
from harness import launch_dir

from gpu_console import launch, runs
from gpu_console.commands.diff import profile_changes
from gpu_console.commands.runs import list_runs
from gpu_console.commands.select import select
from gpu_console.toml_text import loads

pytestmark = pytest.mark.quick


def _launch(tmp_path, name=None, sets=()):
    profile = fast_profile(tmp_path, max_steps=2)
    return launch_dir(profile, list(sets), 1, None, name, tmp_path / "runs", tmp_path)


def test_the_name_is_kept_apart_from_the_profile_name(tmp_path):
    named = _launch(tmp_path, name="my run")
    plain = _launch(tmp_path)
    assert named.name.startswith("my-run-")
    assert loads((named / "run.toml").read_text())["profile"]["name"] == "fast"
    assert json.loads((named / "meta.json").read_text())["name"] == "my run"
    assert json.loads((plain / "meta.json").read_text())["name"] == "fast"
    # The name the user gave finds the run; --name is no difference between the profiles.
    assert runs.find_run("my run", tmp_path / "runs") == named
    assert profile_changes(named, plain) == []
    rows = select(list_runs(tmp_path / "runs"), profile="fast")
    assert sorted(r["path"] for r in rows) == sorted([str(named), str(plain)])
    assert {r["path"]: r["run_name"] for r in rows}[str(named)] == "my run"
    assert [r["path"] for r in select(rows, profile="my run")] == [str(named)]


def test_a_resumed_run_keeps_its_name_and_its_profile_name(tmp_path):
    named = _launch(tmp_path, name="my run")
    # As a finished run at step 2 with its checkpoint: a resume needs one to start from.
    ckpt = named / "checkpoints" / "step-00000002"
    ckpt.mkdir()
    (ckpt / "state.pt").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip: "loadable"
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "reason": "end", "t": 1.0}))
    (named / "checkpoints" / "LATEST").write_text("step-00000002\n")
    runs.write_status(named, {"state": "finished", "ended": 1.0, "step": 2, "exit_code": 0})
    resumed = launch_dir(None, ["train.max_steps=4"], 1, named, None, tmp_path / "runs", tmp_path)
    assert resumed == named
    assert loads((named / "run.toml").read_text())["profile"]["name"] == "fast"
    assert json.loads((named / "meta.json").read_text())["name"] == "my run"
    with pytest.raises(launch.LaunchError, match="under its own name .my run."):
        launch_dir(None, [], 1, named, "other", tmp_path / "runs", tmp_path)


def test_a_run_from_before_keeps_its_name_from_run_toml(tmp_path):
    # Launched before meta.json kept the name: --name overwrote run.toml's [profile] name.
    run = _launch(tmp_path, name="my run")
    meta = json.loads((run / "meta.json").read_text())
    del meta["name"]
    (run / "meta.json").write_text(json.dumps(meta))
    toml = (run / "run.toml").read_text().replace('name = "fast"', 'name = "my run"', 1)
    (run / "run.toml").write_text(toml)
    assert runs.given_name(run) == "my run"
    assert launch.resumed_name(run) == "my run"
    assert runs.find_run("my run", tmp_path / "runs") == run
