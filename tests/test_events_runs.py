"""The torch-free modules: events, the run directory, device specs, and RunState."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import repo_pythonpath, unprivileged

from gpu_console import devices, launch, runs
from gpu_console.devices import DeviceSpec, DeviceSpecError, Placement, parse_devices, place
from gpu_console.events import EventWriter, JsonlTail, append_control, read_events
from gpu_console.runs import RunDirError
from gpu_console.state import RunState

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


# -- events -----------------------------------------------------------------------------------


def test_tail_skips_a_torn_last_line_then_returns_it_once_completed(tmp_path):
    path = tmp_path / "events.jsonl"
    first = {"v": 1, "t": 1.0, "kind": "step", "step": 1}
    second = {"v": 1, "t": 2.0, "kind": "step", "step": 2}
    torn = line(second)
    path.write_bytes(line(first) + torn[:7])
    tail = JsonlTail(path)
    assert tail.read() == [first]
    assert tail.read() == [], "a torn line is not returned"
    with open(path, "ab") as f:
        f.write(torn[7:])
    assert tail.read() == [second]
    assert tail.read() == [], "each line is returned once"
    assert tail.offset == path.stat().st_size


def test_tail_of_a_missing_file_is_empty_and_picks_it_up_later(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []
    path.write_bytes(line({"kind": "log"}))
    assert tail.read() == [{"kind": "log"}]


def test_tail_with_max_bytes_returns_only_whole_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    events = [{"kind": "step", "step": i} for i in range(5)]
    path.write_bytes(b"".join(line(e) for e in events))
    tail = JsonlTail(path)
    got: list[dict] = []
    for _ in range(20):
        got += tail.read(max_bytes=40)  # about one and a half lines at a time
    assert got == events


def test_read_events_skips_garbage_and_unknown_kinds(tmp_path):
    path = tmp_path / "events.jsonl"
    good = [
        {"v": 1, "t": 1.0, "kind": "start", "world_size": 2},
        {"v": 1, "t": 2.0, "kind": "step", "step": 1, "loss": 2.5},
        {"v": 1, "t": 3.0, "kind": "status", "state": "finished"},
    ]
    path.write_bytes(
        line(good[0])
        + b"this is not json\n"
        + b"\n"
        + line({"v": 1, "t": 1.5, "kind": "from-the-future", "x": 1})
        + b"[1, 2, 3]\n"
        + b'"a string"\n'
        + line({"v": 1, "t": 1.6, "no_kind": True})
        + b"\xff\xfe\n"
        + line(good[1])
        + line(good[2])
        + b'{"v": 1, "kind": "step", "st'
    )
    assert read_events(path) == good


def test_read_events_of_a_missing_file_is_empty(tmp_path):
    assert read_events(tmp_path / "nope.jsonl") == []


def test_event_writer_writes_whole_versioned_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    before = time.time()
    a = w.emit("step", step=1, loss=0.5)
    b = w.emit("log", level="info", message="hi\nthere")
    w.close()
    assert path.read_bytes().count(b"\n") == 2, "a newline inside a field is escaped"
    assert read_events(path) == [a, b]
    assert a["v"] == 1 and a["kind"] == "step" and before - 1 <= a["t"] <= time.time() + 1


def test_append_control_creates_the_file_0600_with_valid_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ids = [append_control(run, cmd) for cmd in ("checkpoint", "pause", "resume", "stop")]
    path = run / "control.jsonl"
    assert mode(path) == 0o600
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    parsed = [json.loads(x) for x in lines]
    assert [p["cmd"] for p in parsed] == ["checkpoint", "pause", "resume", "stop"]
    assert [p["id"] for p in parsed] == ids
    assert len(set(ids)) == 4
    assert all(isinstance(p["t"], float) for p in parsed)


def test_append_control_keeps_an_existing_files_mode_and_lines(tmp_path):
    path = tmp_path / "control.jsonl"
    path.write_text('{"id": "x", "cmd": "stop", "t": 1.0}\n')
    path.chmod(0o600)
    append_control(tmp_path, "checkpoint")
    assert [json.loads(x)["cmd"] for x in path.read_text().splitlines()] == ["stop", "checkpoint"]
    assert mode(path) == 0o600


def test_append_control_refuses_unknown_commands(tmp_path):
    with pytest.raises(ValueError, match="unknown control command"):
        append_control(tmp_path, "explode")
    assert not (tmp_path / "control.jsonl").exists()


# -- the run directory ------------------------------------------------------------------------


def test_create_run_dir_layout_and_modes(tmp_path):
    runs_dir = tmp_path / "deep" / "runs"
    run = runs.create_run_dir(runs_dir, "quick")
    assert run.parent == runs_dir
    assert re.fullmatch(r"quick-\d{8}-\d{6}", run.name), run.name
    stamp = time.strptime(run.name.split("-", 1)[1], "%Y%m%d-%H%M%S")
    assert abs(time.mktime(stamp) - time.time()) < 120
    assert mode(run) == 0o700
    assert (run / "logs").is_dir() and (run / "checkpoints").is_dir()
    control = run / "control.jsonl"
    assert control.is_file() and control.stat().st_size == 0
    assert mode(control) == 0o600


def test_create_run_dir_names_are_distinct_within_one_second(tmp_path, monkeypatch):
    monkeypatch.setattr(runs.time, "strftime", lambda fmt: "20240102-030405")
    made = [runs.create_run_dir(tmp_path, "same") for _ in range(3)]
    assert [p.name for p in made] == [
        "same-20240102-030405",
        "same-20240102-030405-2",
        "same-20240102-030405-3",
    ]


def test_create_run_dir_back_to_back_are_distinct(tmp_path):
    a = runs.create_run_dir(tmp_path, "x")
    b = runs.create_run_dir(tmp_path, "x")
    assert a != b and a.is_dir() and b.is_dir()


def test_create_run_dir_makes_a_safe_name(tmp_path):
    run = runs.create_run_dir(tmp_path, "../my run/ö")
    assert run.parent == tmp_path
    # Letters of any script stay (issue 25: "ünïcødé-run" became "n-c-d----run").
    assert re.fullmatch(r"my-run-ö-\d{8}-\d{6}", run.name), run.name
    assert runs.create_run_dir(tmp_path, "///").name.startswith("run-")


def test_create_run_dir_when_the_runs_dir_is_a_file(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match=re.escape(str(blocker))):
        runs.create_run_dir(blocker, "x")
    assert blocker.read_text() == "x"


def test_create_run_dir_when_the_runs_dir_is_read_only(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    # Root writes through chmod 0500: create it in a process without that power (conftest).
    code = (
        "import sys; from gpu_console import runs\n"
        "try:\n    runs.create_run_dir(sys.argv[1], 'x')\n"
        "except runs.RunDirError as e:\n    print(e); sys.exit(3)\n"
    )
    try:
        env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
        done = subprocess.run(
            [*unprivileged(), sys.executable, "-c", code, str(ro)],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 3, done.stdout + done.stderr
        assert done.stdout.strip() == f"{ro}: the runs directory is not writable", done.stdout
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_atomic_write_json_replaces_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "status.json"
    runs.atomic_write_json(path, {"state": "running"})
    runs.atomic_write_json(path, {"state": "finished", "n": [1, 2]})
    assert json.loads(path.read_text()) == {"state": "finished", "n": [1, 2]}
    assert runs.read_json(path) == {"state": "finished", "n": [1, 2]}
    assert os.listdir(tmp_path) == ["status.json"]


def test_atomic_write_json_of_an_unserialisable_object_keeps_the_old_file(tmp_path):
    path = tmp_path / "status.json"
    runs.atomic_write_json(path, {"state": "running"})
    with pytest.raises(TypeError):
        runs.atomic_write_json(path, {"state": object()})
    assert json.loads(path.read_text()) == {"state": "running"}
    assert os.listdir(tmp_path) == ["status.json"]


def test_atomic_write_failing_at_the_rename_removes_its_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    runs.atomic_write_json(path, {"state": "running"})

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runs.os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        runs.atomic_write_json(path, {"state": "finished"})
    assert json.loads(path.read_text()) == {"state": "running"}
    assert os.listdir(tmp_path) == ["status.json"]


def test_read_json_of_missing_or_torn_file_is_none(tmp_path):
    assert runs.read_json(tmp_path / "nope.json") is None
    (tmp_path / "torn.json").write_text('{"state": "runn')
    assert runs.read_json(tmp_path / "torn.json") is None
    assert runs.read_status(tmp_path) == {}


def test_latest_checkpoint_needs_a_complete_one(tmp_path):
    run = runs.create_run_dir(tmp_path, "r")
    assert runs.latest_checkpoint(run) is None
    ck = run / "checkpoints" / "step-00000010"
    ck.mkdir()
    (run / "checkpoints" / "LATEST").write_text("step-00000010\n")
    assert runs.latest_checkpoint(run) is None, "no meta.json: not complete"
    (ck / "meta.json").write_text("{}")
    assert runs.latest_checkpoint(run) == ck


def test_a_latest_named_by_hand_resumes_from_what_it_names_or_the_newest_before(tmp_path):
    """LATEST may name any complete directory (edited by hand, or ``.tmp-step-N`` for a moment
    while a step is saved again): never a traceback, and the fallback is the newest other."""
    import zipfile

    run = runs.create_run_dir(tmp_path, "r")
    ckpts = run / "checkpoints"
    for name in ("step-00000010", "step-00000020", "mine"):
        (ckpts / name).mkdir()
        (ckpts / name / "meta.json").write_text("{}")
        with zipfile.ZipFile(ckpts / name / "state.pt", "w") as z:
            z.writestr("data.pkl", b"x")
    (ckpts / "LATEST").write_text("mine\n")
    assert runs.resume_checkpoint(run) == (ckpts / "mine", "")
    (ckpts / "mine" / "state.pt").write_bytes(b"cut short")
    found, why = runs.resume_checkpoint(run)
    assert found == ckpts / "step-00000020"
    assert why.startswith("mine cannot be loaded: its state.pt is not a whole torch file")


def _fake_run(runs_dir: Path, name: str) -> Path:
    run = runs_dir / name
    run.mkdir(parents=True)
    (run / "run.toml").write_text("")
    return run


def test_find_run_by_path_name_and_prefix(tmp_path, monkeypatch):
    runs_dir = tmp_path / "runs"
    older = _fake_run(runs_dir, "quick-20240101-000000")
    newer = _fake_run(runs_dir, "quick-20240102-000000")
    other = _fake_run(runs_dir, "transformer-20240103-000000")
    (runs_dir / "quick-20240109-000000").mkdir()  # no run.toml: not a run
    elsewhere = _fake_run(tmp_path / "archive", "old-run")

    assert runs.find_run(str(elsewhere), runs_dir) == elsewhere
    assert runs.find_run(str(older), runs_dir) == older
    assert runs.find_run(older.name, runs_dir) == older
    assert runs.find_run("quick", runs_dir) == newer, "a prefix picks the newest match"
    assert runs.find_run("quick-20240101", runs_dir) == older
    assert runs.find_run("trans", runs_dir) == other
    monkeypatch.chdir(tmp_path)
    assert runs.find_run("archive/old-run", runs_dir) == Path("archive/old-run")


def test_a_name_is_never_another_name_it_prefixes(tmp_path):
    # "-" sorts before "0": the newest match by name made "exp1" stop, export or resume
    # exp10's run.
    runs_dir = tmp_path / "runs"
    exp1 = _fake_run(runs_dir, "exp1-20240101-000000")
    exp1_later = _fake_run(runs_dir, "exp1-20240101-000000-2")  # a clash in one second
    _fake_run(runs_dir, "exp10-20240102-000000")
    exp10b = _fake_run(runs_dir, "exp10b-20240102-000000")
    assert runs.find_run("exp1", runs_dir) == exp1_later
    assert runs.find_run("exp1-2024", runs_dir) == exp1_later
    assert runs.find_run("exp1-20240101-000000", runs_dir) == exp1
    assert runs.find_run("exp10b", runs_dir) == exp10b
    with pytest.raises(RunDirError) as info:
        runs.find_run("exp", runs_dir)  # three names: not one of them by chance
    assert str(info.value) == (
        f"exp: could be the runs of 3 names (exp1, exp10, exp10b) under {runs_dir}; "
        "give more of the name"
    )
    with pytest.raises(RunDirError):
        runs.find_run("exp1x", runs_dir)


def test_find_run_errors_name_the_run_and_the_runs_dir(tmp_path):
    runs_dir = tmp_path / "runs"
    _fake_run(runs_dir, "quick-20240101-000000")
    with pytest.raises(RunDirError) as info:
        runs.find_run("ghost", runs_dir)
    assert str(info.value).startswith("ghost: no such run") and str(runs_dir) in str(info.value)
    with pytest.raises(RunDirError):
        runs.find_run("ghost", tmp_path / "no-runs-dir-here")


def test_default_runs_dir(monkeypatch):
    monkeypatch.delenv("GPU_CONSOLE_RUNS", raising=False)
    assert runs.default_runs_dir() == Path("runs")
    monkeypatch.setenv("GPU_CONSOLE_RUNS", "/somewhere/runs")
    assert runs.default_runs_dir() == Path("/somewhere/runs")


# -- devices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, spec",
    [
        ("auto", DeviceSpec("auto")),
        ("AUTO", DeviceSpec("auto")),
        ("cpu", DeviceSpec("cpu")),
        ("cpu:3", DeviceSpec("cpu", nproc=3)),
        (" cpu:1 ", DeviceSpec("cpu", nproc=1)),
        ("0", DeviceSpec("cuda", indices=(0,))),
        ("0,1", DeviceSpec("cuda", indices=(0, 1))),
        ("3, 1", DeviceSpec("cuda", indices=(3, 1))),
    ],
)
def test_parse_devices(text, spec):
    assert parse_devices(text) == spec


@pytest.mark.parametrize(
    "text, match",
    [
        ("gpu0", "GPU indices"),
        ("cuda:0", "GPU indices"),
        ("", "GPU indices"),
        ("-1", "GPU indices"),
        ("0,", "GPU indices"),
        ("0,,1", "GPU indices"),
        ("cpu:0", "N ≥ 1"),
        ("cpu:", "N ≥ 1"),
        ("cpu:-2", "N ≥ 1"),
        ("cpu:two", "N ≥ 1"),
        ("0,0", "twice"),
        ("1, 1", "twice"),
    ],
)
def test_parse_devices_errors(text, match):
    with pytest.raises(DeviceSpecError, match=match):
        parse_devices(text)


def test_auto_without_gpus_is_two_cpu_ranks_here():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fewer than 2 usable cores")
    assert place(parse_devices("auto"), 0) == Placement("cpu", 2, None)
    assert place(parse_devices("cpu"), 0) == Placement("cpu", 2, None)


@pytest.mark.parametrize("cores, ranks", [({0}, 1), ({0, 1}, 2), (set(range(16)), 2)])
def test_default_cpu_ranks_follow_the_usable_cores(monkeypatch, cores, ranks):
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: cores)
    assert place(DeviceSpec("auto"), 0) == Placement("cpu", ranks)


@pytest.mark.parametrize("cores, nproc, threads", [(16, 2, 8), (16, 3, 5), (2, 2, 1), (2, 4, 1)])
def test_cpu_ranks_get_their_share_of_the_cores_as_threads(monkeypatch, cores, nproc, threads):
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    placement = Placement("cpu", nproc)
    assert placement.cpu_threads_per_rank() == threads
    assert launch.worker_env(placement)["OMP_NUM_THREADS"] == str(threads)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert launch.worker_env(placement)["OMP_NUM_THREADS"] == "3"
    # GPU ranks keep torchrun's own default.
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS" not in launch.worker_env(Placement("cuda", 2, "0,1"))


def test_place_cpu_and_gpus():
    assert place(parse_devices("cpu:3"), 4) == Placement("cpu", 3, None), "cpu:N ignores GPUs"
    assert place(parse_devices("auto"), 3) == Placement("cuda", 3, "0,1,2", (0, 1, 2))
    assert place(parse_devices("2,0"), 4) == Placement("cuda", 2, "2,0", (2, 0))
    assert place(parse_devices("1"), 2).describe() == "GPU 1 (1 ranks)"
    assert place(parse_devices("cpu:2"), 0).describe() == "cpu × 2 ranks"


def test_place_gpu_indices_without_any_gpu():
    with pytest.raises(DeviceSpecError) as info:
        place(parse_devices("0"), 0, "NVML library not found")
    assert "no GPU is visible: NVML library not found" in str(info.value)
    assert "cpu" in str(info.value)
    with pytest.raises(DeviceSpecError, match=r"no GPU is visible; use cpu"):
        place(parse_devices("0"), 0)


def test_place_gpu_indices_beyond_the_count():
    with pytest.raises(DeviceSpecError) as info:
        place(parse_devices("0,2,5"), 2)
    msg = str(info.value)
    assert "GPU 2, 5 does not exist" in msg and "has 2" in msg and "0..1" in msg


# -- RunState ---------------------------------------------------------------------------------


def _mem(*peaks: int) -> list[dict]:
    return [{"rank": r, "allocated": p // 2, "reserved": p, "peak": p} for r, p in enumerate(peaks)]


RECORDED = [
    {
        "v": 1,
        "t": 90.0,
        "kind": "start",
        "world_size": 2,
        "device_type": "cpu",
        "precision": "fp32",
        "task": "mlp",
        "params": 1234,
        "max_steps": 100,
        "start_step": 0,
    },
    {"v": 1, "t": 91.0, "kind": "status", "state": "running", "reason": ""},
    {"v": 1, "t": 100.0, "kind": "step", "step": 10, "loss": 2.0, "lr": 1e-3,
     "grad_norm": 1.5, "samples_per_s": 1000.0, "step_time_s": 0.1, "memory": _mem(100, 300)},
    {"v": 1, "t": 105.0, "kind": "from-the-future", "step": 999, "loss": -1.0},
    {"v": 1, "t": 110.0, "kind": "step", "step": 20, "loss": 1.25, "lr": 9e-4,
     "grad_norm": 1.0, "samples_per_s": 3000.0, "step_time_s": 0.1, "memory": _mem(500, 200)},
    {"v": 1, "t": 111.0, "kind": "eval", "step": 20, "accuracy": 0.5, "loss": 1.4},
    {"v": 1, "t": 112.0, "kind": "checkpoint", "step": 20, "path": "checkpoints/step-00000020",
     "seconds": 0.1, "bytes": 10, "reason": "interval"},
    {"v": 1, "t": 113.0, "kind": "control", "id": "abc", "cmd": "checkpoint",
     "state": "done", "step": 20},
    {"v": 1, "t": 120.0, "kind": "step", "step": 30, "loss": 1.5, "lr": 8e-4,
     "grad_norm": 0.5, "samples_per_s": 2000.0, "step_time_s": 0.1, "memory": _mem(400, 250)},
    {"v": 1, "t": 121.0, "kind": "log", "level": "warning", "message": "hello"},
]  # fmt: skip


def folded(events: list[dict]) -> RunState:
    st = RunState()
    for e in events:
        st.apply(e)
    return st


def test_run_state_folds_a_recorded_run():
    st = folded(RECORDED)
    assert (st.world_size, st.device_type, st.precision, st.task, st.params) == (
        2,
        "cpu",
        "fp32",
        "mlp",
        1234,
    )
    assert st.state == "running"
    assert st.step == 30 and st.max_steps == 100
    assert st.loss == 1.5, "the latest loss"
    assert st.best_loss == 1.25, "the lowest loss seen, not the last"
    assert st.lr == 8e-4 and st.grad_norm == 0.5
    assert st.eval == {"accuracy": 0.5, "loss": 1.4}
    assert [c["step"] for c in st.checkpoints] == [20]
    assert st.checkpoints[0]["reason"] == "interval"
    assert st.peak_memory == {0: 500, 1: 300}, "the peak per rank over the whole run"
    assert st.mean_samples_per_s() == 2000.0
    assert [c["id"] for c in st.controls] == ["abc"]
    assert [log["message"] for log in st.logs] == ["hello"]
    assert (st.first_step_t, st.last_step_t) == (100.0, 120.0)


def test_run_state_eval_keeps_the_latest_metrics():
    st = folded(RECORDED + [{"v": 1, "t": 130.0, "kind": "eval", "step": 40, "accuracy": 0.75}])
    assert st.eval == {"accuracy": 0.75}


def test_run_state_status_from_the_supervisor_is_final():
    st = folded(RECORDED)
    st.apply_status({"state": "running", "pids": {"supervisor": 1}})
    assert st.state == "running" and not st.done
    st.apply_status({"state": "failed", "reason": "rank 1 exited 1", "ended": 130.0})
    assert st.state == "failed" and st.reason == "rank 1 exited 1" and st.done
    assert st.elapsed_s() == 130.0 - 90.0


def test_run_state_eta_needs_two_step_events_and_max_steps():
    assert folded(RECORDED[:3]).eta_s() is None, "one step event gives no rate"
    no_max = [dict(RECORDED[0], max_steps=None), *RECORDED[1:]]
    assert folded(no_max).eta_s() is None
    assert folded(RECORDED).eta_s() > 0


@pytest.mark.parametrize("start_step", [0, 50])
def test_run_state_eta_is_the_remaining_steps_at_the_observed_rate(start_step):
    # One step a second: step events every 10 steps, 10 s apart.
    events = [dict(RECORDED[0], start_step=start_step, max_steps=start_step + 100)]
    for i, s in enumerate(range(start_step + 10, start_step + 40, 10)):
        events.append({"v": 1, "t": 100.0 + 10 * i, "kind": "step", "step": s, "loss": 1.0})
    st = folded(events)
    assert st.step == start_step + 30
    assert st.eta_s() == pytest.approx(70.0)


def test_one_precision_rule_for_the_launch_and_the_launch_screen():
    # devices.precision_refusals is what launch.prepare and the launch screen both apply.
    from gpu_console.devices import precision_refusals

    assert set(precision_refusals("cpu", [], {})) == {"fp16"}
    assert precision_refusals("cuda", [0, 1], {0: (8, 0), 1: (9, 0)}) == {}
    old = precision_refusals("cuda", [0, 1], {0: (7, 5), 1: (8, 6)})
    assert old == {"bf16": "bf16 needs compute capability ≥ 8.0 (GPU 0 is 7.5)"}
    assert precision_refusals("cuda", [3], {}) == {}  # unknown to NVML: cannot tell
