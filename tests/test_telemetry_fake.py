"""A scripted stand-in for ``pynvml`` (nvidia-ml-py): the one seam the telemetry tests use.

It raises the real error classes of the real ``pynvml`` module (``pynvml.NVMLError(code)``
builds the matching ``NVMLError_*`` subclass), so the error mapping in
``gpu_console.telemetry.nvml`` runs as it would against a driver. Everything above the
handle runs for real. This file holds no tests; the other test modules import it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as real

GIB = 1024**3


@dataclass
class FakeGpu:
    index: int
    uuid: str = ""
    name: str | bytes = "NVIDIA A100-SXM4-80GB"
    memory_total: int = 80 * GIB
    memory_used: int = 1 * GIB
    util_gpu: int = 0
    util_memory: int = 0
    temperature: int = 35
    power_mw: int = 60_000
    power_limit_mw: int = 400_000
    energy_mj: int = 5_000_000  # nvmlDeviceGetTotalEnergyConsumption (mJ since driver load)
    fan: int = 30
    sm_clock: int = 210
    sm_clock_max: int = 1410
    reasons: int = 0x1  # gpu_idle
    capability: tuple[int, int] = (8, 0)
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    unsupported: set[str] = field(default_factory=set)  # functions raising NotSupported
    flaky: Counter = field(default_factory=Counter)  # function → failures left (Unknown)
    broken: set[str] = field(default_factory=set)  # functions raising a non-NVML error
    lost: bool = False
    mig: list[str] = field(default_factory=list)  # MIG instances' UUIDs (MIG mode when any)

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-{self.index:08x}-1111-2222-3333-44445555{self.index:04x}"

    @property
    def bus_id(self) -> bytes:
        return f"00000000:{0x07 + self.index * 0x10:02X}:00.0".encode()


def make_gpus(n: int) -> list[FakeGpu]:
    """n GPUs with distinct readings, so a test can tell them apart."""
    return [
        FakeGpu(
            i,
            memory_used=(1 + i) * GIB,
            util_gpu=(7 * i) % 101,
            util_memory=(3 * i) % 101,
            temperature=35 + i,
            power_mw=60_000 + 1_500 * i,
            fan=30 + i,
            sm_clock=210 + 10 * i,
        )
        for i in range(n)
    ]


class FakeNvml:
    """Quacks like the ``pynvml`` module for the functions gpu_console calls.

    ``init_error``: an error code nvmlInit fails with; ``missing``: functions the "driver"
    lacks (FunctionNotFound); ``calls``: how often each function was called.
    """

    NVMLError = real.NVMLError

    def __init__(
        self,
        gpus: list[FakeGpu] | int = 0,
        *,
        init_error: int | None = None,
        missing: set[str] | None = None,
        driver: str = "550.54.15",
        cuda: int = 12040,
    ):
        self.gpus = make_gpus(gpus) if isinstance(gpus, int) else gpus
        self.init_error = init_error
        self.missing = set(missing or ())
        self.driver = driver
        self.cuda = cuda
        self.calls: Counter = Counter()
        self.device_calls: Counter = Counter()  # (function, index)
        self.initialised = False

    # -- plumbing ------------------------------------------------------------------------
    def _enter(self, fn: str, handle: SimpleNamespace | None = None) -> FakeGpu | None:
        self.calls[fn] += 1
        if not self.initialised:
            raise real.NVMLError(real.NVML_ERROR_UNINITIALIZED)
        if fn in self.missing:
            raise real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if handle is None:
            return None
        gpu = self.gpus[handle.index]
        self.device_calls[(fn, gpu.index)] += 1
        if gpu.lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.unsupported:
            raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        if gpu.flaky[fn] > 0:
            gpu.flaky[fn] -= 1
            raise real.NVMLError(real.NVML_ERROR_UNKNOWN)
        if fn in gpu.broken:
            raise RuntimeError(f"{fn} is broken in this fake")
        return gpu

    # -- library -------------------------------------------------------------------------
    def nvmlInit(self):
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise real.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self):
        self.calls["nvmlShutdown"] += 1
        self.initialised = False

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(index=index)

    # -- device --------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, h):
        gpu = self._enter("nvmlDeviceGetUUID", h)
        return gpu.mig[h.mig] if hasattr(h, "mig") else gpu.uuid

    def nvmlDeviceGetMigMode(self, h):
        return [1, 1] if self._enter("nvmlDeviceGetMigMode", h).mig else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7 if self._enter("nvmlDeviceGetMaxMigDeviceCount", h).mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, slot):
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if slot >= len(gpu.mig):
            raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)
        return SimpleNamespace(index=h.index, mig=slot)

    def nvmlDeviceGetName(self, h):
        return self._enter("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._enter("nvmlDeviceGetPciInfo", h).bus_id)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._enter("nvmlDeviceGetCudaComputeCapability", h).capability

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        assert kind == real.NVML_CLOCK_SM
        return self._enter("nvmlDeviceGetMaxClockInfo", h).sm_clock_max

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == real.NVML_CLOCK_SM
        return self._enter("nvmlDeviceGetClockInfo", h).sm_clock

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self._enter("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(
            total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used
        )

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._enter("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_memory)

    def nvmlDeviceGetTemperatureV(self, h, sensor):
        assert sensor == real.NVML_TEMPERATURE_GPU
        return self._enter("nvmlDeviceGetTemperatureV", h).temperature

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == real.NVML_TEMPERATURE_GPU
        return self._enter("nvmlDeviceGetTemperature", h).temperature

    def nvmlDeviceGetPowerUsage(self, h):
        return self._enter("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._enter("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, h):
        return self._enter("nvmlDeviceGetPowerManagementLimit", h).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self._enter("nvmlDeviceGetTotalEnergyConsumption", h).energy_mj

    def nvmlDeviceGetFanSpeed(self, h):
        return self._enter("nvmlDeviceGetFanSpeed", h).fan

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", h).reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", h).reasons

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        g = self._enter("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.processes]


def install(monkeypatch, fake: FakeNvml) -> FakeNvml:
    """Put ``fake`` behind gpu_console.telemetry.nvml, with nothing learned from before.

    The module's caches are swapped for fresh ones too, so undoing the monkeypatch brings
    back exactly what the real driver state was: no test leaks a fake into another.
    """
    from gpu_console.telemetry import nvml

    monkeypatch.setattr(nvml, "pynvml", fake)
    # "fake": a GPU_CONSOLE_FAKE_NVML in the environment (conftest's pin) must not replace it.
    monkeypatch.setattr(
        nvml, "_state", {"initialised": False, "reason": None, "atexit": True, "fake": True}
    )
    monkeypatch.setattr(nvml, "_missing", set())
    monkeypatch.setattr(nvml, "_lost", set())
    monkeypatch.setattr(nvml, "_static", {})
    return fake


GPU_FIELDS = {
    "index",
    "uuid",
    "name",
    "pci_bus_id",
    "compute_capability",
    "lost",
    "memory_used",
    "memory_total",
    "util_gpu",
    "util_memory",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "energy_mj",
    "fan_percent",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "clock_event_reasons",
    "processes",
}


def assert_gpu_json(gpu: dict, fake_gpu: FakeGpu) -> None:
    """Every field of the issue reached the JSON, with the fake's values in our units."""
    assert set(gpu) >= GPU_FIELDS
    assert gpu["index"] == fake_gpu.index
    assert gpu["uuid"] == fake_gpu.uuid
    name = fake_gpu.name.decode() if isinstance(fake_gpu.name, bytes) else fake_gpu.name
    assert gpu["name"] == name
    assert gpu["pci_bus_id"] == fake_gpu.bus_id.decode()
    assert gpu["compute_capability"] == list(fake_gpu.capability)
    assert gpu["lost"] is False
    assert gpu["memory_used"] == fake_gpu.memory_used
    assert gpu["memory_total"] == fake_gpu.memory_total
    assert gpu["util_gpu"] == fake_gpu.util_gpu
    assert gpu["util_memory"] == fake_gpu.util_memory
    assert gpu["temperature_c"] == fake_gpu.temperature
    assert gpu["power_w"] == round(fake_gpu.power_mw / 1000, 1)
    assert gpu["power_limit_w"] == round(fake_gpu.power_limit_mw / 1000, 1)
    assert gpu["energy_mj"] == fake_gpu.energy_mj
    assert gpu["fan_percent"] == fake_gpu.fan
    assert gpu["sm_clock_mhz"] == fake_gpu.sm_clock
    assert gpu["sm_clock_max_mhz"] == fake_gpu.sm_clock_max
    assert isinstance(gpu["clock_event_reasons"], list)
    assert gpu["processes"] == [{"pid": p, "used_memory": m} for p, m in fake_gpu.processes]


def install_torch_build(monkeypatch, folder, cuda: str | None = "12.4") -> None:
    """The console reads the installed torch's build from ``torch/version.py`` (without
    importing it): point it at one written here, a CUDA build unless ``cuda`` is None."""
    from gpu_console import torch_build

    path = folder / "version.py"
    version = "2.11.0+cu124" if cuda else "2.11.0+cpu"
    path.write_text(
        f"__version__ = {version!r}\ncuda: Optional[str] = {cuda!r}\nhip: Optional[str] = None\n"
    )
    monkeypatch.setattr(torch_build, "version_file", lambda: path)
