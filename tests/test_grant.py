"""A run uses only the GPUs the environment grants (CUDA_VISIBLE_DEVICES, SLURM's variables)
∩ ``--devices``; a CPU-only torch and bf16 below capability 8.0 are refused before anything is
written. A fake NVML of four GPUs at the seam; the rest runs for real (the CLI in-process, so
its fakes are this process's)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from test_telemetry_fake import FakeGpu, FakeNvml, install, install_torch_build
from typer.testing import CliRunner

from gpu_console import cli, launch
from gpu_console.devices import read_grant
from gpu_console.telemetry.recorder import Recorder

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

GRANTS = {
    "CUDA_VISIBLE_DEVICES=2,3": ({"CUDA_VISIBLE_DEVICES": "2,3"}, [2, 3]),
    "CUDA_VISIBLE_DEVICES=UUIDs": ({"CUDA_VISIBLE_DEVICES": "uuid:3,uuid:1"}, [3, 1]),
    "SLURM_STEP_GPUS=1": ({"SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "0,1"}, [1]),
}


@pytest.fixture
def node(monkeypatch, tmp_path):
    """Four GPUs in NVML's view, a CUDA build of torch, and nothing granted yet."""
    fake = install(monkeypatch, FakeNvml(4))
    install_torch_build(monkeypatch, tmp_path)
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)
    return fake


def grant(monkeypatch, fake: FakeNvml, env: dict[str, str]) -> None:
    for var, value in env.items():
        uuids = ",".join(
            fake.gpus[int(e[5:])].uuid if e.startswith("uuid:") else e for e in value.split(",")
        )
        monkeypatch.setenv(var, uuids)


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``gpu-console ARGS`` through the real CLI and its error handler, in this process."""
    monkeypatch.setattr(sys, "argv", ["gpu-console", *args])
    with pytest.raises(SystemExit) as info:
        cli.main()
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.mark.parametrize("case", GRANTS)
def test_devices_marks_the_gpus_that_are_not_yours(node, monkeypatch, case):
    env, yours = GRANTS[case]
    grant(monkeypatch, node, env)
    doc = json.loads(CliRunner().invoke(cli.app, ["devices", "--json"]).output)
    assert [g["index"] for g in doc["gpus"]] == [0, 1, 2, 3], "every GPU is shown"
    assert [g["index"] for g in doc["gpus"] if g["yours"]] == sorted(yours)
    assert doc["grant"]["gpus"] == sorted(yours) and doc["grant"]["problem"] is None
    assert doc["grant"]["source"] == next(iter(env))

    table = CliRunner().invoke(cli.app, ["devices"]).output
    rows = {int(line[:2]): line for line in table.splitlines() if line[:2].strip().isdigit()}
    for index, row in rows.items():
        assert ("not yours" in row) == (index not in yours), row
    assert f"grants GPU {','.join(map(str, sorted(yours)))}" in table


@pytest.mark.parametrize("case", GRANTS)
def test_auto_and_explicit_placement_stay_inside_the_grant(node, monkeypatch, tmp_path, case):
    env, yours = GRANTS[case]
    grant(monkeypatch, node, env)
    runs = tmp_path / "runs"
    _, auto, _ = launch.prepare("quickstart", devices="auto", runs_dir=runs)
    assert auto.device_type == "cuda" and auto.gpus == tuple(yours)
    uuids = ",".join(node.gpus[i].uuid for i in yours)
    assert auto.cuda_visible_devices == uuids and auto.nproc == len(yours)

    _, one, _ = launch.prepare("quickstart", devices=str(yours[-1]), runs_dir=runs)
    assert one.gpus == (yours[-1],) and one.cuda_visible_devices == node.gpus[yours[-1]].uuid

    # What the ranks get: the chosen GPUs by UUID, never a mask wider than the grant.
    worker = launch.worker_env(auto)
    assert worker["CUDA_VISIBLE_DEVICES"] == uuids
    assert worker["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert not runs.exists(), "prepare writes nothing"


@pytest.mark.parametrize("case", GRANTS)
def test_a_gpu_outside_the_grant_is_one_line_exit_2(node, monkeypatch, capsys, tmp_path, case):
    env, yours = GRANTS[case]
    grant(monkeypatch, node, env)
    runs = tmp_path / "runs"
    theirs = min(set(range(4)) - set(yours))
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "quickstart", "--headless", "--devices", str(theirs),
        "--runs-dir", str(runs),
    )  # fmt: skip
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"gpu-console: --devices: hardware.devices: GPU {theirs} is not yours")
    assert f"grants GPU {','.join(map(str, sorted(yours)))}" in err
    assert not runs.exists(), "nothing written"


def test_an_empty_mask_grants_no_gpu(node, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _, auto, _ = launch.prepare("quickstart", devices="auto", runs_dir=tmp_path / "runs")
    assert auto.device_type == "cpu"
    doc = json.loads(CliRunner().invoke(cli.app, ["devices", "--json"]).output)
    assert not any(g["yours"] for g in doc["gpus"])


def test_a_mask_is_read_as_cuda_reads_it(node):
    uuid = node.gpus[2].uuid
    gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in node.gpus]

    def granted(mask: str, **env: str) -> list[int | None]:
        return [g.index for g in read_grant(gpus, {"CUDA_VISIBLE_DEVICES": mask, **env}).gpus]

    assert granted(uuid[:12]) == [2], "a unique UUID prefix names its GPU"
    assert granted("GPU-0") == [], "an ambiguous prefix ends the list, as in CUDA"
    assert granted("3,7,1") == [3], "the list ends at the first entry CUDA cannot use"
    assert granted("1,1") == [1]
    assert granted("MIG-abc") == [None], "a MIG instance is passed on as it was given"
    assert read_grant(gpus, {"CUDA_VISIBLE_DEVICES": "MIG-abc"}).gpus[0].token == "MIG-abc"
    # Different GPUs and CUDA's default (fastest first) order: which ones "0,1" means is unknown.
    gpus[3]["name"] = "Tesla V100-SXM2-32GB"
    unsure = read_grant(gpus, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert unsure.gpus == () and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in unsure.problem
    assert granted("0,1", CUDA_DEVICE_ORDER="PCI_BUS_ID") == [0, 1]
    assert granted(uuid) == [2], "UUIDs need no order"


def test_the_recorder_keeps_the_granted_gpus_named_by_uuid(node, monkeypatch, tmp_path):
    grant(monkeypatch, node, {"CUDA_VISIBLE_DEVICES": "2,3"})
    _, placement, _ = launch.prepare("quickstart", devices="auto", runs_dir=tmp_path / "runs")
    run = tmp_path / "run"
    run.mkdir()
    session = {"device_type": "cuda", "cuda_visible_devices": placement.cuda_visible_devices}
    (run / "meta.json").write_text(json.dumps({"placement": session}))
    recorder = Recorder(run)
    take = recorder._default_sampler()
    sample = take()
    assert [g["index"] for g in sample["gpus"]] == [2, 3]


def test_a_cpu_only_torch_falls_back_for_auto_and_refuses_a_gpu(monkeypatch, capsys, tmp_path):
    install(monkeypatch, FakeNvml(2))
    install_torch_build(monkeypatch, tmp_path, cuda=None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    runs = tmp_path / "runs"
    _, auto, _ = launch.prepare("quickstart", devices="auto", runs_dir=runs)
    assert auto.device_type == "cpu"
    assert auto.note == (
        "--devices auto: on the CPU, torch 2.11.0+cpu is built without CUDA (a CPU-only build)"
    )
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "quickstart", "--headless", "--devices", "0",
        "--runs-dir", str(runs),
    )  # fmt: skip
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("gpu-console: --devices: hardware.devices: torch 2.11.0+cpu is built")
    assert "use cpu or cpu:N" in err
    assert not runs.exists()
    # Through the CLI, auto's note is one line on stderr before the launch goes on (here to a
    # runs directory that cannot be made, so nothing starts).
    runs.write_text("a file where the runs directory should be")
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "quickstart", "--headless", "--runs-dir", str(runs)
    )
    assert err.splitlines()[0] == auto.note, err


def test_bf16_below_capability_8_is_refused_at_launch(monkeypatch, capsys, tmp_path):
    fake = install(
        monkeypatch,
        FakeNvml([FakeGpu(0), FakeGpu(1, name="Tesla V100-SXM2-32GB", capability=(7, 0))]),
    )
    install_torch_build(monkeypatch, tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    runs = tmp_path / "runs"
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "quickstart", "--headless", "--devices", "0,1",
        "--precision", "bf16", "--runs-dir", str(runs),
    )  # fmt: skip
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("gpu-console: --precision: train.precision: bf16 needs compute")
    assert "(GPU 1 is 7.0)" in err
    assert not runs.exists()
    # The A100 alone takes bf16.
    _, placement, _ = launch.prepare("quickstart", devices="0", precision="bf16", runs_dir=runs)
    assert placement.cuda_visible_devices == fake.gpus[0].uuid


@pytest.mark.parametrize("dry", [False, True], ids=["launch", "dry-run"])
def test_a_gpu_index_above_the_visible_count_is_one_line_exit_2(
    node, monkeypatch, capsys, tmp_path, dry
):
    runs = tmp_path / "runs"
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "quickstart", "--headless", "--devices", "0,7",
        "--runs-dir", str(runs), *(["--dry-run"] if dry else []),
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "gpu-console: --devices: hardware.devices: GPU 7 does not exist (this machine has 4: "
        "0..3) (got '0,7')"
    ]
    assert not runs.exists(), "nothing written"


def test_a_fused_optimizer_under_fsdp_fp16_is_refused_before_anything_is_written(
    node, monkeypatch, capsys, tmp_path
):
    # torch's sharded GradScaler cannot step the fused kernels (tests/test_fused_scaler.py).
    runs = tmp_path / "runs"
    args = ["run", "transformer", "--headless", "--devices", "0", "--runs-dir", str(runs)]
    fsdp = ["--set", "distributed.strategy=fsdp", "--set", "train.optimizer_impl=fused"]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--precision", "fp16", *fsdp)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(
        "gpu-console: --set: train.optimizer_impl: the fused optimizer kernels cannot step "
        "under FSDP's fp16 GradScaler"
    ), err
    assert err.rstrip().endswith("use auto or foreach (got 'fused')"), err
    assert not runs.exists(), "nothing written"
    # bf16 has no GradScaler: the fused kernels stand.
    profile, _, _ = launch.prepare(
        "transformer", devices="0", precision="bf16", runs_dir=runs, overrides=fsdp[1::2]
    )
    assert profile.train.optimizer_impl == "fused"


def test_auto_precision_on_an_old_gpu_refuses_a_fused_optimizer_under_fsdp_too(
    monkeypatch, capsys, tmp_path
):
    # auto is fp16 on a GPU below capability 8.0, as the ranks resolve it.
    install(monkeypatch, FakeNvml([FakeGpu(0, name="Tesla V100-SXM2-32GB", capability=(7, 0))]))
    install_torch_build(monkeypatch, tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    runs = tmp_path / "runs"
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "transformer", "--headless", "--devices", "0",
        "--set", "distributed.strategy=fsdp", "--set", "train.optimizer_impl=fused",
        "--runs-dir", str(runs),
    )  # fmt: skip
    assert code == 2 and "train.optimizer_impl: the fused optimizer kernels cannot" in err, err
    assert not runs.exists()


# -- GPUs as a scheduler grants them (issue: life on a GPU cluster) ------------------------


def test_auto_under_a_uuid_grant_uses_exactly_those_gpus_and_says_which(
    node, monkeypatch, tmp_path
):
    grant(monkeypatch, node, {"CUDA_VISIBLE_DEVICES": "uuid:3,uuid:1"})
    _, auto, _ = launch.prepare("quickstart", devices="auto", runs_dir=tmp_path / "runs")
    assert auto.nproc == 2 and auto.gpus == (3, 1)
    assert auto.note == "--devices auto: GPU 1, 3, as CUDA_VISIBLE_DEVICES grants"
    worker = launch.worker_env(auto)
    assert worker["CUDA_VISIBLE_DEVICES"] == f"{node.gpus[3].uuid},{node.gpus[1].uuid}"
    assert "GPU_CONSOLE_RANK_DEVICES" not in worker, "whole GPUs share one mask"


def test_slurm_indices_in_a_device_cgroup_are_the_jobs_gpus(monkeypatch, tmp_path):
    """SLURM_JOB_GPUS=2,3 numbers the node's GPUs; inside the job's cgroup NVML sees two,
    numbered 0 and 1: both are the job's, and auto says so (never a silent CPU run)."""
    install(monkeypatch, FakeNvml(2))
    install_torch_build(monkeypatch, tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("SLURM_JOB_GPUS", "2,3")
    _, auto, _ = launch.prepare("quickstart", devices="auto", runs_dir=tmp_path / "runs")
    assert auto.device_type == "cuda" and auto.gpus == (0, 1)
    assert "SLURM_JOB_GPUS=2,3 numbers the node's GPUs" in auto.note
    # Indices that match nothing NVML sees: refused in one line, not a guess.
    monkeypatch.setenv("SLURM_JOB_GPUS", "5,6,7")
    with pytest.raises(launch.LaunchError) as refused:
        launch.prepare("quickstart", devices="auto", runs_dir=tmp_path / "runs")
    assert "SLURM_JOB_GPUS=5,6,7 names GPUs NVML does not see (it sees 2: 0..1)" in str(
        refused.value
    )


MIGS = ["MIG-11111111-aaaa-bbbb-cccc-000000000001", "MIG-11111111-aaaa-bbbb-cccc-000000000002"]


@pytest.fixture
def mig_node(monkeypatch, tmp_path):
    """GPU 0 in MIG mode with two instances, GPU 1 whole; a CUDA build of torch."""
    fake = install(monkeypatch, FakeNvml([FakeGpu(0, mig=list(MIGS)), FakeGpu(1)]))
    install_torch_build(monkeypatch, tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    return fake


def test_mig_instances_get_a_rank_each_with_their_own_mask(mig_node, monkeypatch, tmp_path):
    from gpu_console.engine.__main__ import own_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(MIGS))
    _, auto, _ = launch.prepare("quickstart", devices="auto", runs_dir=tmp_path / "runs")
    assert auto.nproc == 2 and auto.per_rank and auto.gpus == (None, None)
    assert "2 MIG instances, a rank each; gloo between them" in auto.note
    worker = launch.worker_env(auto)
    assert worker["GPU_CONSOLE_RANK_DEVICES"] == ",".join(MIGS)
    # Each rank, before CUDA starts: its own instance alone.
    for local_rank, mig in enumerate(MIGS):
        monkeypatch.setenv("GPU_CONSOLE_RANK_DEVICES", worker["GPU_CONSOLE_RANK_DEVICES"])
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        own_device()
        assert os.environ["CUDA_VISIBLE_DEVICES"] == mig
    # GPU 0 asked by index: its instances, as CUDA shows them.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _, zero, _ = launch.prepare("quickstart", devices="0", runs_dir=tmp_path / "runs")
    assert zero.cuda_visible_devices == ",".join(MIGS) and zero.nproc == 2
    _, whole, _ = launch.prepare("quickstart", devices="1", runs_dir=tmp_path / "runs")
    assert whole.cuda_visible_devices == mig_node.gpus[1].uuid and not whole.per_rank


def test_nccl_across_mig_instances_is_refused_in_one_line(mig_node, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(MIGS))
    runs = tmp_path / "runs"
    code, out, err = run_cli(
        monkeypatch, capsys, "run", "quickstart", "--headless", "--set",
        "distributed.backend=nccl", "--runs-dir", str(runs),
    )  # fmt: skip
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("gpu-console: --set: distributed.backend: NCCL does not run across MIG")
    assert not runs.exists()
    # One instance alone may use NCCL.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIGS[0])
    _, one, _ = launch.prepare("quickstart", overrides=["distributed.backend=nccl"], runs_dir=runs)
    assert one.nproc == 1 and one.cuda_visible_devices == MIGS[0]
