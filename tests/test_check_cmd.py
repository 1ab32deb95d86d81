"""``gpu-console check [--json]``: a real gloo all_reduce, torch in subprocesses only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pynvml as real
import pytest
from conftest import REPO, pid_alive
from conftest import test_env as cli_env
from test_telemetry_fake import FakeNvml, install
from typer.testing import CliRunner

from gpu_console.cli import app
from gpu_console.commands import check
from gpu_console.commands.check import FAIL, PASS, SKIP, WARN, run_workers

runner = CliRunner()
PY = sys.executable
# The rows a run depends on, in the order the table shows them.
NAMES = [
    "python",
    "torch",
    "cuda",
    "cudnn",
    "nccl",
    "nvml",
    "gpus",
    "bf16",
    "tf32",
    "matmul:cpu",
    "gloo",
    "collective",
    "torchrun",
    "torchrun flags",
    "rendezvous_port",
    "runs_dir",
    "disk",
    "host",
    "network env",
    "interfaces",
    "socket_ifname",
    "infiniband",
    "slurm",
]


def by_name(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


@pytest.mark.quick
def test_subprocess_json_on_this_machine_passes(tmp_path, real_machine):
    """The real check of the machine the suite runs on: a laptop or CI (GPU rows skipped) or
    a GPU node (GPU rows pass); either way nothing fails."""
    proc = subprocess.run(
        [PY, "-X", "importtime", "-m", "gpu_console", "check", "--json"]
        + ["--runs-dir", str(tmp_path / "runs")],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0, doc
    # The console itself never imported torch: the workers did.
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "gpu_console.commands.check" in imported

    # One matmul row per GPU torch sees follows matmul:cpu.
    names = [c["name"] for c in doc["checks"]]
    assert [n for n in names if not n.startswith("matmul:cuda:")] == NAMES
    assert all(set(c) == {"name", "status", "detail"} for c in doc["checks"])
    assert all(c["status"] in (PASS, WARN, FAIL, SKIP) for c in doc["checks"])
    assert all(c["detail"] and "\n" not in c["detail"] for c in doc["checks"])
    assert doc["ok"] is True and not [c for c in doc["checks"] if c["status"] == FAIL]
    rows = by_name(doc)
    assert rows["torch"]["status"] == PASS
    assert rows["gloo"]["status"] == PASS
    assert rows["matmul:cpu"]["status"] == PASS
    assert rows["collective"]["status"] == PASS
    backend = "nccl" if check.nvml.device_count() >= 2 else "gloo"
    assert rows["collective"]["detail"].startswith(
        f"{backend} all_reduce across 2 processes: correct"
    )
    assert rows["torchrun"]["status"] == PASS
    assert rows["torchrun flags"]["status"] == PASS
    assert rows["runs_dir"]["status"] == PASS and "will be created" in rows["runs_dir"]["detail"]
    if not check.nvml.status().available:  # a machine without a driver (CI)
        assert rows["nvml"] == {
            "name": "nvml",
            "status": SKIP,
            "detail": "NVML unavailable: NVML library not found (no NVIDIA driver on this machine)",
        }
        for name in ("gpus", "bf16", "tf32"):
            assert rows[name]["status"] == SKIP, rows[name]
        assert "NVML: unavailable: NVML library not found" in doc["report"]
    else:  # a GPU machine: the driver, and GPUs torch can use
        assert rows["nvml"]["status"] == PASS and rows["nvml"]["detail"].startswith("driver ")
        assert rows["cuda"]["status"] == PASS, rows["cuda"]
        assert rows["gpus"]["status"] in (PASS, WARN) and "cuda:0" in rows["gpus"]["detail"]
        assert [n for n in names if n.startswith("matmul:cuda:")], names
    assert doc["report"].startswith("gpu-console ")
    assert "checks: " in doc["report"]


def test_table_says_plainly_that_nvml_is_unavailable(tmp_path, monkeypatch):
    # No GPU for torch either (conftest pins CUDA_VISIBLE_DEVICES="" for check's workers):
    # torch using a GPU that NVML cannot see would make the nvml row a WARN.
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    install(monkeypatch, FakeNvml(init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND))
    result = runner.invoke(app, ["check", "--runs-dir", str(tmp_path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert (
        "NVML is unavailable: NVML library not found (no NVIDIA driver on this machine). "
        "GPU checks are skipped; runs use the CPU." in out
    )
    assert "Ready: no check failed." in out
    assert "Report (paste into a bug report):" in out and "```" in out
    lines = [line.split(None, 2) for line in out.splitlines() if line[:4] in (PASS, SKIP)]
    statuses = {parts[1]: parts[0] for parts in lines}
    assert statuses["collective"] == PASS and statuses["nvml"] == SKIP
    assert f"{tmp_path} is writable (0 runs)" in out


def test_gpus_nvml_sees_but_torch_cannot_use_fail_in_one_line(tmp_path, monkeypatch):
    """With 2 GPUs a run would use nccl; torch cannot use CUDA (a CPU build, or, pinned by
    conftest, CUDA_VISIBLE_DEVICES=""), so that is a FAIL."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    install(monkeypatch, FakeNvml(2))
    result = runner.invoke(app, ["check", "--json", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["ok"] is False
    rows = by_name(doc)
    assert rows["nvml"] == {
        "name": "nvml",
        "status": PASS,
        "detail": "driver 550.54.15 (CUDA 12.4), 2 GPUs",
    }
    assert rows["gpus"]["status"] == FAIL
    assert rows["gpus"]["detail"].startswith("NVML sees 2 GPUs but torch cannot use CUDA")
    assert rows["collective"]["status"] == FAIL
    assert rows["collective"]["detail"].startswith("nccl all_reduce across 2 processes: ")
    assert "stopped:" not in rows["collective"]["detail"]  # the cause, not its echo
    assert all("\n" not in c["detail"] and "Traceback" not in c["detail"] for c in doc["checks"])
    assert "FAIL gpus: NVML sees 2 GPUs" in doc["report"]


def test_a_hung_worker_is_timed_out_and_ended():
    started = time.monotonic()
    [[hung]] = run_workers([[[PY, "-c", "import time; time.sleep(600)"]]], timeout=1.0)
    assert time.monotonic() - started < 60
    assert (hung.ok, hung.data, hung.detail) == (False, None, "timed out after 1 s")


def test_a_crash_becomes_its_last_line_and_its_partner_is_ended():
    crash = [PY, "-c", "import sys; print('noise', file=sys.stderr); sys.exit('ValueError: bad')"]
    waits = [PY, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"]
    ok = [PY, "-c", "print('{\"answer\": 42}')"]
    started = time.monotonic()
    [[crashed, partner], [fine]] = run_workers([[crash, waits], [ok]], timeout=120)
    assert time.monotonic() - started < 60  # not the timeout: the partner was ended
    assert (crashed.ok, crashed.detail) == (False, "ValueError: bad")
    assert (partner.ok, partner.detail) == (False, "stopped: its partner process failed")
    assert (fine.ok, fine.data, fine.detail) == (True, {"answer": 42}, "")


def test_a_worker_error_answer_and_a_silent_worker():
    answer = [PY, "-c", "import json, sys; print(json.dumps({'error': 'OSError: x'})); sys.exit(1)"]
    silent = [PY, "-c", "pass"]
    [[err], [quiet]] = run_workers([[answer], [silent]], timeout=120)
    assert (err.ok, err.detail) == (False, "OSError: x")
    assert (quiet.ok, quiet.detail) == (False, "no answer")


def test_every_worker_is_gone_afterwards():
    code = "import os, time; print('{\"pid\": %d}' % os.getpid(), flush=True); time.sleep(600)"
    [[w]] = run_workers([[[PY, "-c", code]]], timeout=10.0)  # time to start on a busy machine
    assert w.detail == "timed out after 10 s"
    assert w.data is not None, "the worker never printed its pid"
    assert not pid_alive(w.data["pid"])


@pytest.mark.parametrize(
    ("make", "status", "words"),
    [
        (lambda p: p, PASS, "is writable (0 runs)"),
        (lambda p: p / "new" / "runs", PASS, "will be created in"),
        (lambda p: (p / "file").write_text("") or p / "file", FAIL, "is not a directory"),
        (lambda p: (p / "file").write_text("") or p / "file" / "runs", FAIL, "is not a directory"),
    ],
)
def test_runs_dir(tmp_path, make, status, words):
    row = check.check_runs_dir(make(tmp_path))
    assert (row.name, row.status) == ("runs_dir", status)
    assert words in row.detail


def test_disk_and_port(tmp_path):
    disk = check.check_disk(tmp_path / "not" / "yet")
    assert disk.status in (PASS, WARN) and "GiB free under" in disk.detail
    port, number = check.check_port()
    assert port.status == PASS and f"127.0.0.1:{number} is free" in port.detail


def test_bf16_follows_the_launch_rule_and_no_gloo_fallback_is_promised():
    """A V100 (7.0) where torch.cuda.is_bf16_supported() says True (it counts emulation): check
    says what launch does (auto → fp16, bf16 refused); a torch without NCCL cannot run on GPUs."""
    gpu = {"index": 0, "name": "Tesla V100-SXM2-32GB", "capability": [7, 0], "uuid": None}
    data = {
        "torch": "2.11.0+cu130", "cuda_build": "13.0", "cuda_available": True, "errors": {},
        "devices": [gpu], "cudnn": 91000, "gloo": True, "nccl_available": False, "nccl": None,
        "bf16": [True], "matmul": [],
    }  # fmt: skip
    status = check.nvml.NvmlStatus(True, "", "550.54.15", "12.4")
    rows, _ = check._torch_checks(check.WorkerResult(True, data, "", 1.0), status, 1)
    rows = {r.name: r for r in rows}
    assert rows["bf16"].status == WARN
    assert "not on cuda:0 (capability below 8.0)" in rows["bf16"].detail
    assert "--precision bf16 is refused" in rows["bf16"].detail
    assert rows["nccl"].status == FAIL
    assert "do not fall back to gloo" in rows["nccl"].detail
    assert "fall back to gloo (slow)" not in rows["nccl"].detail
