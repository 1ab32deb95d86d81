"""Every run records its GPUs: the supervisor writes telemetry.jsonl for the run's whole life
(no console needed), thinned to a bounded size, and the fold in state.py turns it into the
per-GPU figures that the headless summary and ``ls --json`` show.

The real CLI runs headless on 2 CPU ranks; the supervisor takes its NVML handle from
``GPU_CONSOLE_FAKE_NVML`` (tests/nvml_run_fake.py: two GPUs held by the two ranks)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    deadline,
    fake_gpus_env,
    fast_profile,
    only_run,
    paced_profile,
    read_events,
    read_status,
)
from conftest import test_env as cli_env
from nvml_run_fake import POWER_W, UTIL
from test_telemetry_fake import GIB, FakeGpu, FakeNvml, install

from gpu_console.state import TelemetryFold, gpu_figures
from gpu_console.telemetry.figures import describe
from gpu_console.telemetry.recorder import LEVEL_LINES, Recorder, Thinning, lines_after
from gpu_console.telemetry.sampler import FILE, read_samples

WEEK_S = 7 * 24 * 3600


def fake_env(fake: str = "nvml_run_fake:two_gpus") -> dict[str, str]:
    return fake_gpus_env(fake)


def lines_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / FILE).read_text().splitlines()]


def expected_figures(samples: list[dict], index: int) -> dict:
    """What the fold must say about GPU ``index``, worked out from the recorded readings."""
    rows = [(s["t"], g) for s in samples for g in s["gpus"] if g["index"] == index]
    span = rows[-1][0] - rows[0][0]
    energy = [g["energy_mj"] for _, g in rows]
    return {
        "samples": len(rows),
        "span_s": span,
        "memory_peak": max(g["memory_used"] for _, g in rows),
        "temperature_max": max(g["temperature_c"] for _, g in rows),
        "counter_wh": (energy[-1] - energy[0]) / 3.6e6 if energy[0] is not None else None,
        "power_wh": POWER_W[index] * span / 3600,  # the fake's power is constant
    }


@pytest.fixture(scope="module")
def headless_run(tmp_path_factory):
    """One real headless run (no console ever attached), shared by the checks below."""
    from conftest import Procs

    tmp = tmp_path_factory.mktemp("recorded")
    runs = tmp / "runs"
    procs = Procs(runs)
    try:
        # Paced (3 s at least): the ranks live for several of the supervisor's ticks, so a
        # rank's CPU % (a difference of two ticks' readings) is measured however fast the
        # machine and the start-up are.
        profile = paced_profile(tmp, max_steps=60)
        done = procs.cli(
            "run", str(profile), "--headless", "--devices", "cpu:2", "--runs-dir", str(runs),
            cwd=tmp, env={**fake_env(), "PACE_S": "0.05"},
        )  # fmt: skip
        listed = procs.cli("ls", "--json", "--runs-dir", str(runs), env=fake_env())
    finally:
        procs.cleanup()
    return done, listed, only_run(runs)


def test_a_headless_run_has_gpu_samples_from_its_start_to_its_end(headless_run):
    done, _, run = headless_run
    assert done.returncode == 0, done.stderr
    status = read_status(run)
    lines = lines_of(run)
    samples = [x for x in lines if x["kind"] == "sample"]
    assert lines[-1]["kind"] == "summary" and len(samples) == len(lines) - 1
    # From the supervisor's start (its first tick) to its end (the last, at the final status).
    # Quiet-machine bounds, stretched on a busy one (a tick can come late, never early).
    assert samples[0]["t"] - status["started"] < deadline(2.0)
    assert status["ended"] >= samples[-1]["t"] >= read_events(run)[-1]["t"] - 0.01
    assert all(b["t"] - a["t"] < deadline(1.5) for a, b in zip(samples, samples[1:], strict=False))
    assert all(s["every_s"] == 1.0 for s in samples)  # a short run is written at every tick
    # The GPUs are the ranks' (by UUID through NVML's process lists), each rank's process too.
    with_ranks = [s for s in samples if {r["rank"] for r in s["ranks"]} == {0, 1}]
    assert with_ranks
    for s in with_ranks:
        assert [g["name"] for g in s["gpus"]] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
        assert {(r["rank"], r["gpu"], r["source"]) for r in s["ranks"]} == {
            (0, 0, "nvml"),
            (1, 1, "nvml"),
        }
        workers = [p for p in s["host"]["processes"] if p["role"] == "worker"]
        assert sorted(p["rank"] for p in workers) == [0, 1]
        assert all(p["rss"] > 0 for p in workers)
    assert any(
        isinstance(p["cpu_percent"], float)
        for s in with_ranks
        for p in s["host"]["processes"]
        if p["role"] == "worker"
    )
    # Before the ranks started, nothing said which GPUs were the run's: none recorded.
    assert samples[0]["gpus"] == []


def test_the_summary_and_ls_json_show_what_each_gpu_did(headless_run):
    done, listed, run = headless_run
    samples = [x for x in lines_of(run) if x["kind"] == "sample"]
    (row,) = json.loads(listed.stdout)
    gpus = row["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    for g in gpus:
        want = expected_figures(samples, g["index"])
        assert g["util_mean"] == UTIL[g["index"]]
        assert g["memory_peak"] == want["memory_peak"] and g["memory_total"] == 80 * GIB
        assert g["temperature_max"] == want["temperature_max"]
        assert g["samples"] == want["samples"]
        assert g["span_s"] == pytest.approx(want["span_s"], abs=1e-3)
    h100, a100 = gpus
    assert h100["energy_source"] == "counter"
    assert h100["energy_wh"] == pytest.approx(expected_figures(samples, 0)["counter_wh"], abs=1e-4)
    # The counter advanced at the fake's power draw: the same energy as integrating it.
    assert h100["energy_wh"] == pytest.approx(expected_figures(samples, 0)["power_wh"], rel=0.1)
    assert a100["energy_source"] == "power"
    assert a100["energy_wh"] == pytest.approx(expected_figures(samples, 1)["power_wh"], abs=1e-4)
    # The headless summary: one row per GPU with those figures.
    rows = [line for line in done.stdout.splitlines() if line.startswith("GPU ")]
    assert len(rows) == 2
    for g, line in zip(gpus, rows, strict=True):
        assert line == f"GPU {g['index']}: {describe(g)}"
    assert "util 87 %" in rows[0] and "(NVML energy counter)" in rows[0]
    assert "util 55 %" in rows[1] and "(integrated power)" in rows[1]


def test_a_cpu_run_without_nvml_says_nothing_about_gpus(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=5)
    env = fake_env("test_telemetry_supervisor:no_driver")
    # One rank: what is checked is the supervisor's NVML, none of it crosses ranks.
    done = procs.cli(
        "run", str(profile), "--headless", "--devices", "cpu:1", "--runs-dir", str(runs_dir),
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = only_run(runs_dir)
    samples = read_samples(run)
    assert samples and all(s["gpus"] == [] and not s["nvml"]["available"] for s in samples)
    assert any(p["role"] == "worker" for s in samples for p in s["host"]["processes"])
    # No per-GPU row (`GPU 0: …`); the MFU row may still say why a CPU run has no MFU.
    assert not re.search(r"\bGPU \d", done.stdout), done.stdout
    listed = procs.cli("ls", "--json", "--runs-dir", str(runs_dir), env=env)
    assert json.loads(listed.stdout)[0]["gpus"] == []


def no_driver() -> FakeNvml:
    import pynvml

    return FakeNvml(2, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


def test_the_supervisor_starts_without_nvml_or_torch_imported():
    """The recorder imports NVML on its own thread: importing the supervisor stays light."""
    code = "import sys, gpu_console.supervisor; print(sorted({'pynvml', 'torch'} & {*sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- bounded size --------------------------------------------------------------------------


def test_a_week_at_one_sample_a_second_stays_under_ten_thousand_lines():
    thinning = Thinning(LEVEL_LINES)
    written = [t for t in range(WEEK_S) if thinning.due()]  # a fake clock: one tick a second
    assert len(written) == thinning.lines == lines_after(WEEK_S) == 9183
    assert written[:3] == [0, 1, 2]  # every second at first
    assert written[-1] - written[-2] == 512  # every 8.5 minutes at the end of the week
    # Logarithmic: each doubling of the run's length adds about LEVEL_LINES lines.
    assert lines_after(2 * WEEK_S) - lines_after(WEEK_S) <= LEVEL_LINES
    assert lines_after(30 * 24 * 3600) < 12_000


def sample_line(gpus: int, ranks: int) -> int:
    """Bytes of one line as the recorder writes it: ``gpus`` fake GPUs, ``ranks`` ranks."""
    from gpu_console.telemetry import nvml
    from gpu_console.telemetry.ranks import rank_gpus

    fake = FakeNvml([FakeGpu(i, processes=[(5000 + i, 30 * GIB)]) for i in range(gpus)])
    nvml.pynvml, nvml._state["initialised"] = fake, False
    visible = ",".join(map(str, range(gpus)))
    procs = [
        {"pid": 4000, "ppid": 1, "role": "supervisor", "name": "python", "cpu_percent": 0.5,
         "rss": 61_000_000},
        {"pid": 4001, "ppid": 4000, "role": "torchrun", "name": "python", "cpu_percent": 0.7,
         "rss": 93_000_000},
    ] + [
        {"pid": 5000 + r, "ppid": 4001, "role": "worker", "name": "python", "cpu_percent": 99.7,
         "rss": 4_123_456_789, "rank": r, "local_rank": r, "cuda_visible_devices": visible,
         "cuda_device_order": "PCI_BUS_ID"}
        for r in range(ranks)
    ]  # fmt: skip
    host = {
        "cpu_percent": 12.5,
        "cores": 64,
        "physical_cores": 32,
        "load_1m": 3.25,
        "ram_total": 2**40,
        "ram_used": 2**38,
        "ram_available": 2**39,
        "processes": procs,
    }
    sample = {"v": 1, "t": 1_790_000_000.123, "kind": "sample",
              "nvml": {"available": True, "reason": ""},
              "gpus": [g.to_json() for g in nvml.sample_gpus()], "host": host}  # fmt: skip
    sample["ranks"] = rank_gpus(sample)
    sample["cost_s"], sample["every_s"] = 0.001234, 512.0
    return len(json.dumps(sample, separators=(",", ":"))) + 1


def test_a_week_long_runs_file_size(monkeypatch):
    """The sizes docs/running.md states: 1 GPU and 1 rank, 8 GPUs and 8 ranks, a week at 1 s."""
    install(monkeypatch, FakeNvml(0))
    one, eight = sample_line(1, 1), sample_line(8, 8)
    assert 1000 < one < 1500 and 6000 < eight < 8000
    lines = lines_after(WEEK_S)
    assert lines * one < 14 * 2**20  # docs/running.md: about 12 MB
    assert lines * eight < 70 * 2**20  # docs/running.md: about 63 MB


def test_the_recorder_thins_the_file_and_its_summary_still_covers_every_tick(tmp_path):
    """A fake clock and readings: a peak on a tick that is not written is still the peak."""
    clock = {"t": 1000.0}
    ticks = 700

    def take() -> dict:
        clock["t"] += 1.0
        n = int(clock["t"] - 1000)
        memory = 50 * GIB if n == 555 else 10 * GIB  # tick 555 is not written (stride 4)
        gpu = {
            "index": 0,
            "uuid": "GPU-a",
            "name": "NVIDIA H100 80GB HBM3",
            "lost": False,
            "memory_used": memory,
            "memory_total": 80 * GIB,
            "util_gpu": 40 + n % 2 * 20,
            "temperature_c": 70,
            "power_w": 360.0,
            "energy_mj": 1_000_000 + n * 360_000,
        }
        return {"v": 1, "t": clock["t"], "kind": "sample", "nvml": {"available": True},
                "gpus": [gpu], "host": {"processes": []}, "ranks": []}  # fmt: skip

    recorder = Recorder(tmp_path, level_lines=100, sample=take)
    recorder._open()
    recorder._setup()
    for _ in range(ticks):
        recorder.tick()
    recorder.finish()
    recorder._close()
    lines = lines_of(tmp_path)
    samples = [x for x in lines if x["kind"] == "sample"]
    assert len(samples) == lines_after(ticks, 100) + 1  # and the last one, at the end
    assert [s["every_s"] for s in samples[:101:50]] == [1.0, 1.0, 2.0]
    assert all(s["gpus"][0]["memory_used"] == 10 * GIB for s in samples)
    (fig,) = lines[-1]["gpus"]
    assert fig["memory_peak"] == 50 * GIB  # only the summary saw it
    assert fig["samples"] == ticks + 1
    assert fig["util_mean"] == pytest.approx(50, abs=0.1)
    assert fig["energy_source"] == "counter"
    assert fig["energy_wh"] == pytest.approx(ticks * 360 / 3600)  # 360 J a second
    # A reader takes the summary as is: read in full, or only the summary (an ended run),
    # each GPU marked with its node (one machine: node 0; no meta.json here: no host).
    summary = [{**g, "host": None, "node": 0} for g in lines[-1]["gpus"]]
    assert gpu_figures(tmp_path) == summary
    fold = TelemetryFold(tmp_path)
    fold.poll()
    assert fold.gpus() == summary
    quick = TelemetryFold(tmp_path)
    assert quick.skip_to_summary() and quick.samples == 0  # no sample line parsed
    assert quick.gpus() == summary and not quick.poll()
    assert not TelemetryFold(tmp_path / "nowhere").skip_to_summary()


def test_a_continued_run_goes_on_from_what_the_file_holds(tmp_path):
    """A second supervisor in the same directory: the thinning and the fold go on."""

    def recorder_of(start: float, count: int) -> Recorder:
        clock = {"t": start}

        def take() -> dict:
            clock["t"] += 1.0
            gpu = {
                "index": 0,
                "uuid": "GPU-a",
                "memory_used": int(clock["t"]),
                "util_gpu": 100,
                "power_w": 100.0,
                "energy_mj": None,
                "temperature_c": 60,
            }
            return {"t": clock["t"], "kind": "sample", "gpus": [gpu]}

        r = Recorder(tmp_path, level_lines=10, sample=take)
        r._open()
        r._setup()
        for _ in range(count):
            r.tick()
        r.finish()
        r._close()
        return r

    first = recorder_of(0.0, 15)  # 10 at every tick, then every 2nd
    second = recorder_of(5000.0, 8)
    assert first.thinning.lines == 10 + 2 + 1
    assert second.thinning.stride == 2 and second.thinning.lines == 13 + 4 + 1
    (fig,) = gpu_figures(tmp_path)
    assert fig["samples"] == 16 + 9
    assert fig["memory_peak"] == 5009
    assert fig["energy_source"] == "power"
    # 100 W over both stretches (15 s and 8 s of samples), not over the gap between them.
    assert fig["energy_wh"] == pytest.approx(100 * (15 + 8) / 3600, abs=1e-4)


# -- the fold ------------------------------------------------------------------------------


def gpu(t: float, **kw) -> dict:
    base = {"index": 0, "uuid": "GPU-a", "name": "NVIDIA A100-SXM4-80GB", "lost": False,
            "memory_total": 80 * GIB}  # fmt: skip
    return {"t": t, "kind": "sample", "gpus": [{**base, **kw}]}


def test_the_fold_weighs_readings_by_time_and_reads_incrementally(tmp_path):
    path = tmp_path / FILE
    rows = [
        gpu(0, util_gpu=100, memory_used=5 * GIB, temperature_c=60, power_w=200.0),
        gpu(1, util_gpu=100, memory_used=7 * GIB, temperature_c=71, power_w=200.0),
        gpu(9, util_gpu=0, memory_used=6 * GIB, temperature_c=65, power_w=200.0),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    fold = TelemetryFold(tmp_path)
    assert fold.poll() and fold.gpus()[0]["util_mean"] == 100
    assert not fold.poll()  # nothing new
    with path.open("a") as f:
        f.write(json.dumps(rows[2]) + "\n" + '{"t": 10, "kind": "sam')  # and a torn line
    assert fold.poll()
    (fig,) = fold.gpus()
    # 1 s at 100 %, then 8 s falling from 100 % to 0 %: (100 + 400) / 9.
    assert fig["util_mean"] == pytest.approx(500 / 9, abs=0.01)
    assert fig["memory_peak"] == 7 * GIB and fig["temperature_max"] == 71
    assert (fig["energy_wh"], fig["energy_source"]) == (pytest.approx(200 * 9 / 3600), "power")
    assert (fig["samples"], fig["span_s"]) == (3, 9)
    assert "util 56 %, peak 7.0 GiB / 80 GiB, max 71 °C, 0.500 Wh (integrated power)" in describe(
        fig
    )


def test_the_energy_counter_wins_and_survives_a_driver_reload():
    fold = TelemetryFold()
    for t, mj in ((0, 10_000_000), (10, 13_600_000), (20, 1_000_000), (30, 4_600_000)):
        fold.add(gpu(t, power_w=9999.0, energy_mj=mj))  # power is ignored beside a counter
    (fig,) = fold.gpus()
    assert fig["energy_source"] == "counter"
    assert fig["energy_wh"] == pytest.approx(2.0)  # 3600 J twice; the reset step is not counted


def test_a_lost_gpu_and_missing_readings_are_not_zeros():
    fold = TelemetryFold()
    fold.add(gpu(0, util_gpu=None, memory_used=None, temperature_c=None, power_w=None))
    fold.add(gpu(1, lost=True, util_gpu=None))
    (fig,) = fold.gpus()
    assert fig["util_mean"] is None and fig["memory_peak"] is None
    assert fig["energy_wh"] is None and fig["energy_source"] is None
    assert describe(fig) == "NVIDIA A100-SXM4-80GB: no readings"
    assert TelemetryFold().gpus() == []


# -- on a real GPU -------------------------------------------------------------------------


@pytest.fixture
def cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.mark.gpu
def test_a_headless_gpu_run_records_its_gpu(cuda, procs, runs_dir, tmp_path):
    from gpu_console.telemetry import nvml

    profile = fast_profile(tmp_path, max_steps=200)
    env = cli_env(COLUMNS="200")
    done = procs.cli(
        "run", str(profile), "--headless", "--devices", "0", "--runs-dir", str(runs_dir), env=env
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run = only_run(runs_dir)
    uuid = nvml.uuids()[0]
    samples = read_samples(run)
    assert samples and all([g["uuid"] for g in s["gpus"]] == [uuid] for s in samples)
    assert any(r["rank"] == 0 and r["uuid"] == uuid for s in samples for r in s["ranks"])
    (fig,) = gpu_figures(run)
    assert fig["uuid"] == uuid and fig["samples"] == len(samples)
    assert fig["memory_peak"] > 0 and fig["energy_wh"] > 0
    assert fig["energy_source"] in ("counter", "power")
    listed = procs.cli("ls", "--json", "--runs-dir", str(runs_dir), env=env)
    assert json.loads(listed.stdout)[0]["gpus"] == [fig]
    assert describe(fig) in done.stdout


def test_a_recorder_after_a_killed_one_starts_on_a_line_of_its_own(tmp_path):
    torn = json.dumps(gpu(1.0, util_gpu=10)) + "\n" + '{"t": 2.0, "kind": "sample", "gp'
    (tmp_path / FILE).write_text(torn)
    recorder = Recorder(tmp_path, sample=lambda: gpu(3.0, util_gpu=30))
    recorder._open()
    recorder._setup()
    recorder.tick()
    recorder._close()
    assert [s["t"] for s in read_samples(tmp_path)] == [1.0, 3.0]
