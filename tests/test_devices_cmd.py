"""``gpu-console devices [--json]``: through Typer's runner (fake NVML) and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pynvml as real
import pytest
from conftest import REPO
from conftest import test_env as cli_env
from test_telemetry_fake import GIB, FakeNvml, assert_gpu_json, install
from typer.testing import CliRunner

from gpu_console.cli import app

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

runner = CliRunner()


def devices(*args: str):
    result = runner.invoke(app, ["devices", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def test_no_driver_says_why_and_shows_the_cpu_fallback(monkeypatch):
    install(monkeypatch, FakeNvml(init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND))
    result = devices()
    assert result.exit_code == 0
    assert "NVML unavailable: NVML library not found (no NVIDIA driver on this machine)." in (
        result.output
    )
    assert "runs use the CPU" in result.output
    assert "cores" in result.output and "GiB" in result.output

    doc = json.loads(devices("--json").output)
    assert doc["gpus"] == []
    assert doc["nvml"]["available"] is False
    assert doc["nvml"]["reason"] == "NVML library not found (no NVIDIA driver on this machine)"
    assert doc["host"]["cores"] >= 1 and doc["host"]["ram_total"] > 0


@pytest.mark.parametrize("n", [0, 1, 2, 8])
def test_json_shape_for_every_gpu_count(monkeypatch, n):
    fake = install(monkeypatch, FakeNvml(n))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing restricts the GPUs: all are yours
    result = devices("--json")
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert set(doc) == {"gpus", "grant", "nvml", "host"}
    assert doc["grant"] == {
        "source": None, "value": None, "gpus": list(range(n)), "mig": [], "problem": None
    }  # fmt: skip
    assert doc["nvml"] == {
        "available": True,
        "reason": "",
        "driver_version": "550.54.15",
        "cuda_driver_version": "12.4",
        "device_count": n,
    }
    assert {"cores", "physical_cores", "cpu_percent", "ram_total", "ram_used"} <= set(doc["host"])
    assert len(doc["gpus"]) == n
    for gpu, fake_gpu in zip(doc["gpus"], fake.gpus, strict=True):
        assert_gpu_json(gpu, fake_gpu)
        assert isinstance(gpu["busy"], bool) and isinstance(gpu["busy_reasons"], list)
        assert gpu["yours"] is True

    table = devices()
    assert table.exit_code == 0
    if n == 0:
        assert "NVML works but sees no GPU" in table.output
    else:
        assert f"{n} GPU" in table.output and "driver 550.54.15, CUDA 12.4" in table.output
        rows = [line for line in table.output.splitlines() if line[3:7] in ("free", "busy")]
        assert len(rows) == n
        for row, g in zip(rows, fake.gpus, strict=True):
            assert row.startswith(f"{g.index:>2} ") and "A100-SXM4-80GB" in row
            assert f"{g.temperature}°C" in row and f"{g.power_mw / 1000:.0f}/400 W" in row


def test_busy_gpus_are_marked_so_free_ones_can_be_picked(monkeypatch):
    fake = install(monkeypatch, FakeNvml(4))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing restricts the GPUs: all are yours
    for g in fake.gpus:
        g.util_gpu = 0
    fake.gpus[0].processes = [(4242, 10 * GIB)]
    fake.gpus[0].memory_used = 11 * GIB
    fake.gpus[1].util_gpu = 97
    fake.gpus[2].memory_used = 40 * GIB  # held by a process in another container
    fake.gpus[3].memory_used = 500 << 20  # the driver's own reserve: still free
    doc = json.loads(devices("--json").output)
    busy = [(g["index"], g["busy"], g["busy_reasons"]) for g in doc["gpus"]]
    assert busy == [
        (0, True, ["1 process", "memory 14%"]),
        (1, True, ["util 97%"]),
        (2, True, ["memory 50%"]),
        (3, False, []),
    ]
    text = devices().output
    lines = text.splitlines()
    assert lines[0] == "NVIDIA driver 550.54.15, CUDA 12.4, 4 GPUs"
    assert lines[1].startswith(" 0 busy  A100-SXM4-80GB  [█░░░░░░░░░] 11.0/80.0 GiB")
    assert lines[2].strip() == "memory 14%; pids 4242 (10.0 GiB)"
    assert lines[3].startswith(" 1 busy") and lines[4].strip() == "util 97%"
    assert lines[5].startswith(" 2 busy") and lines[6].strip() == "memory 50%"
    assert lines[7].startswith(" 3 free  A100-SXM4-80GB  [░░░░░░░░░░]  0.5/80.0 GiB")
    assert lines[8].startswith("host: ")


def test_unsupported_readings_and_a_lost_gpu(monkeypatch):
    fake = install(monkeypatch, FakeNvml(2))
    fake.gpus[0].unsupported = {
        "nvmlDeviceGetFanSpeed",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetComputeRunningProcesses",
    }
    fake.gpus[1].lost = True
    result = devices("--json")
    assert result.exit_code == 0
    gpu0, gpu1 = json.loads(result.output)["gpus"]
    assert gpu0["fan_percent"] is None and gpu0["power_w"] is None and gpu0["processes"] is None
    assert gpu0["temperature_c"] == 35
    assert gpu1["lost"] is True and gpu1["busy"] is True
    assert gpu1["busy_reasons"] == ["lost: the GPU stopped answering"]
    table = devices()
    assert table.exit_code == 0 and "Traceback" not in table.output
    lines = table.output.splitlines()
    assert lines[1].endswith("n/a") and lines[2].strip() == "processes n/a"
    assert lines[3].startswith(" 1 lost") and "needs a GPU reset" in lines[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_subprocess_json_on_this_machine(real_machine):
    proc = _cli("-m", "gpu_console", "devices", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"gpus", "grant", "nvml", "host"}
    assert doc["host"]["cores"] >= 1
    if not doc["nvml"]["available"]:  # this machine and CI: no driver
        assert doc["gpus"] == []
        assert doc["nvml"]["reason"]
    assert proc.stderr == ""


def test_subprocess_table_says_plainly_why_and_never_imports_torch(real_machine):
    proc = _cli("-X", "importtime", "-m", "gpu_console", "devices")
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "pynvml" in imported
    if "NVML unavailable" in proc.stdout:
        assert "runs use the CPU" in proc.stdout and "cores" in proc.stdout
    else:
        assert "GPU" in proc.stdout
