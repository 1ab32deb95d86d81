"""Rank → process → GPU by UUID, and NVML's memory beside the allocator's."""

from __future__ import annotations

import pytest
from test_telemetry_fake import GIB, FakeNvml, install
from test_telemetry_host import launchers  # noqa: F401 - a fixture

from gpu_console.telemetry.host import HostSampler, RunPids
from gpu_console.telemetry.ranks import (
    nvml_memory_by_pid,
    rank_gpus,
    visible_uuids,
)
from gpu_console.telemetry.sampler import take_sample

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

GPUS = [{"index": i, "uuid": f"GPU-{i}aaa-{i}"} for i in range(4)]


def test_nvml_memory_by_pid_from_a_sample():
    sample = {
        "gpus": [
            {"index": 0, "uuid": "GPU-a", "processes": [{"pid": 10, "used_memory": 5 * GIB}]},
            {
                "index": 1,
                "uuid": "GPU-b",
                "processes": [
                    {"pid": 11, "used_memory": 3 * GIB},
                    {"pid": 10, "used_memory": 300 << 20},
                    {"pid": 99, "used_memory": 1 * GIB},
                ],
            },
            {"index": 2, "uuid": "GPU-c", "processes": None},  # not accounted by the driver
        ]
    }
    held = nvml_memory_by_pid(sample, [10, 11, 12])
    assert held == {
        10: [
            {"gpu": 0, "uuid": "GPU-a", "used_memory": 5 * GIB},
            {"gpu": 1, "uuid": "GPU-b", "used_memory": 300 << 20},
        ],
        11: [{"gpu": 1, "uuid": "GPU-b", "used_memory": 3 * GIB}],
    }


@pytest.mark.parametrize(
    ("visible", "order", "gpus", "expected"),
    [
        ("2,0", "PCI_BUS_ID", GPUS, ["GPU-2aaa-2", "GPU-0aaa-0"]),
        (None, "PCI_BUS_ID", GPUS[:2], ["GPU-0aaa-0", "GPU-1aaa-1"]),
        ("GPU-3aaa,GPU-1", None, GPUS, ["GPU-3aaa-3", "GPU-1aaa-1"]),  # UUID prefixes
        ("0", None, GPUS[:1], ["GPU-0aaa-0"]),  # one GPU: no order to get wrong
        ("1,0", None, GPUS, None),  # fastest-first numbering: unknowable from NVML
        ("GPU-", "PCI_BUS_ID", GPUS, None),  # ambiguous prefix
        ("MIG-4f3a", "PCI_BUS_ID", GPUS, None),
        ("7", "PCI_BUS_ID", GPUS, None),
    ],
)
def test_visible_uuids(visible, order, gpus, expected):
    assert visible_uuids(visible, order, gpus) == expected


def test_ranks_find_their_gpu_by_pid_then_by_environment(monkeypatch, launchers):  # noqa: F811
    run = launchers(3, CUDA_VISIBLE_DEVICES="3,2,1,0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    rank0, rank1, rank2 = run.workers
    fake = install(monkeypatch, FakeNvml(4))
    fake.gpus[3].processes = [(rank0, 6 * GIB)]
    # Rank 1 made a stray context on GPU 0 beside its own on GPU 2 (the cuda:0 bug).
    fake.gpus[2].processes = [(rank1, 5 * GIB)]
    fake.gpus[0].processes = [(rank1, 300 << 20), (12345, 2 * GIB)]
    pids = RunPids(torchrun=run.pid, workers=tuple(run.workers + run.loaders))
    sample = take_sample(HostSampler(), pids)

    rows = {r["rank"]: r for r in sample["ranks"]}
    assert len(sample["ranks"]) == 3 and set(rows) == {0, 1, 2}
    assert rows[0] == {
        "rank": 0,
        "pid": rank0,
        "gpu": 3,
        "uuid": fake.gpus[3].uuid,
        "source": "nvml",
        "nvml_used": 6 * GIB,
        "stray": [],
    }
    assert (rows[1]["gpu"], rows[1]["source"], rows[1]["nvml_used"]) == (2, "nvml", 5 * GIB)
    assert rows[1]["stray"] == [{"gpu": 0, "uuid": fake.gpus[0].uuid, "used_memory": 300 << 20}]
    # Rank 2 has no CUDA context yet: its GPU comes from CUDA_VISIBLE_DEVICES[LOCAL_RANK].
    assert (rows[2]["gpu"], rows[2]["source"], rows[2]["nvml_used"]) == (1, "env", None)
    assert rank_gpus(sample) == sample["ranks"]


def test_a_cpu_run_has_ranks_without_gpus(launchers):  # noqa: F811
    run = launchers(2, CUDA_VISIBLE_DEVICES="")
    sample = take_sample(HostSampler(), RunPids(torchrun=run.pid, workers=tuple(run.workers)))
    assert [(r["rank"], r["gpu"], r["source"]) for r in sample["ranks"]] == [
        (0, None, None),
        (1, None, None),
    ]
