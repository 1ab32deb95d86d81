"""gpu_console.telemetry.nvml against a scripted pynvml: every reading, every failure."""

from __future__ import annotations

import ctypes.util
import pickle

import pynvml as real
import pytest
from test_telemetry_fake import GIB, FakeGpu, FakeNvml, assert_gpu_json, install

from gpu_console.telemetry import nvml
from gpu_console.telemetry.nvml import NA

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def test_not_available_is_one_falsy_value_that_survives_pickling():
    assert nvml.NotAvailable() is NA
    assert not NA
    assert repr(NA) == "N/A"
    assert pickle.loads(pickle.dumps(NA)) is NA
    assert nvml.GpuSample(3).to_json()["memory_used"] is None


def test_library_not_found_is_a_reason_not_a_traceback(monkeypatch):
    fake = install(monkeypatch, FakeNvml(2, init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND))
    # The fake raises what the real module raises on a machine without a driver.
    with pytest.raises(real.NVMLError_LibraryNotFound):
        FakeNvml(init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND).nvmlInit()

    status = nvml.status()
    assert status == nvml.NvmlStatus(
        False, "NVML library not found (no NVIDIA driver on this machine)"
    )
    assert nvml.device_count() == 0
    assert nvml.sample_gpus() == []
    assert nvml.uuids() == {}
    assert nvml.sample_gpu(0) == nvml.GpuSample(0)
    assert fake.calls["nvmlInit"] == 1  # the failure is remembered, not retried each call


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (real.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA driver is not loaded"),
        (real.NVML_ERROR_NO_PERMISSION, "no permission to talk to the NVIDIA driver"),
        (real.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "driver and its library versions do not match"),
        (real.NVML_ERROR_OPERATING_SYSTEM, "operating system blocked"),
        (real.NVML_ERROR_UNKNOWN, "NVML failed to start: Unknown Error"),
    ],
)
def test_every_init_failure_becomes_one_line(monkeypatch, code, words):
    install(monkeypatch, FakeNvml(1, init_error=code))
    status = nvml.status()
    assert not status.available
    assert words in status.reason
    assert "\n" not in status.reason
    assert nvml.sample_gpus() == []


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver"
)
def test_the_real_pynvml_without_a_driver(monkeypatch, real_machine):
    for name, fresh in [
        ("_state", {"initialised": False, "reason": None, "atexit": True}),
        ("_missing", set()),
        ("_lost", set()),
        ("_static", {}),
    ]:
        monkeypatch.setattr(nvml, name, fresh)
    assert nvml.pynvml is real
    status = nvml.status()
    assert not status.available
    assert status.reason == "NVML library not found (no NVIDIA driver on this machine)"
    assert nvml.device_count() == 0


@pytest.mark.parametrize("n", [0, 1, 2, 8])
def test_every_field_of_every_gpu(monkeypatch, n):
    fake = install(monkeypatch, FakeNvml(n))
    for i, gpu in enumerate(fake.gpus):
        gpu.processes = [(4000 + i, (i + 1) * GIB), (5000 + i, None)]
    status = nvml.status()
    assert status.available and status.reason == ""
    assert status.driver_version == "550.54.15"
    assert status.cuda_driver_version == "12.4"
    assert nvml.device_count() == n
    samples = nvml.sample_gpus()
    assert [s.index for s in samples] == list(range(n))
    assert len({s.uuid for s in samples}) == n
    for sample, fake_gpu in zip(samples, fake.gpus, strict=True):
        assert sample.processes[1].used_memory is NA
        assert_gpu_json(sample.to_json(), fake_gpu)
    assert nvml.uuids() == {g.index: g.uuid for g in fake.gpus}


def test_bytes_from_an_older_binding_are_decoded(monkeypatch):
    fake = install(monkeypatch, FakeNvml([FakeGpu(0, name=b"Tesla V100-SXM2-16GB")]))
    sample = nvml.sample_gpu(0)
    assert sample.name == "Tesla V100-SXM2-16GB"
    assert_gpu_json(sample.to_json(), fake.gpus[0])


def test_clock_event_reasons_are_named(monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    fake.gpus[0].reasons = 0x4 | 0x40  # power cap and hardware thermal slowdown
    assert nvml.sample_gpu(0).clock_event_reasons == ("sw_power_cap", "hw_thermal")
    fake.gpus[0].reasons = 0
    assert nvml.sample_gpu(0).clock_event_reasons == ()


def test_not_supported_is_na_and_tried_once_per_device(monkeypatch):
    fake = install(monkeypatch, FakeNvml(2))
    # A passively cooled GPU has no fan; a cheap board cannot read its power.
    fake.gpus[1].unsupported = {"nvmlDeviceGetFanSpeed", "nvmlDeviceGetPowerUsage"}
    for _ in range(5):
        gpu0, gpu1 = nvml.sample_gpus()
        assert gpu0.fan_percent == 30 and gpu0.power_w == 60.0
        assert gpu1.fan_percent is NA and gpu1.power_w is NA
        assert gpu1.temperature_c == 36 and gpu1.power_limit_w == 400.0
    assert fake.device_calls[("nvmlDeviceGetFanSpeed", 1)] == 1
    assert fake.device_calls[("nvmlDeviceGetPowerUsage", 1)] == 1
    assert fake.device_calls[("nvmlDeviceGetFanSpeed", 0)] == 5
    assert gpu1.to_json()["fan_percent"] is None


def test_functions_the_driver_lacks_fall_back_and_are_tried_once(monkeypatch):
    missing = {
        "nvmlDeviceGetCurrentClocksEventReasons",  # drivers before CUDA 12.2
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetEnforcedPowerLimit",
    }
    fake = install(monkeypatch, FakeNvml(2, missing=missing))
    fake.gpus[0].reasons = 0x20
    for _ in range(3):
        gpu0, gpu1 = nvml.sample_gpus()
        assert gpu0.clock_event_reasons == ("sw_thermal",)
        assert gpu0.temperature_c == 35 and gpu1.temperature_c == 36
        assert gpu0.power_limit_w == 400.0
    for fn in missing:
        assert fake.calls[fn] == 1, fn  # once for the whole driver, not once per GPU
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 6


def test_a_function_an_old_binding_does_not_wrap(monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    monkeypatch.delattr(FakeNvml, "nvmlDeviceGetTemperatureV")
    monkeypatch.delattr(FakeNvml, "nvmlDeviceGetTemperature")
    sample = nvml.sample_gpu(0)
    assert sample.temperature_c is NA
    assert_gpu_json({**sample.to_json(), "temperature_c": 35}, fake.gpus[0])


def test_a_transient_error_is_retried(monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    fake.gpus[0].flaky["nvmlDeviceGetUtilizationRates"] = 1
    first = nvml.sample_gpu(0)
    assert first.util_gpu is NA and first.util_memory is NA
    assert first.memory_used == 1 * GIB
    assert nvml.sample_gpu(0).util_gpu == 0


def test_no_per_process_accounting(monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    fake.gpus[0].unsupported = {"nvmlDeviceGetComputeRunningProcesses"}
    sample = nvml.sample_gpu(0)
    assert sample.processes is NA
    assert sample.to_json()["processes"] is None


def test_a_gpu_lost_mid_run(monkeypatch):
    fake = install(monkeypatch, FakeNvml(2))
    before = nvml.sample_gpus()
    assert not any(s.lost for s in before)

    fake.gpus[1].lost = True  # fell off the bus (Xid 79)
    gpu0, gpu1 = nvml.sample_gpus()
    assert gpu0.memory_used == 1 * GIB and not gpu0.lost
    assert gpu1.lost
    # Who it was stays known; what it does is not.
    assert (gpu1.uuid, gpu1.name, gpu1.pci_bus_id) == (
        before[1].uuid,
        before[1].name,
        before[1].pci_bus_id,
    )
    assert gpu1.memory_used is NA and gpu1.processes is NA
    assert gpu1.to_json()["lost"] is True

    asked = sum(n for (fn, i), n in fake.device_calls.items() if i == 1)
    for _ in range(3):
        assert nvml.sample_gpus()[1].lost
    assert sum(n for (fn, i), n in fake.device_calls.items() if i == 1) == asked
    assert nvml.status().available

    # A reset brings it back; a new NVML session forgets what the old one learned.
    fake.gpus[1].lost = False
    nvml.shutdown()
    assert fake.calls["nvmlShutdown"] == 1
    assert not nvml.sample_gpu(1).lost


def test_a_gpu_lost_before_it_was_ever_seen(monkeypatch):
    fake = install(monkeypatch, FakeNvml(2))
    fake.gpus[0].lost = True
    gpu0, gpu1 = nvml.sample_gpus()
    assert gpu0.lost and gpu0.uuid is NA
    assert not gpu1.lost
    assert nvml.uuids() == {1: fake.gpus[1].uuid}


def test_shutdown_then_the_next_call_starts_again(monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    assert nvml.device_count() == 1
    nvml.shutdown()
    assert not fake.initialised
    assert nvml.device_count() == 1
    assert fake.calls["nvmlInit"] == 2
