"""The default suite pins the hardware it sees (conftest.no_gpu_machine), and the pins hold where
NVML sees GPUs: the run a test starts with ``--devices cpu:2`` trains on the CPU there too."""

from __future__ import annotations

import json
import os

from conftest import REHEARSAL_SITE, events_of, only_run
from conftest import test_env as cli_env
from test_telemetry_fake import FakeNvml, install

from gpu_console import launch
from gpu_console.telemetry import nvml


def gpu_machine_env() -> dict[str, str]:
    """The environment of a process that sees one (fake) GPU through NVML."""
    rest = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(REHEARSAL_SITE), rest) if p)
    return cli_env(GPU_CONSOLE_TEST_GPUS="1", PYTHONPATH=path)


def test_a_test_sees_no_gpu_unless_it_asks(tmp_path):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert cli_env()["CUDA_VISIBLE_DEVICES"] == "", "the processes a test starts inherit it"
    assert not nvml.status().available and nvml.device_count() == 0
    _, placement, _ = launch.prepare("quickstart", runs_dir=tmp_path / "runs")
    assert placement.device_type == "cpu"


def test_auto_would_take_the_gpu_and_cpu_2_does_not(tmp_path, monkeypatch):
    """Why a test that launches a run passes --devices: "auto" follows NVML."""
    install(monkeypatch, FakeNvml(1))
    _, auto, _ = launch.prepare("quickstart", runs_dir=tmp_path / "runs")
    assert (auto.device_type, auto.cuda_visible_devices) == ("cuda", "0")
    _, pinned, _ = launch.prepare("quickstart", devices="cpu:2", runs_dir=tmp_path / "runs")
    assert (pinned.device_type, pinned.nproc) == ("cpu", 2)


def test_a_pinned_run_trains_on_the_cpu_where_nvml_sees_a_gpu(procs, runs_dir):
    env = gpu_machine_env()
    seen = json.loads(procs.cli("devices", "--json", env=env).stdout)
    assert [g["name"] for g in seen["gpus"]] == ["NVIDIA A100-SXM4-80GB"], "the fake GPU"

    result = procs.cli(
        "run", "quickstart", "--headless", "--devices", "cpu:2", "--runs-dir", str(runs_dir),
        "--set", "train.max_steps=10", "--set", "train.warmup_steps=2", env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["placement"]["device_type"] == "cpu"
    start = events_of(run, "start")[0]
    assert (start["device_type"], start["world_size"], start["backend"]) == ("cpu", 2, "gloo")
