"""TensorBoard as the run trains (results/tensorboard.py, fed by the supervisor).

The mirror alone, read back with TensorBoard's own EventAccumulator: tags, steps, texts, the
purge mark that keeps a resumed run one curve, telemetry on the step axis, a real full disk.
Then real runs through torchrun: a quickstart's curves while it trains and after, a Ctrl-C
and a resume from an earlier checkpoint without duplicate steps, and a run without the
package (one line at launch, the run trains).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    Procs,
    deadline,
    events_of,
    fake_gpus_env,
    fast_profile,
    only_run,
    paced_profile,
    pinned_env,
    read_status,
    run_dirs,
    wait_for,
    without_packages,
)
from conftest import test_env as cli_env
from nvml_run_fake import POWER_W, UTIL

from gpu_console.results.tensorboard import TensorBoardMirror

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard package (the dev extra installs it)",
)

T0 = 1_800_000_000.0


def _read(log_dir: Path):
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def _steps(acc, tag: str) -> list[int]:
    return [s.step for s in acc.Scalars(tag)]


def _values(acc, tag: str) -> dict[int, float]:
    return {s.step: s.value for s in acc.Scalars(tag)}


def _start(step: int = 0, t: float = T0, **kw) -> dict:
    versions = {"torch": "2.13.0"}
    return dict(
        kind="start",
        t=t,
        start_step=step,
        max_steps=100,
        task="mlp",
        world_size=2,
        precision="fp32",
        versions=versions,
        **kw,
    )


def _step(step: int, t: float, loss: float, **kw) -> dict:
    return {"kind": "step", "t": t, "step": step, "loss": loss, "loss_avg": loss + 0.5,
            "lr": 0.01, "grad_norm": 1.5, "samples_per_s": 640.0, "step_time_s": 0.05,
            "memory": [{"rank": 0, "allocated": 2 * 1024**3, "reserved": 0, "peak": 3 * 1024**3}],
            **kw}  # fmt: skip


def test_steps_evals_and_texts_are_what_tensorboard_reads(tmp_path):
    m = TensorBoardMirror(tmp_path, "[train]\nlr = 0.01\n")
    m.event(_start())
    m.event(_step(10, T0 + 1, 0.9, metrics={"accuracy": 0.5}, tokens_per_s=99.0, mfu=0.25))
    two = {"lrs": {"gen": 0.01, "disc": 0.02}, "grad_norms": {"gen": 1.0, "disc": 2.0}}
    m.event(_step(20, T0 + 2, 0.7, metrics={"accuracy": 0.75}, **two))
    m.event({"kind": "eval", "t": T0 + 3, "step": 20, "loss": 0.6, "val/loss": 0.65,
             "nn": 8.0, "flag": True})  # fmt: skip
    m.close()
    acc = _read(tmp_path / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss", "train/loss_avg", "train/grad_norm", "train/lr", "train/accuracy",
        "train/lr/gen", "train/lr/disc", "train/grad_norm/gen", "train/grad_norm/disc",
        "throughput/samples_per_s", "throughput/tokens_per_s", "throughput/mfu",
        "throughput/step_time_ms", "memory/rank0/allocated_gib", "memory/rank0/peak_gib",
        "eval/loss", "eval/val/loss", "eval/nn",
    } <= tags  # fmt: skip
    assert "eval/flag" not in tags  # a bool is no scalar
    assert _values(acc, "train/loss") == {10: pytest.approx(0.9), 20: pytest.approx(0.7)}
    assert _values(acc, "eval/val/loss") == {20: pytest.approx(0.65)}
    assert _values(acc, "memory/rank0/peak_gib") == {10: 3.0, 20: 3.0}
    assert _values(acc, "throughput/step_time_ms") == {
        10: pytest.approx(50.0),
        20: pytest.approx(50.0),
    }
    assert [s.wall_time for s in acc.Scalars("train/loss")] == [T0 + 1, T0 + 2]
    texts = {t: acc.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in ("profile", "start")}
    assert "[train]" in texts["profile"] and "lr = 0.01" in texts["profile"]
    assert "| world_size | 2 |" in texts["start"] and "| torch | 2.13.0 |" in texts["start"]


def test_a_later_session_purges_what_the_last_wrote_past_its_checkpoint(tmp_path):
    first = TensorBoardMirror(tmp_path, "")
    first.event(_start())
    for step in range(10, 60, 10):  # ran to 50; its last checkpoint was at 30
        first.event(_step(step, T0 + step, 1.0 / step))
        first.sample(_sample(T0 + step + 1))
    first.close()
    second = TensorBoardMirror(tmp_path, "")
    second.sample(_sample(T0 + 99))  # the resumed session's start-up: no step yet
    second.event(_start(30, T0 + 100, resumed_from="checkpoints/step-30"))
    for step in (40, 50, 60):
        second.event(_step(step, T0 + 100 + step, 2.0 / step))
        second.sample(_sample(T0 + 100 + step + 0.1))
    second.close()
    files = [p for p in (tmp_path / "tensorboard").iterdir() if p.is_file()]
    assert len(files) == 2  # a file per session
    acc = _read(tmp_path / "tensorboard")
    assert _steps(acc, "train/loss") == [10, 20, 30, 40, 50, 60]  # one curve, each step once
    losses = _values(acc, "train/loss")
    assert losses[30] == pytest.approx(1 / 30) and losses[40] == pytest.approx(2 / 40)
    telemetry = _steps(acc, "host/cpu_percent")  # each session's from the step it was at
    assert telemetry == sorted(set(telemetry)) and telemetry[-1] > 50
    assert telemetry == [19, 29, 41, 51, 61]  # none from before a start, none purged twice


def _sample(t: float) -> dict:
    gpu = {"index": 0, "util_gpu": 87.0, "memory_used": 4 * 1024**3, "temperature_c": 61,
           "power_w": 250.5}  # fmt: skip
    host = {"cpu_percent": 40.0, "ram_used": 1024**3}
    return {"t": t, "gpus": [gpu, {"index": 1, "lost": True}], "host": host}


def test_telemetry_takes_steps_of_its_own_between_logged_steps(tmp_path):
    m = TensorBoardMirror(tmp_path, "")
    m.sample(_sample(T0 - 1))  # before the start: no step yet, left out
    m.event(_start())
    m.event(_step(10, T0 + 1.0, 0.5))  # logged every 10 steps, 0.05 s a step
    m.sample(_sample(T0 + 1.2))  # 4 steps on: 14
    m.sample(_sample(T0 + 1.15))  # taken before, read after: the next step, never back
    m.sample(_sample(T0 + 1.5))  # 10 steps on, but step 20 is the next log's: 19
    m.sample(_sample(T0 + 1.6))  # no step left before 20: left out
    m.event(_step(20, T0 + 2.0, 0.4))
    m.sample(_sample(T0 + 2.12))
    m.close()
    acc = _read(tmp_path / "tensorboard")
    assert _steps(acc, "gpu0/util_percent") == [14, 15, 19, 22]
    assert _steps(acc, "host/cpu_percent") == [14, 15, 19, 22]
    assert m.telemetry_skipped == 1
    assert _values(acc, "gpu0/memory_used_gib")[22] == 4.0
    assert _values(acc, "gpu0/power_w")[22] == pytest.approx(250.5)
    assert _values(acc, "host/ram_used_gib")[22] == 1.0
    assert not any(t.startswith("gpu1/") for t in acc.Tags()["scalars"])  # a lost GPU


def test_a_full_disk_drops_records_whole_and_writing_goes_on(small_disk):
    m = TensorBoardMirror(small_disk.path, "")
    m.event(_start())
    m.event(_step(10, T0 + 1, 0.5))
    ballast = small_disk.fill()
    size = m.path.stat().st_size
    for step in range(20, 220, 10):  # a page's rest fills, then ENOSPC
        m.event(_step(step, T0 + step, 0.5, metrics={"pad": 1.0}))
    assert m.dropped > 0
    ballast.unlink()
    m.event(_step(300, T0 + 300, 0.25))
    m.close()
    assert m.path.stat().st_size > size
    steps = _steps(_read(small_disk.path / "tensorboard"), "train/loss")
    assert steps[0] == 10 and steps[-1] == 300  # every record intact: the reader reached it
    assert len(steps) == 22 - m.dropped


def test_a_full_disk_at_the_first_record_leaves_no_file_and_a_later_one_opens_it(small_disk):
    ballast = small_disk.fill()
    m = TensorBoardMirror(small_disk.path, "")
    m.event(_start())  # the purge mark, then two texts: none fits
    assert m.dropped >= 1 and m.path is None
    logs = small_disk.path / "tensorboard"
    assert not any(p.is_file() for p in logs.rglob("*"))  # no file without its version record
    ballast.unlink()
    m.event(_step(10, T0 + 1, 0.5))
    m.close()
    assert m.path is not None and m.path.parent == logs
    assert _steps(_read(logs), "train/loss") == [10]


def test_the_mirror_imports_no_torch_and_no_numpy(tmp_path):
    code = (
        "import sys; from pathlib import Path\n"
        "from gpu_console.results.tensorboard import TensorBoardMirror\n"
        f"m = TensorBoardMirror(Path({str(tmp_path)!r}), 'a = 1')\n"
        "m.event({'kind': 'start', 't': 1.0, 'start_step': 0, 'task': 'mlp'})\n"
        "m.event({'kind': 'step', 't': 2.0, 'step': 1, 'loss': 0.5})\n"
        "m.close(); print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # The supervisor side never imports torch; numpy (through the package's stub) was 0.3 s
    # of its CPU for the CRC and the text summaries.
    assert done.stdout.strip() == "False False"


def test_the_record_framing_and_text_summary_are_the_packages_own(tmp_path):
    import random

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs
    from tensorboard.plugins.text.summary_v2 import text_pb

    from gpu_console.results.tensorboard import masked_crc32c, text_summary

    rng = random.Random(0)
    for n in (0, 1, 7, 8, 255, 1000):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert masked_crc32c(data) == theirs(data)
    text = "| setting | value |\n| --- | --- |\n| task | mlp é |"
    assert text_summary("start", text).SerializeToString() == (
        text_pb("start", text).SerializeToString()
    )


def test_without_the_package_a_launch_says_so_once_and_the_run_trains(procs, runs_dir, tmp_path):
    env = without_packages(tmp_path, "tensorboard")
    # One rank: the line is the launch's (launch.py), the ranks never look for the package.
    done = procs.cli(
        "run", str(fast_profile(tmp_path, max_steps=20)), "--headless", "--runs-dir",
        str(runs_dir), "--devices", "cpu:1", cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("TensorBoard: off, the tensorboard package is not installed") == 1
    run = only_run(runs_dir)
    assert read_status(run)["state"] == "finished"
    assert not (run / "tensorboard").exists()


def test_logging_tensorboard_false_writes_nothing(procs, runs_dir, tmp_path):
    done = procs.cli(
        "run", str(fast_profile(tmp_path, max_steps=20)), "--headless", "--runs-dir",
        str(runs_dir), "--devices", "cpu:1", "--set", "logging.tensorboard=false", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = only_run(runs_dir)
    assert read_status(run)["state"] == "finished" and not (run / "tensorboard").exists()
    assert "TensorBoard" not in done.stderr


def _started(
    procs, runs_dir, tmp_path, max_steps: int, pace_s: str, extra: str = "", env=None, ranks=1
):
    profile = paced_profile(tmp_path, max_steps=max_steps, extra=extra, ranks=ranks)
    proc = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                       cwd=tmp_path, env={**(env or cli_env()), "PACE_S": pace_s})  # fmt: skip
    (run,) = wait_for(lambda: run_dirs(runs_dir), what="the run directory")
    return proc, run


def _tags(run: Path) -> set[str]:
    if not (run / "tensorboard").is_dir():
        return set()
    return set(_read(run / "tensorboard").Tags()["scalars"])


def test_a_run_is_read_while_it_trains_and_after(procs, runs_dir, tmp_path):
    # Paced until what is read while it trains was read; then the rest of it at speed.
    pace = tmp_path / "pace"
    pace.touch()
    env = fake_gpus_env(PACE_WHILE=str(pace))
    proc, run = _started(procs, runs_dir, tmp_path, max_steps=150, pace_s="0.1", env=env, ranks=2)

    def two_steps():
        if "train/loss" not in _tags(run):
            return None
        return len(_steps(_read(run / "tensorboard"), "train/loss")) >= 2

    wait_for(two_steps, what="two logged steps in TensorBoard while the run trains")
    wait_for(lambda: "host/cpu_percent" in _tags(run), what="telemetry in TensorBoard")
    assert read_status(run)["state"] == "running"  # all of it read while the run trains
    assert {"profile", "start"} <= set(_read(run / "tensorboard").Tags()["tensors"])
    pace.unlink()
    out, err = proc.communicate(timeout=deadline(600))
    assert proc.returncode == 0, err
    acc = _read(run / "tensorboard")
    logged = {e["step"]: e["loss"] for e in events_of(run, "step")}
    assert _steps(acc, "train/loss") == sorted(logged) and max(logged) == 150
    assert _values(acc, "train/loss") == pytest.approx(logged)
    evals = {e["step"]: e["loss"] for e in events_of(run, "eval")}
    assert evals and _values(acc, "eval/loss") == pytest.approx(evals)
    assert "throughput/samples_per_s" in acc.Tags()["scalars"]
    telemetry = _steps(acc, "host/cpu_percent")
    assert telemetry == sorted(set(telemetry)) and telemetry[-1] <= 150
    # The fake GPUs' readings (utilisation constant, power constant: nvml_run_fake.py).
    for index in (0, 1):
        util = {v for v in _values(acc, f"gpu{index}/util_percent").values()}
        power = {v for v in _values(acc, f"gpu{index}/power_w").values()}
        assert util == {float(UTIL[index])} and power == {float(POWER_W[index])}
        assert _steps(acc, f"gpu{index}/memory_used_gib") == telemetry


def _one_curve(run: Path) -> dict[int, float]:
    acc = _read(run / "tensorboard")
    steps = _steps(acc, "train/loss")
    assert steps == sorted(set(steps))  # each step once, never backwards
    return _values(acc, "train/loss")


# One run of three sessions serves the two tests below (a launch each fewer): Ctrl-C near the
# start, a paced resume killed (stop --now) past its checkpoint at 50, a resume to the end.
RESUMED_STEPS = 150


def _tensorboard_files(run: Path) -> tuple[int, int]:
    """Event files: the run's and the HParams tab's."""
    files = [p for p in (run / "tensorboard").iterdir() if p.is_file()]
    return len(files), len(list((run / "tensorboard" / "hparams").iterdir()))


@pytest.fixture(scope="module")
def resumed_twice(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tensorboard_resumes")
    runs = tmp / "runs"
    procs = Procs(runs)
    extra = "[checkpoint]\nevery_steps = 50\n"
    profile = paced_profile(tmp, max_steps=RESUMED_STEPS, extra=extra)
    seen: dict = {}
    try:
        # Paced at 0.2 s a step: the Ctrl-C lands long before step 50's checkpoint, and the
        # kill 10 s or more before step 100's.
        proc = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs),
                           cwd=tmp, env=pinned_env(PACE_S="0.2"))  # fmt: skip
        (run,) = wait_for(lambda: run_dirs(runs), what="the run directory")
        wait_for(lambda: any(e["step"] >= 10 for e in events_of(run, "step")), what="step 10")
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=deadline(600))
        seen["stopped"] = read_status(run)
        # The Ctrl-C's resume, paced, killed once past its checkpoint at 50.
        proc = procs.start("run", "--resume", str(run), "--headless", "--runs-dir", str(runs),
                           cwd=tmp, env=pinned_env(PACE_S="0.2"))  # fmt: skip
        wait_for(lambda: any(e["step"] >= 55 for e in events_of(run, "step")), what="step 55")
        seen["resumed_start"] = events_of(run, "start")[-1]
        seen["kill"] = procs.cli("stop", str(run), "--now", "--runs-dir", str(runs), cwd=tmp,
                                 env=pinned_env())  # fmt: skip
        proc.communicate(timeout=deadline(600))
        seen["killed"] = read_status(run)
        seen["before_last"] = events_of(run, "step")
        # What the Ctrl-C's resume left when its session ended: two sessions' TensorBoard.
        seen["resumed_files"] = _tensorboard_files(run)
        seen["resumed_curve"] = _steps_and_values(run)
        # The last session, unpaced: it runs at speed.
        seen["done"] = procs.cli("run", "--resume", str(run), "--headless", "--runs-dir",
                                 str(runs), cwd=tmp, env=pinned_env())  # fmt: skip
        yield run, seen
    finally:
        procs.cleanup()


def _steps_and_values(run: Path) -> tuple[list[int], dict[int, float]]:
    acc = _read(run / "tensorboard")
    return _steps(acc, "train/loss"), _values(acc, "train/loss")


def test_ctrl_c_and_a_resume_continue_one_curve(resumed_twice):
    run, seen = resumed_twice
    stopped = seen["stopped"]
    assert stopped["state"] == "stopped" and stopped["step"] < 50
    assert seen["resumed_start"]["start_step"] == stopped["step"]  # from the stop checkpoint
    # When the resumed session ended (killed past step 55): a file per session, the HParams
    # tab's too, and one curve of both sessions' steps.
    assert seen["resumed_files"] == (2, 2)
    steps, losses = seen["resumed_curve"]
    assert steps == sorted(set(steps))  # each step once, never backwards
    logged = {e["step"]: e["loss"] for e in seen["before_last"]}
    assert losses == pytest.approx(logged) and max(logged) >= 55
    assert list(losses) == list(range(1, max(logged) + 1))  # log_every = 1: every step, once
    # And at the run's end, after the third session: one curve still.
    assert seen["done"].returncode == 0, seen["done"].stderr
    assert _tensorboard_files(run) == (3, 3)
    losses = _one_curve(run)
    assert losses == pytest.approx({e["step"]: e["loss"] for e in events_of(run, "step")})
    assert list(losses) == list(range(1, RESUMED_STEPS + 1))


def test_a_killed_run_resumed_from_an_earlier_checkpoint_drops_what_it_logged_past_it(
    resumed_twice,
):
    run, seen = resumed_twice
    assert seen["kill"].returncode == 0, seen["kill"].stderr
    assert seen["killed"]["state"] == "killed"
    first = {e["step"]: e["loss"] for e in seen["before_last"]}
    assert 55 <= max(first) < 100  # it logged past its checkpoint at 50
    done = seen["done"]
    assert done.returncode == 0, done.stderr
    assert events_of(run, "start")[-1]["start_step"] == 50
    after = events_of(run, "step")[len(seen["before_last"]) :]  # the last session's
    assert [e["step"] for e in after] == list(range(51, RESUMED_STEPS + 1))
    losses = _one_curve(run)
    assert list(losses) == list(range(1, RESUMED_STEPS + 1))
    assert {s: v for s, v in losses.items() if s > 50} == pytest.approx(
        {e["step"]: e["loss"] for e in after}
    )
    telemetry = _steps(_read(run / "tensorboard"), "host/cpu_percent")
    assert telemetry == sorted(set(telemetry))  # telemetry too: no step twice, none back
