"""The one place that talks to the NVIDIA driver (``pynvml`` from nvidia-ml-py).

Everything above this module asks it questions and gets plain values back; nothing here
raises into a caller. A reading the driver cannot give is :data:`NA`. A function the driver
lacks (or does not support on a device, or forbids) is remembered and not called again, so
a sampler at 1 Hz does not pay for the same failure every second. A GPU that falls off the
bus is marked ``lost`` and left alone until :func:`shutdown`. Without a driver,
:func:`status` says why in words a person reads.

Tests replace :data:`pynvml` (the module handle) with a fake: that is the only seam. A test
that runs the product in a subprocess (the supervisor) sets ``GPU_CONSOLE_FAKE_NVML`` to
``module:callable``; the first use of NVML then takes the handle from that callable instead
(a test seam, read here at the boundary and nowhere else).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import threading
from dataclasses import dataclass, fields
from typing import Any

try:
    import pynvml
except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
    pynvml = None

# NVML return codes and constants are part of its C ABI; naming them here keeps the
# seam narrow (a fake needs only the functions and the error classes).
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_OPERATING_SYSTEM = 17
_LIB_RM_VERSION_MISMATCH = 18
_TEMPERATURE_GPU = 0
_CLOCK_SM = 1

# nvmlClocksEventReason* bits (called "throttle reasons" before CUDA 12.2).
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
    0x200: "board_limit",
    0x400: "reliability",
}


class NotAvailable:
    """A reading the driver cannot give: unsupported, forbidden, or the GPU is lost.

    One falsy instance, so ``value is NA`` and ``value or 0`` both read well; :meth:`to_json`
    of a sample turns it into ``null``.
    """

    __slots__ = ()
    _instance: NotAvailable | None = None

    def __new__(cls) -> NotAvailable:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "N/A"

    __str__ = __repr__

    def __reduce__(self):
        return (NotAvailable, ())


NA = NotAvailable()
Int = int | NotAvailable
Float = float | NotAvailable
Text = str | NotAvailable


@dataclass(frozen=True)
class NvmlStatus:
    available: bool
    reason: str  # why NVML cannot be used ("" when it can)
    driver_version: str = ""
    cuda_driver_version: str = ""  # the newest CUDA the driver supports, e.g. "12.4"


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # as the driver sees it: the host's pid namespace, not a container's
    used_memory: Int  # bytes; NA where the driver does not account per process


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. ``lost``: it stopped answering; only cached identity remains."""

    index: int  # NVML's index: PCI bus order (CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID)
    uuid: Text = NA
    name: Text = NA
    pci_bus_id: Text = NA
    compute_capability: tuple[int, int] | NotAvailable = NA
    lost: bool = False
    memory_used: Int = NA  # bytes
    memory_total: Int = NA
    util_gpu: Int = NA  # percent of time a kernel ran
    util_memory: Int = NA  # percent of time memory was read or written
    temperature_c: Int = NA
    power_w: Float = NA
    power_limit_w: Float = NA
    energy_mj: Int = NA  # millijoules since the driver loaded (Volta and newer)
    fan_percent: Int = NA
    sm_clock_mhz: Int = NA
    sm_clock_max_mhz: Int = NA
    clock_event_reasons: tuple[str, ...] | NotAvailable = NA
    processes: tuple[GpuProcess, ...] | NotAvailable = NA

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is NA:
                value = None
            elif f.name == "processes":
                value = [{"pid": p.pid, "used_memory": _json(p.used_memory)} for p in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def _json(value: Any) -> Any:
    return None if value is NA else value


class _GpuLost(Exception):
    """The device stopped answering (fell off the bus, or needs a reset). Never escapes."""


_lock = threading.RLock()
_state: dict[str, Any] = {"initialised": False, "reason": None, "atexit": False}
_missing: set[tuple[str, int | None]] = set()  # (function, device index; None: every device)
_lost: set[int] = set()
_static: dict[int, dict[str, Any]] = {}  # per device: handle and what does not change


def _explain(err: BaseException) -> str:
    code = getattr(err, "value", None)
    name = type(err).__name__
    text = str(err)
    if code == _LIBRARY_NOT_FOUND or "LibraryNotFound" in name:
        return "NVML library not found (no NVIDIA driver on this machine)"
    if code == _DRIVER_NOT_LOADED or "DriverNotLoaded" in name:
        return "the NVIDIA driver is not loaded"
    if code == _NO_PERMISSION or "NoPermission" in name:
        return "no permission to talk to the NVIDIA driver"
    if code == _LIB_RM_VERSION_MISMATCH or "LibRmVersionMismatch" in name:
        return "the NVIDIA driver and its library versions do not match (reboot or reinstall)"
    if code == _OPERATING_SYSTEM:
        return "the operating system blocked access to the NVIDIA driver"
    return f"NVML failed to start: {text or name}"


FAKE_ENV = "GPU_CONSOLE_FAKE_NVML"


def _fake_from_env() -> None:
    """Swap in the handle that ``$GPU_CONSOLE_FAKE_NVML`` (``module:callable``) names."""
    global pynvml
    spec = os.environ.get(FAKE_ENV)
    if spec and not _state.get("fake"):
        module, _, attr = spec.partition(":")
        pynvml = getattr(importlib.import_module(module), attr)()
        _state["fake"] = True


def _ensure() -> bool:
    with _lock:
        if _state["initialised"]:
            return True
        if _state["reason"] is not None:
            return False
        _fake_from_env()
        if pynvml is None:
            _state["reason"] = "nvidia-ml-py is not installed"
            return False
        try:
            pynvml.nvmlInit()
        except Exception as e:  # every way NVML fails to start becomes a reason, never a traceback
            _state["reason"] = _explain(e)
            return False
        _state["initialised"] = True
        if not _state["atexit"]:
            atexit.register(shutdown)
            _state["atexit"] = True
        return True


def shutdown() -> None:
    """Release NVML and forget everything learned about the driver (the next call re-inits)."""
    with _lock:
        if _state["initialised"] and pynvml is not None:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
        _state["initialised"] = False
        _state["reason"] = None
        _missing.clear()
        _lost.clear()
        _static.clear()


def _read(fn: str, index: int | None, *args: Any) -> Any:
    """``pynvml.fn(*args)``, or NA. Raises :class:`_GpuLost` for a device that is gone."""
    if (fn, None) in _missing or (fn, index) in _missing:
        return NA
    call = getattr(pynvml, fn, None)
    if call is None:  # an nvidia-ml-py too old to wrap it
        _missing.add((fn, None))
        return NA
    try:
        return call(*args)
    except pynvml.NVMLError as e:
        code = getattr(e, "value", None)
        if code == _FUNCTION_NOT_FOUND:
            _missing.add((fn, None))
        elif code in (_NOT_SUPPORTED, _NO_PERMISSION):
            _missing.add((fn, index))
        elif code in (_GPU_IS_LOST, _RESET_REQUIRED) and index is not None:
            raise _GpuLost(index) from None
        return NA  # anything else may be transient: asked again next time


def _first(fns: tuple[str, ...], index: int | None, *args: Any) -> Any:
    """The first of several spellings the driver answers (newer API first)."""
    for fn in fns:
        value = _read(fn, index, *args)
        if value is not NA:
            return value
    return NA


def _text(value: Any) -> Text:
    if value is NA or value is None:
        return NA
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> Int:
    return NA if value is NA or value is None else int(value)


def _watts(milliwatts: Any) -> Float:
    return NA if milliwatts is NA or milliwatts is None else round(milliwatts / 1000.0, 1)


def status() -> NvmlStatus:
    if not _ensure():
        return NvmlStatus(False, str(_state["reason"]))
    version = _text(_read("nvmlSystemGetDriverVersion", None))
    cuda = _read("nvmlSystemGetCudaDriverVersion", None)
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) and cuda else ""
    return NvmlStatus(True, "", "" if version is NA else version, cuda_text)


def device_count() -> int:
    """GPUs NVML sees (0 when it cannot see any, or cannot run)."""
    if not _ensure():
        return 0
    count = _read("nvmlDeviceGetCount", None)
    return 0 if count is NA else int(count)


def _device(index: int) -> dict[str, Any] | None:
    """The device's handle and identity, read once per NVML session."""
    info = _static.get(index)
    if info is not None:
        return info
    handle = _read("nvmlDeviceGetHandleByIndex", index, index)
    if handle is NA:
        return None
    info = {"handle": handle}
    _static[index] = info  # identity first, so a device lost below still has a handle cached
    info["uuid"] = _text(_read("nvmlDeviceGetUUID", index, handle))
    info["name"] = _text(_read("nvmlDeviceGetName", index, handle))
    pci = _read("nvmlDeviceGetPciInfo", index, handle)
    info["pci_bus_id"] = NA if pci is NA else _text(getattr(pci, "busId", None))
    cc = _read("nvmlDeviceGetCudaComputeCapability", index, handle)
    info["compute_capability"] = NA if cc is NA else (int(cc[0]), int(cc[1]))
    info["sm_clock_max_mhz"] = _int(_read("nvmlDeviceGetMaxClockInfo", index, handle, _CLOCK_SM))
    info["mig"] = _mig_instances(index, handle)
    return info


def _mig_instances(index: int, handle: Any) -> list[str]:
    """The UUIDs of a GPU's MIG instances when it is in MIG mode ([] otherwise): CUDA shows
    such a GPU only as its instances, one per process."""
    mode = _read("nvmlDeviceGetMigMode", index, handle)
    if mode is NA or not mode or int(mode[0]) != 1:
        return []
    slots = _read("nvmlDeviceGetMaxMigDeviceCount", index, handle)
    out = []
    for slot in range(0 if slots is NA else int(slots)):
        instance = _read("nvmlDeviceGetMigDeviceHandleByIndex", index, handle, slot)
        uuid = NA if instance is NA else _text(_read("nvmlDeviceGetUUID", index, instance))
        if isinstance(uuid, str) and uuid:
            out.append(uuid)
    return out


def _identity(index: int) -> dict[str, Any]:
    info = _static.get(index, {})
    keys = ("uuid", "name", "pci_bus_id", "compute_capability", "sm_clock_max_mhz")
    return {k: info[k] for k in keys if k in info}


def sample_gpu(index: int) -> GpuSample:
    """Everything NVML says about GPU ``index`` now; NA for each reading it cannot give."""
    if not _ensure():
        return GpuSample(index)
    if index in _lost:
        return GpuSample(index, lost=True, **_identity(index))
    try:
        info = _device(index)
        if info is None:
            return GpuSample(index)
        h = info["handle"]
        mem = _read("nvmlDeviceGetMemoryInfo", index, h)
        util = _read("nvmlDeviceGetUtilizationRates", index, h)
        reasons = _first(
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            index,
            h,
        )
        return GpuSample(
            index,
            **_identity(index),
            memory_used=NA if mem is NA else int(mem.used),
            memory_total=NA if mem is NA else int(mem.total),
            util_gpu=NA if util is NA else int(util.gpu),
            util_memory=NA if util is NA else int(util.memory),
            temperature_c=_int(
                _first(
                    ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                    index,
                    h,
                    _TEMPERATURE_GPU,
                )
            ),
            power_w=_watts(_read("nvmlDeviceGetPowerUsage", index, h)),
            power_limit_w=_watts(
                _first(
                    ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"),
                    index,
                    h,
                )
            ),
            energy_mj=_int(_read("nvmlDeviceGetTotalEnergyConsumption", index, h)),
            fan_percent=_int(_read("nvmlDeviceGetFanSpeed", index, h)),
            sm_clock_mhz=_int(_read("nvmlDeviceGetClockInfo", index, h, _CLOCK_SM)),
            clock_event_reasons=NA if reasons is NA else _reason_names(int(reasons)),
            processes=_processes(index, h),
        )
    except _GpuLost:
        _lost.add(index)
        return GpuSample(index, lost=True, **_identity(index))


def _reason_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit)


def _processes(index: int, handle: Any) -> tuple[GpuProcess, ...] | NotAvailable:
    procs = _first(
        ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
        index,
        handle,
    )
    if procs is NA:
        return NA
    return tuple(GpuProcess(int(p.pid), _int(getattr(p, "usedGpuMemory", None))) for p in procs)


def sample_gpus() -> list[GpuSample]:
    """Every GPU NVML sees, in NVML's (PCI bus) order; [] without NVML."""
    return [sample_gpu(i) for i in range(device_count())]


def uuids() -> dict[int, str]:
    """NVML index → UUID for the GPUs whose UUID the driver gives."""
    out: dict[int, str] = {}
    for i in range(device_count()):
        try:
            info = _device(i)
        except _GpuLost:
            _lost.add(i)
            info = _static.get(i)
        if info and isinstance(info.get("uuid"), str):
            out[i] = info["uuid"]
    return out


def identities() -> list[dict[str, Any]]:
    """Each GPU's ``index``, ``uuid``, ``name``, ``compute_capability`` (NA → None) and
    ``mig`` (its MIG instances' UUIDs), read once per NVML session: what a launch decides by,
    without sampling readings."""
    out = []
    for i in range(device_count()):
        try:
            info = _device(i)
        except _GpuLost:
            _lost.add(i)
            info = _static.get(i)
        ident = {"index": i, "uuid": None, "name": None, "compute_capability": None}
        for key in ("uuid", "name", "compute_capability"):
            value = (info or {}).get(key, NA)
            ident[key] = None if value is NA else value
        ident["mig"] = list((info or {}).get("mig") or [])
        out.append(ident)
    return out
