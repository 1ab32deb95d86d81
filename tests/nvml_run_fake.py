"""The fake NVMLs a subprocess takes through ``GPU_CONSOLE_FAKE_NVML=nvml_run_fake:NAME`` (the
seam in gpu_console.telemetry.nvml).

``machine``: what conftest pins for every process a test starts: no driver (every machine
looks like CI), or N plain GPUs where ``GPU_CONSOLE_TEST_GPUS=N`` rehearses a GPU machine.

``two_gpus``: for runs through the real CLI on CPU ranks.

``node_gpus``: ``two_gpus`` as another machine's: UUIDs of its own, from
``FAKE_NVML_MACHINE=N`` (two "nodes" on this one machine would otherwise share them).

Two GPUs, each "held" by the rank whose LOCAL_RANK is its index among the engine processes
under the calling process (the supervisor), as a driver lists a rank's CUDA context. Their
readings are what the tests check the figures against: utilisation is constant, memory and
temperature climb with every reading, GPU 0 has the total-energy counter (advancing at its
power draw in real time) and GPU 1 has none, so its energy is integrated from power.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import psutil
import pynvml as real
from test_telemetry_fake import GIB, FakeGpu, FakeNvml

UTIL = (87, 55)
POWER_W = (300, 250)
MEMORY_START = (10 * GIB, 20 * GIB)
MEMORY_STEP = 64 * 2**20  # per reading
TEMPERATURE_START = (60, 50)


class RunGpus(FakeNvml):
    def __init__(self) -> None:
        super().__init__(
            [
                FakeGpu(0, name="NVIDIA H100 80GB HBM3", util_gpu=UTIL[0]),
                FakeGpu(1, name="NVIDIA A100-SXM4-80GB", util_gpu=UTIL[1]),
            ]
        )
        self.gpus[1].unsupported = {"nvmlDeviceGetTotalEnergyConsumption"}
        for g in self.gpus:
            g.power_mw = POWER_W[g.index] * 1000
            g.memory_used = MEMORY_START[g.index]
            g.temperature = TEMPERATURE_START[g.index]
        self.t0 = time.monotonic()

    def nvmlDeviceGetMemoryInfo(self, h):
        out = super().nvmlDeviceGetMemoryInfo(h)
        self.gpus[h.index].memory_used += MEMORY_STEP
        return out

    def nvmlDeviceGetTemperature(self, h, sensor):
        out = super().nvmlDeviceGetTemperature(h, sensor)
        self.gpus[h.index].temperature += 1
        return out

    nvmlDeviceGetTemperatureV = nvmlDeviceGetTemperature

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        g = self.gpus[h.index]
        g.energy_mj = 5_000_000 + int(g.power_mw * (time.monotonic() - self.t0))
        return super().nvmlDeviceGetTotalEnergyConsumption(h)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._enter("nvmlDeviceGetComputeRunningProcesses", h)
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=8 * GIB)
            for pid, local_rank in _ranks()
            if local_rank == h.index
        ]


def _ranks() -> list[tuple[int, int]]:
    """(pid, LOCAL_RANK) of the engine processes under this one."""
    out = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmd = p.cmdline()
            parent = p.parent()
            # A rank is torchrun's child (its data-loader workers are forks of it).
            if (
                "gpu_console.engine" in cmd
                and parent
                and "torch.distributed.run" in parent.cmdline()
            ):
                out.append((p.pid, int(p.environ()["LOCAL_RANK"])))
        except (psutil.Error, ValueError, KeyError):
            continue
    return out


def machine() -> FakeNvml:
    n = int(os.environ.get("GPU_CONSOLE_TEST_GPUS") or 0)
    return FakeNvml(n) if n else FakeNvml(init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND)


def two_gpus() -> RunGpus:
    assert real.NVMLError  # the real error classes, as FakeNvml raises them
    return RunGpus()


def node_gpus() -> RunGpus:
    fake = two_gpus()
    machine = int(os.environ.get("FAKE_NVML_MACHINE") or 0)
    for g in fake.gpus:
        g.uuid = f"GPU-{machine:08x}-1111-2222-3333-44445555{g.index:04x}"
    return fake
