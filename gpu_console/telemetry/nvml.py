"""The one place that talks to the NVIDIA driver (``pynvml`` from nvidia-ml-py).

Everything above this module asks it questions and gets plain values back; nothing here
raises into a caller. Without a driver, :func:`status` says why in words a person reads.
Tests replace :data:`pynvml` (the module handle) with a fake: that is the only seam.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass

try:
    import pynvml
except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
    pynvml = None

_lock = threading.Lock()
_state: dict[str, object] = {"initialised": False, "reason": None}


@dataclass(frozen=True)
class NvmlStatus:
    available: bool
    reason: str  # why NVML cannot be used ("" when it can)
    driver_version: str = ""


def _explain(err: BaseException) -> str:
    name = type(err).__name__
    text = str(err)
    if "LibraryNotFound" in name or "Library Not Found" in text:
        return "NVML library not found (no NVIDIA driver on this machine)"
    if "DriverNotLoaded" in name or "Driver Not Loaded" in text:
        return "the NVIDIA driver is not loaded"
    if "NoPermission" in name or "Insufficient Permissions" in text:
        return "no permission to talk to the NVIDIA driver"
    if "LibRmVersionMismatch" in name or "Mismatch" in text:
        return "the NVIDIA driver and its library versions do not match (reboot or reinstall)"
    return f"NVML failed to start: {text or name}"


def _ensure() -> bool:
    with _lock:
        if _state["initialised"]:
            return True
        if _state["reason"] is not None:
            return False
        if pynvml is None:
            _state["reason"] = "nvidia-ml-py is not installed"
            return False
        try:
            pynvml.nvmlInit()
        except Exception as e:  # every NVML failure becomes a reason, never a traceback
            _state["reason"] = _explain(e)
            return False
        _state["initialised"] = True
        atexit.register(shutdown)
        return True


def shutdown() -> None:
    with _lock:
        if _state["initialised"] and pynvml is not None:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass
        _state["initialised"] = False
        _state["reason"] = None


def status() -> NvmlStatus:
    if not _ensure():
        return NvmlStatus(False, str(_state["reason"]))
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        version = version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        version = ""
    return NvmlStatus(True, "", version)


def device_count() -> int:
    """GPUs NVML sees (0 when it cannot see any, or cannot run)."""
    if not _ensure():
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
