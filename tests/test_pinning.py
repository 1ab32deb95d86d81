"""The default suite pins the hardware it sees (conftest.no_gpu_machine), and the pins hold where
NVML sees GPUs: the run a test starts with ``--devices cpu:2`` trains on the CPU there too."""

from __future__ import annotations

import json
import os

import psutil
from conftest import (
    MACHINE_FAKE,
    REHEARSED_GPUS,
    TESTS,
    events_of,
    only_run,
    paced_profile,
    read_status,
    the_run,
    wait_for,
)
from conftest import test_env as cli_env
from test_telemetry_fake import FakeNvml, install, install_torch_build

from gpu_console import launch
from gpu_console.telemetry import nvml


def gpu_machine_env() -> dict[str, str]:
    """The environment of a process that sees one (fake) GPU through NVML."""
    assert os.environ["GPU_CONSOLE_FAKE_NVML"] == MACHINE_FAKE
    return cli_env(GPU_CONSOLE_TEST_GPUS="1")


def test_a_test_sees_no_gpu_unless_it_asks(tmp_path):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert cli_env()["CUDA_VISIBLE_DEVICES"] == "", "the processes a test starts inherit it"
    assert not nvml.status().available and nvml.device_count() == 0
    _, placement, _ = launch.prepare("quickstart", runs_dir=tmp_path / "runs")
    assert placement.device_type == "cpu"


def test_the_processes_a_test_starts_see_no_gpu_either(procs, runs_dir, tmp_path):
    """The CLI's NVML is the fake without a driver, and every process of a run (supervisor,
    torchrun, ranks) starts with the same fake and with no GPU for torch."""
    seen = json.loads(procs.cli("devices", "--json").stdout)
    if not REHEARSED_GPUS:
        assert seen["gpus"] == [] and seen["nvml"]["reason"].startswith("NVML library not found")
    profile = paced_profile(tmp_path, max_steps=10_000, devices="auto")
    procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir),
        cwd=tmp_path, env=cli_env(PACE_S="0.05"),
    )  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    pids = wait_for(
        lambda: read_status(run).get("pids", {}).get("workers") and read_status(run)["pids"],
        what="the pids",
    )
    for pid in [pids["supervisor"], pids["torchrun"], *pids["workers"]]:
        env = psutil.Process(pid).environ()
        assert env["GPU_CONSOLE_TEST_GPUS"] == str(REHEARSED_GPUS), pid
        assert env["GPU_CONSOLE_FAKE_NVML"] == MACHINE_FAKE, pid
        assert str(TESTS) in env["PYTHONPATH"].split(os.pathsep), pid
        assert env["CUDA_VISIBLE_DEVICES"] == "", pid
    if not REHEARSED_GPUS:  # "auto" with no GPU in NVML's view: the CPU
        assert json.loads((run / "meta.json").read_text())["placement"]["device_type"] == "cpu"
    assert procs.cli("stop", str(run), "--now", "--runs-dir", str(runs_dir)).returncode == 0


def test_auto_would_take_the_gpu_and_cpu_2_does_not(tmp_path, monkeypatch):
    """Why a test that launches a run passes --devices: "auto" follows NVML (on a CUDA torch,
    with nothing restricting the GPUs: the pin's empty CUDA_VISIBLE_DEVICES grants none)."""
    fake = install(monkeypatch, FakeNvml(1))
    install_torch_build(monkeypatch, tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _, auto, _ = launch.prepare("quickstart", runs_dir=tmp_path / "runs")
    assert (auto.device_type, auto.cuda_visible_devices) == ("cuda", fake.gpus[0].uuid)
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
