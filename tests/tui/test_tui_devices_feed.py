"""The run screen's device feed reads the run's telemetry.jsonl; it samples for itself, in
memory, only while a live run has nobody recording it."""

from __future__ import annotations

import json
import time

import pytest
from test_telemetry_fake import FakeNvml, install

from gpu_console.tui import devices
from gpu_console.tui.devices import DeviceFeed

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def sample(t: float, every_s: float = 1.0) -> dict:
    gpu = {
        "index": 0,
        "uuid": "GPU-a",
        "name": "NVIDIA L4",
        "memory_used": 2**30,
        "memory_total": 24 * 2**30,
        "util_gpu": 40,
        "temperature_c": 50,
        "power_w": 60.0,
    }
    return {
        "v": 1,
        "t": t,
        "kind": "sample",
        "every_s": every_s,
        "nvml": {"available": True},
        "gpus": [gpu],
        "host": {"processes": []},
        "ranks": [],
    }


def append(run, *lines: dict) -> None:
    with (run / "telemetry.jsonl").open("a") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)


def test_a_live_recorded_run_is_read_from_its_file(tmp_path, monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    append(tmp_path, sample(time.time() - 2), sample(time.time() - 1))
    feed = DeviceFeed(tmp_path)
    try:
        assert feed.update(True, {})
        assert (feed.source, feed.sampler) == ("file", None)
        assert [g["util_mean"] for g in feed.view("cuda", {}, {}).gpus] == [40]
        # Later in a long run a line stands for a longer interval: 30 s old is not stale.
        append(tmp_path, sample(time.time() + 30, every_s=64.0))
        monkeypatch.setattr(time, "time", lambda: feed._file_t + 30)
        feed.update(True, {})
        assert feed._recorded() and (feed.source, feed.sampler) == ("file", None)
        monkeypatch.setattr(time, "time", lambda: feed._file_t + 200)
        assert not feed._recorded()  # more than twice its interval: nobody records
        assert fake.calls["nvmlInit"] == 0
    finally:
        feed.close()


def test_a_live_run_nobody_records_is_sampled_in_memory_only(tmp_path, monkeypatch):
    install(monkeypatch, FakeNvml(1))
    monkeypatch.setattr(devices, "FRESH_SAMPLE_S", 0.05)
    feed = DeviceFeed(tmp_path, interval_s=0.02)
    try:
        feed.update(True, {})
        assert feed.sampler is None  # the supervisor's first sample may be on its way
        time.sleep(0.1)
        feed.update(True, {})
        assert feed.sampler is not None and feed.source == "live"
        feed.update(False, {})  # the run ended: back to reading only
        assert feed.sampler is None
    finally:
        feed.close()
    assert not (tmp_path / "telemetry.jsonl").exists()
