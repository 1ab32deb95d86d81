"""The background sampler (thread, ring buffers) and the supervisor's recorder of the run's
telemetry.jsonl, through the fake-NVML seam."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import wait_for
from test_telemetry_fake import GIB, FakeNvml, assert_gpu_json, install
from test_telemetry_host import trees  # noqa: F401 - a fixture

from gpu_console.telemetry.host import HostSampler, RunPids
from gpu_console.telemetry.recorder import Recorder
from gpu_console.telemetry.sampler import FILE, Sampler, read_samples, take_sample

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

HOST_FIELDS = {
    "cpu_percent",
    "cores",
    "physical_cores",
    "load_1m",
    "ram_total",
    "ram_used",
    "ram_available",
    "processes",
}


@pytest.fixture
def run(tmp_path, trees):  # noqa: F811
    """A run directory whose status.json names a real process tree as the supervisor, on
    GPUs 0 and 1 (meta.json's placement)."""
    tree = trees()
    path = tmp_path / "run-1"
    path.mkdir()
    (path / "status.json").write_text(
        json.dumps({"state": "running", "pids": {"supervisor": tree.pid, "workers": []}})
    )
    placement = {"device_type": "cuda", "nproc": 2, "cuda_visible_devices": "0,1"}
    (path / "meta.json").write_text(json.dumps({"placement": placement}))
    return SimpleNamespace(path=path, tree=tree)


@pytest.fixture
def recorders():
    made: list[Recorder] = []

    def make(*args, **kwargs) -> Recorder:
        r = Recorder(*args, **kwargs)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@pytest.fixture
def sampler_factory():
    made: list[Sampler] = []

    def make(*args, **kwargs) -> Sampler:
        s = Sampler(*args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def test_the_recorder_appends_every_field_to_telemetry_jsonl(monkeypatch, run, recorders):
    fake = install(monkeypatch, FakeNvml(2))
    fake.gpus[1].processes = [(run.tree.pid, 2 * GIB)]
    recorder = recorders(run.path, interval_s=0.02).start()
    assert recorder.writing
    wait_for(lambda: len(read_samples(run.path)) >= 5, what="five samples on disk")
    recorder.stop()
    assert not recorder.writing
    lines = read_samples(run.path)
    assert len(lines) == recorder.ticks + 1  # every tick, and the last one at stop; none torn
    for line in lines:
        assert (line["v"], line["kind"]) == (1, "sample")
        assert line["nvml"] == {"available": True, "reason": ""}
        for gpu, fake_gpu in zip(line["gpus"], fake.gpus, strict=True):
            assert_gpu_json(gpu, fake_gpu)
        assert set(line["host"]) >= HOST_FIELDS
        procs = {p["pid"]: p for p in line["host"]["processes"]}
        assert set(procs) == {run.tree.pid, run.tree.child}
        assert procs[run.tree.pid]["role"] == "supervisor"
        assert procs[run.tree.pid]["rss"] > 0
        assert line["ranks"] == []
        assert line["cost_s"] >= 0
        assert line["every_s"] == 0.02
    assert lines[-1]["t"] >= lines[0]["t"]
    assert isinstance(lines[-1]["host"]["processes"][0]["cpu_percent"], float)


def test_the_console_sampler_keeps_history_in_memory_only(monkeypatch, run, sampler_factory):
    install(monkeypatch, FakeNvml(1))
    sampler = sampler_factory(run.path, interval_s=0.02).start()
    wait_for(lambda: sampler.samples >= 3, what="three samples")
    sampler.stop()
    assert not (run.path / FILE).exists()
    assert sampler.latest["gpus"][0]["index"] == 0
    assert len(sampler.history("gpu0.util_gpu")) == sampler.samples


def test_one_writer_a_second_recorder_writes_nothing(monkeypatch, run, recorders):
    install(monkeypatch, FakeNvml(1))
    first = recorders(run.path, interval_s=0.05).start()
    second = recorders(run.path, interval_s=0.05).start()
    assert first.writing and not second.writing
    assert "another process is recording it" in second.write_error
    wait_for(lambda: second.ticks >= 2, what="the second one sampling")
    first.stop()
    second.stop()
    assert len(read_samples(run.path)) == first.ticks + 1


def test_ring_buffers_are_bounded_and_departed_processes_dropped(monkeypatch, run):
    install(monkeypatch, FakeNvml(2))
    sampler = Sampler(run.path, history=5)
    for _ in range(12):
        sampler.sample_once()
    assert sampler.samples == 12
    points = sampler.history("gpu1.memory_used")
    assert len(points) == 5 and all(v == 2 * GIB for _, v in points)
    assert [t for t, _ in points] == sorted(t for t, _ in points)
    names = sampler.metrics()
    for name in ("host.cpu_percent", "host.ram_used", "gpu0.temperature_c", "gpu1.power_w"):
        assert name in names
    pid_series = f"pid{run.tree.child}.rss"
    assert pid_series in names and len(sampler.history(pid_series)) == 5

    run.tree.end()
    sampler.sample_once()
    assert not any(n.startswith("pid") for n in sampler.metrics())
    assert sampler.history("no.such.metric") == []


def test_a_gpu_lost_while_the_thread_runs(monkeypatch, run, recorders):
    fake = install(monkeypatch, FakeNvml(2))
    recorder = recorders(run.path, interval_s=0.02).start()
    wait_for(lambda: recorder.ticks >= 2, what="samples before the loss")
    fake.gpus[1].lost = True
    wait_for(
        lambda: recorder.latest and recorder.latest["gpus"][1]["lost"],
        what="the loss in a sample",
    )
    seen = recorder.ticks
    wait_for(lambda: recorder.ticks >= seen + 3, what="sampling to go on")
    assert recorder.last_error is None
    recorder.stop()
    lines = read_samples(run.path)
    lost = [line["gpus"][1] for line in lines if line["gpus"][1]["lost"]]
    assert lost and all(g["uuid"] == fake.gpus[1].uuid and g["util_gpu"] is None for g in lost)
    assert all(not line["gpus"][0]["lost"] for line in lines)


def test_a_failing_tick_is_reported_and_the_thread_survives(monkeypatch, tmp_path, sampler_factory):
    fake = install(monkeypatch, FakeNvml(1))
    fake.gpus[0].broken = {"nvmlDeviceGetMemoryInfo"}  # not an NVMLError: a bug somewhere
    sampler = sampler_factory(interval_s=0.02).start()
    wait_for(lambda: sampler.last_error, what="the error to be recorded")
    assert sampler.last_error.startswith("RuntimeError: nvmlDeviceGetMemoryInfo is broken")
    assert sampler.running
    fake.gpus[0].broken = set()
    wait_for(lambda: sampler.samples >= 2, what="samples after the fault")


def test_without_nvml_the_host_is_still_sampled(monkeypatch, run, recorders):
    import pynvml

    install(monkeypatch, FakeNvml(2, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    recorder = recorders(run.path, interval_s=0.02).start()
    wait_for(lambda: len(read_samples(run.path)) >= 2, what="host-only samples")
    recorder.stop()
    line = read_samples(run.path)[-1]
    assert line["nvml"]["available"] is False
    assert "library not found" in line["nvml"]["reason"]
    assert line["gpus"] == [] and line["host"]["processes"]


def test_a_torn_last_line_is_skipped(tmp_path):
    good = {"v": 1, "t": 1.0, "kind": "sample", "gpus": [], "host": {}, "ranks": []}
    (tmp_path / FILE).write_text(json.dumps(good) + "\n" + '{"v": 1, "t": 2.0, "ki')
    assert read_samples(tmp_path) == [good]
    assert read_samples(tmp_path / "nowhere") == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="interval_s"):
        Sampler(interval_s=0)
    with pytest.raises(ValueError, match="history"):
        Sampler(history=0)
    with pytest.raises(ValueError, match="interval_s"):
        Recorder(Path("nowhere"), interval_s=0)


def test_one_sample_of_a_run_tree_stays_cheap(trees):  # noqa: F811
    """A generous bound, not a benchmark: the psutil part must stay far below a 1 s tick."""
    tree = trees()
    host = HostSampler()
    pids = RunPids(supervisor=tree.pid)
    costs = []
    for _ in range(30):
        started = time.perf_counter()
        take_sample(host, pids)
        costs.append(time.perf_counter() - started)
    assert statistics.median(costs) < 0.05
