"""One session per run, and one truth after abnormal ends (issue 25: items 3, 4, 8, 9).

The session lock (``RUN/.lock``, :mod:`gpu_console.session_lock`) on its own, then through
the real CLI (console → supervisor → torchrun → a CPU rank): two resumes at the same
instant, a supervisor SIGKILLed, a double Ctrl-C that lands after the stop's checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import conftest
import psutil
import pytest
from conftest import (
    deadline,
    events_of,
    fast_profile,
    pid_alive,
    read_status,
    task_profile,
    the_run,
    wait_for,
)

from gpu_console import heartbeats, lost, session_lock
from gpu_console.fold import derived_state
from gpu_console.session_lock import RunLockedError, is_held, take, try_take

# -- the lock ----------------------------------------------------------------------------------


def test_the_lock_is_taken_once_and_free_once_released(tmp_path):
    assert is_held(tmp_path) is None  # no lock file: a run made before the lock
    lock = try_take(tmp_path)
    assert lock is not None and (tmp_path / ".lock").is_file()
    assert try_take(tmp_path) is None  # another open file: refused, never waits
    assert is_held(tmp_path) is True
    lock.claim(4242)
    with pytest.raises(RunLockedError, match=r"another session holds it \(pid 4242\)"):
        take(tmp_path, wait_s=0.1)
    lock.release()
    lock.release()  # once only
    assert is_held(tmp_path) is False
    with take(tmp_path) as again:
        assert is_held(tmp_path) is True and again.fd >= 0
    assert is_held(tmp_path) is False


HOLDER = """
import subprocess, sys, time
from pathlib import Path
from gpu_console import session_lock
from gpu_console.supervisor import hold_session_lock

run = Path(sys.argv[1])
fd = int(sys.argv[2]) if len(sys.argv) > 2 else None
hold_session_lock(run, fd)
# The worst case for a child: it keeps every descriptor it may inherit (torchrun's own
# Popen closes them; the supervisor's lock must not be one it could keep).
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], close_fds=False)
print(child.pid, flush=True)
time.sleep(600)
"""


def _holder(tmp_path, *args, pass_fds=()):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), *args],
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=pass_fds,
        env=conftest.test_env(),
    )


def test_the_holders_death_frees_the_lock_and_its_children_never_hold_it(tmp_path):
    """As the supervisor holds it: passed down (pass_fds), kept from its own children, freed
    by the kernel when the holder is SIGKILLed while a child of it lives on."""
    (tmp_path / "run").mkdir()
    lock = take(tmp_path / "run", "run")
    proc = _holder(tmp_path, str(lock.fd), pass_fds=(lock.fd,))
    child = None
    try:
        child = int(proc.stdout.readline())
        lock.release()  # the console's copy: the holder's alone keeps it
        assert is_held(tmp_path / "run") is True
        assert session_lock.holder(tmp_path / "run") == proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert pid_alive(child)  # its child lives on, and does not hold the run
        wait_for(lambda: is_held(tmp_path / "run") is False, 30, "the lock to be free")
    finally:
        for pid in (proc.pid, child):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def test_a_reader_records_lost_once_no_session_holds_the_run(tmp_path):
    """The next reader records the end in status.json: THE fold's step and loss, exit 1."""
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # The supervisor's last write counted this session's 2 skipped updates already.
    status = {"state": "running", "step": 3, "started": 100.0, "best_loss": 0.5}
    status["skipped_updates"] = 2
    status["pids"] = {"supervisor": dead.pid, "torchrun": dead.pid, "workers": [dead.pid]}
    (run / "status.json").write_text(json.dumps(status))
    (run / "meta.json").write_text(json.dumps({"sessions": [{"events_from": 0}]}))
    events = [
        {"v": 1, "t": 101.0, "kind": "start", "world_size": 2, "max_steps": 50},
        {"v": 1, "t": 102.0, "kind": "status", "state": "running"},
        *(
            {"v": 1, "t": 102.0 + s, "kind": "step", "step": s, "loss": 1.0 / s, "skipped": s // 4}
            for s in (1, 5)
        ),  # fmt: skip
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    held = take(run, "run")  # a session holds it: nothing is recorded
    assert lost.settle(run)["state"] == "running" and "ended" not in read_status(run)
    held.release()

    recorded = lost.settle(run)
    on_disk = read_status(run)
    assert recorded == on_disk
    assert (on_disk["state"], on_disk["exit_code"], on_disk["step"]) == ("lost", 1, 5)
    assert on_disk["loss"] == 0.2 and on_disk["best_loss"] == 0.2 and on_disk["ended"] >= 107.0
    assert on_disk["reason"] == lost.LOST_REASON and on_disk["pids"]["workers"] == []
    assert on_disk["skipped_updates"] == 1  # this session's, counted once
    assert lost.settle(run) == on_disk  # once: a later reader reads the record
    assert is_held(run) is False


def test_a_command_to_a_run_winding_down_is_refused_as_ended(tmp_path):
    """The engine has said ``stopped`` and its session still holds the lock while it winds
    down (no ``ended`` yet): no rank will read a command again, so none is appended."""
    from gpu_console.commands.runs import RunEndedError, _live

    run = tmp_path / "run"
    run.mkdir()
    status = {"state": "running", "step": 3, "started": time.time(), "host": socket.gethostname()}
    status["pids"] = {"supervisor": os.getpid(), "torchrun": os.getpid(), "workers": []}
    (run / "status.json").write_text(json.dumps(status))
    with take(run, "run"):
        assert _live(run)["state"] == "running"  # live: a command would be read
        (run / "status.json").write_text(json.dumps({**status, "state": "stopped"}))
        with pytest.raises(RunEndedError, match=r"the run has already ended \(state stopped\)"):
            _live(run)
    assert not (run / "control.jsonl").exists()


def test_a_command_to_a_starting_run_waits_for_its_supervisor(tmp_path, monkeypatch):
    """The lock is taken before the supervisor writes status.json: a command in that moment
    waits for the supervisor's pid (never reads the empty status as lost, never sends a kill
    to no one); a supervisor that never comes is one line, nothing sent."""
    import threading

    from gpu_console.commands import runs as command

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.toml").write_text("")
    status = {"state": "starting", "started": time.time(), "host": socket.gethostname()}
    status["pids"] = {"supervisor": os.getpid(), "torchrun": None, "workers": []}
    with take(run, "run"):
        writer = threading.Timer(0.5, lambda: (run / "status.json").write_text(json.dumps(status)))
        writer.start()
        try:
            assert command._live(run)["pids"]["supervisor"] == os.getpid()
        finally:
            writer.cancel()
        (run / "status.json").unlink()
        monkeypatch.setattr(command, "SUPERVISOR_WAIT_S", 0.3)
        with pytest.raises(command.RunEndedError, match="the run is starting .* nothing sent"):
            command.stop_now(str(run), tmp_path)
    assert not (run / "control.jsonl").exists()


def test_a_reader_on_another_host_records_nothing(tmp_path):
    """A run directory on a shared file system, read from another machine: the session's
    pids mean nothing here and its lock may be local to each client, so nothing is recorded."""
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    status = {"state": "running", "step": 3, "started": 100.0, "host": "gpu-node-17"}
    status["pids"] = {"supervisor": dead.pid, "torchrun": dead.pid, "workers": [dead.pid]}
    (run / "status.json").write_text(json.dumps(status))
    (run / session_lock.LOCK).write_text("")
    assert lost.settle(run) == status
    assert read_status(run) == status
    assert derived_state(status, time.time()) == "running"  # every view agrees: not lost here
    status["host"] = socket.gethostname()  # the same run read on its own host: recorded
    assert derived_state(status, time.time()) == "lost"
    (run / "status.json").write_text(json.dumps(status))
    assert lost.settle(run)["state"] == "lost"


def test_a_zombie_is_not_alive_for_any_reader():
    """Where nothing reaps orphans (many containers), a dead supervisor stays a zombie: the
    one liveness rule says dead, so a reader's state and the lost record agree."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 30, "zombie")
        assert not pid_alive(child.pid)
        status = {
            "state": "running",
            "host": socket.gethostname(),
            "pids": {"supervisor": child.pid},
        }
        assert derived_state(status, time.time()) == "lost"
        assert heartbeats.pid_alive(os.getpid())
    finally:
        child.wait()


# -- through the CLI ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> conftest.FinishedRun:
    """One run of the fast profile to its end (20 steps, one CPU rank) through the CLI, shared:
    read where it lies, or copied by a test that resumes it."""
    tmp = tmp_path_factory.mktemp("one-session")
    profile = fast_profile(tmp, max_steps=20)
    return conftest._finished(tmp / "runs", profile, str(profile), cwd=tmp)


def test_two_resumes_at_the_same_instant_one_runs_the_other_exits_2(procs, runs_dir, finished):
    run = finished.copy(runs_dir)
    first = json.loads((run / "meta.json").read_text())
    target = 60
    args = ["run", "--resume", str(run), "--headless", "--set", f"train.max_steps={target}"]
    both = [procs.start(*args), procs.start(*args)]  # back to back: one instant, two consoles
    results = []
    for p in both:
        out, err = p.communicate(timeout=deadline(300))
        results.append((p.returncode, out, err))
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    (won,) = [r for r in results if r[0] == 0]
    (lost_,) = [r for r in results if r[0] == 2]
    (line,) = lost_[2].splitlines()
    assert line.startswith(f"gpu-console: --resume: {run}: "), line
    # The advice is safe: never to stop the resume that won (it would end the good run).
    assert "another session is continuing it now" in line, line
    assert line.endswith(f"watch it with gpu-console attach {run}"), line
    assert "Traceback" not in lost_[1] + lost_[2]

    # The record: one more session, one history entry, the end of the session that ran.
    meta = json.loads((run / "meta.json").read_text())
    assert len(meta["sessions"]) == 2 and meta["created"] == first["created"]
    assert sorted(p.name for p in (run / "history").iterdir()) == ["run-1.toml", "status-1.json"]
    final = read_status(run)
    assert (final["state"], final["exit_code"], final["step"]) == ("finished", 0, target), final
    assert "finished" in won[1]
    # A resumed run's progress lines are this session's (never the last one's max_steps).
    shown = re.findall(r"^step \d+/(\S+)", won[1], re.M)
    assert shown and set(shown) == {str(target)}, won[1]
    # ls: the run began at its first launch; its latest session is beside it.
    (row,) = json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)
    assert row["started"] == first["created"]
    assert row["session_started"] == final["started"] > row["started"]


def test_a_killed_supervisor_is_recorded_lost_and_every_view_agrees(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=1_000_000)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 5, what="five steps")
    status = wait_for(
        lambda: (s := read_status(run)) and s["pids"].get("workers") and s,
        what="the worker pid in status.json",
    )
    # The supervisor alone holds the lock: not the console, torchrun or a rank.
    pids = status["pids"]
    tree = [console.pid, pids["supervisor"], pids["torchrun"], *pids["workers"]]
    holders = {p for p in tree if _holds(p, run / ".lock")}
    assert holders == {status["pids"]["supervisor"]} and is_held(run) is True
    asked = procs.cli("checkpoint", run.name, "--runs-dir", str(runs_dir))
    assert asked.returncode == 0, asked.stderr  # something to resume from, below
    os.kill(status["pids"]["supervisor"], signal.SIGKILL)
    left = [status["pids"]["torchrun"], *status["pids"]["workers"]]
    wait_for(lambda: not any(pid_alive(p) for p in left), 60, "torchrun and the ranks to die")
    out, err = console.communicate(timeout=deadline(120))  # the console too is a reader: it records
    assert console.returncode == 1, out + err
    assert "lost" in out

    rd = ["--runs-dir", str(runs_dir)]
    (ls_row,) = json.loads(procs.cli("ls", "--json", *rd).stdout)
    shown = json.loads(procs.cli("status", run.name, "--json", *rd).stdout)
    on_disk = read_status(run)
    last_step = events_of(run, "step")[-1]["step"]
    for view in (ls_row, shown, on_disk):
        assert (view["state"], view["step"], view["exit_code"]) == ("lost", last_step, 1), view
    assert on_disk["ended"] and on_disk["reason"] == lost.LOST_REASON
    # Nobody reads commands now: refused at once, nothing appended.
    before = (run / "control.jsonl").read_bytes()
    refused = procs.cli("checkpoint", run.name, *rd)
    assert refused.returncode == 2 and "already ended (state lost)" in refused.stderr
    assert (run / "control.jsonl").read_bytes() == before

    # A resume continues it; the lost session's record goes to history/ as it was recorded.
    ckpt = int((run / "checkpoints" / "LATEST").read_text().strip()[5:])
    again = procs.cli("run", "--resume", run.name, "--headless", *rd,
                      "--set", f"train.max_steps={ckpt + 5}")  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((run / "history" / "status-1.json").read_text()) == on_disk
    assert read_status(run)["state"] == "finished"


def _holds(pid, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (its /proc/PID/fd links)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    target = str(path.resolve())
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


# Every rank's on_train_end (after the stop's checkpoint, before the engine says stopped)
# takes long: the second Ctrl-C lands after the checkpoint is complete.
SLOW_END = """
import time
from gpu_console.tasks.mlp import MLPTask


class SlowEnd(MLPTask):
    def on_train_end(self, model, ctx, reason):
        time.sleep(600)
"""


def test_a_double_ctrl_c_after_the_stop_checkpoint_says_it_was_written(procs, runs_dir, tmp_path):
    profile = task_profile(tmp_path, "slowend", textwrap.dedent(SLOW_END), "SlowEnd",
                           max_steps=1_000_000)  # fmt: skip
    out_path = tmp_path / "console.out"
    with open(out_path, "w") as out:
        console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                              cwd=tmp_path, stdout=out)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 3, what="three steps")
    console.send_signal(signal.SIGINT)
    ckpt = wait_for(
        lambda: [c for c in events_of(run, "checkpoint") if c["reason"] == "stop"],
        what="the stop's checkpoint",
    )[0]
    # Seen by the console too, before the second Ctrl-C (signals of one kind merge).
    wait_for(lambda: "(stop)" in out_path.read_text(), what="the console to show it")
    console.send_signal(signal.SIGINT)
    _, err = console.communicate(timeout=deadline(120))
    printed = out_path.read_text()
    assert console.returncode == 0, printed + err

    name = f"step-{ckpt['step']:08d}"
    assert (run / "checkpoints" / "LATEST").read_text().strip() == name
    final = read_status(run)
    assert (final["state"], final["exit_code"], final["checkpointed_on_stop"]) == (
        "stopped", 0, True,
    ), final  # fmt: skip
    assert final["step"] == ckpt["step"]
    assert f"its stop checkpoint @ step {ckpt['step']} is written" in printed, printed
    assert "killed before a checkpoint" not in printed and "no checkpoint\n" not in printed
    assert re.search(rf"state\W+stopped \(stop checkpoint @ step {ckpt['step']} written", printed)
    assert "state: stopping (on request)" in printed and "stopping stop" not in printed
    assert name in printed  # the summary names the checkpoint LATEST names
    (row,) = json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)
    assert (row["state"], row["exit_code"]) == ("stopped", 0)
    wait_for(lambda: not any(pid_alive(p) for p in final["pids"]["workers"] or []), 30, "ranks")
    assert time.time() - final["ended"] < 120


def test_a_new_run_is_locked_from_its_first_file(finished):
    """A run's directory has its lock as soon as it is a run; ended, nobody holds it."""
    run = finished.run  # read where the launch left it, never changed
    assert (run / ".lock").is_file() and is_held(run) is False
    assert session_lock.holder(run) == read_status(run)["pids"]["supervisor"]
    assert Path(run / ".lock").stat().st_mode & 0o777 == 0o600


def test_a_run_directory_removed_under_a_headless_console_ends_it_lost(procs, runs_dir, tmp_path):
    # Its status.json gone, nothing names the supervisor's pid any more: the console must go by
    # its own child's exit, not wait on the file for ever (it used to spin at a full core).
    # Moved away rather than deleted: a delete races the run's writers (ENOTEMPTY), a rename
    # takes the whole directory at once.
    profile = fast_profile(tmp_path, max_steps=1_000_000)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    status = wait_for(
        lambda: (s := read_status(run)) and s["pids"].get("workers") and s,
        what="the worker pid in status.json",
    )
    tree = [status["pids"]["supervisor"], status["pids"]["torchrun"], *status["pids"]["workers"]]
    run.rename(tmp_path / "moved-away")
    os.kill(status["pids"]["supervisor"], signal.SIGKILL)
    wait_for(lambda: not any(pid_alive(p) for p in tree), 60, "the run's processes to die")
    out, err = console.communicate(timeout=deadline(60))
    assert console.returncode == 1, out + err
    assert "lost" in out and "Traceback" not in out + err
