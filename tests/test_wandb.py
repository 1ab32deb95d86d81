"""Weights & Biases, optional and offline-safe (results/wandb_follower.py).

Real runs through torchrun with ``[logging] wandb`` in offline mode; the offline run W&B
writes (``RUN/wandb/offline-run-*/run-ID.wandb``, LevelDB's log format with W&B's records)
is read back here. A resume logs into the same W&B run; without the package, or online
with no network, the run trains to its end and says once that W&B is off."""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path

import pytest
from conftest import (
    Procs,
    deadline,
    events_of,
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

wandb_pb = pytest.importorskip(
    "wandb.proto.wandb_internal_pb2", reason="the wandb package (the dev extra installs it)"
)

BLOCK = 32768  # LevelDB log blocks
FILE_HEADER = 7  # ":W&B", a magic number, a version


def _records(path: Path) -> list:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, part, out = FILE_HEADER, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        part = chunk if kind == 2 else part + chunk  # FIRST starts a record
        if kind in (1, 4):  # FULL, LAST
            record = wandb_pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def _history(run: Path) -> tuple[list[dict], dict]:
    """Every offline session's logged rows (in order) and the run's config."""
    rows, config = [], {}
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for r in _records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                # A key with "/" is kept as its parts (nested_key).
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in r.history.item})  # fmt: skip
            elif kind == "run":
                config.update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json)
                               for u in r.run.config.update})  # fmt: skip
    return rows, config


def _wandb_home(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "wandb-home"  # W&B's own settings and cache: under the test's path
    return {"WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_DATA_DIR": str(home / "data")}  # fmt: skip


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return cli_env(**_wandb_home(tmp_path), **extra)


OFFLINE = ["--set", 'logging.wandb={project="gpuc-test", mode="offline"}']


def _wandb_status(run: Path) -> dict:
    """RUN/wandb.json, or {} before the follower wrote it (its wandb.init may still run when
    the command that followed the run has returned)."""
    try:
        return json.loads((run / "wandb.json").read_text())
    except FileNotFoundError:
        return {}


RESUMED_STEPS = 60


@pytest.fixture(scope="module")
def offline_resumed(tmp_path_factory):
    """One offline run of two sessions (a Ctrl-C at step 15, a resume to its end), shared by
    the two tests below: the mirror of a whole run and a resume into the same W&B run."""
    tmp = tmp_path_factory.mktemp("wandb_offline")
    runs = tmp / "runs"
    procs = Procs(runs)
    profile = paced_profile(tmp, max_steps=RESUMED_STEPS)
    seen: dict = {}
    try:
        env = pinned_env(**_wandb_home(tmp), PACE_S="0.05")
        proc = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs), *OFFLINE,
                           cwd=tmp, env=env)  # fmt: skip
        (run,) = wait_for(lambda: run_dirs(runs), what="the run directory")
        wait_for(lambda: any(e["step"] >= 15 for e in events_of(run, "step")), what="step 15")
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=deadline(600))
        seen["stopped"] = read_status(run)
        seen["first"] = wait_for(lambda: (s := _wandb_status(run)).get("state") == "done" and s,
                                 what="the first session's W&B end")  # fmt: skip
        # The first session's supervisor holds the run until its follower is done.
        wait_for(lambda: not _pid_alive(read_status(run)["pids"]["supervisor"]), what="its end")
        env = pinned_env(**_wandb_home(tmp))  # the resume unpaced: it runs at speed
        seen["done"] = procs.cli("run", "--resume", str(run), "--headless", "--runs-dir",
                                 str(runs), cwd=tmp, env=env)  # fmt: skip
        seen["status"] = wait_for(
            lambda: (s := _wandb_status(run)).get("state") == "done" and s,
            what="the second session's W&B end",
        )
        yield run, seen
    finally:
        procs.cleanup()


def test_an_offline_run_mirrors_the_scalars_and_the_profile(offline_resumed):
    run, seen = offline_resumed
    done, status = seen["done"], seen["status"]
    assert done.returncode == 0, done.stderr
    assert status["mode"] == "offline" and status["id"] == (run / "wandb_id").read_text().strip()
    assert f"W&B: offline run {status['id']}: wandb sync {status['dir']}" in done.stdout
    rows, config = _history(run)  # both sessions'
    logged = {e["step"]: e["loss"] for e in events_of(run, "step")}
    losses = {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert losses == pytest.approx(logged) and len(logged) == RESUMED_STEPS  # log_every = 1
    evals = {e["step"]: e["loss"] for e in events_of(run, "eval")}
    assert {r["_step"]: r["eval/loss"] for r in rows if "eval/loss" in r} == pytest.approx(evals)
    assert any("host/cpu_percent" in r for r in rows)  # telemetry, on the newest step
    assert config["train.lr"] == 0.003 and config["task.kind"] == "paced:Paced"
    assert read_status(run)["state"] == "finished"


def test_a_resume_logs_into_the_same_wandb_run(offline_resumed):
    run, seen = offline_resumed
    assert seen["stopped"]["state"] == "stopped" and seen["stopped"]["step"] < RESUMED_STEPS
    assert seen["done"].returncode == 0, seen["done"].stderr
    assert seen["status"]["id"] == seen["first"]["id"]  # the same W&B run
    assert len(list(run.glob("wandb/offline-run-*"))) == 2  # an offline directory a session
    rows, _ = _history(run)
    steps = [r["_step"] for r in rows if "train/loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == RESUMED_STEPS
    assert set(steps) == {e["step"] for e in events_of(run, "step")}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.quick
def test_without_the_package_the_run_trains_and_says_so_once(procs, runs_dir, tmp_path):
    env = without_packages(tmp_path, "wandb", **_wandb_home(tmp_path))
    done = procs.cli("run", str(fast_profile(tmp_path, max_steps=10)), "--headless",
                     "--runs-dir", str(runs_dir), *OFFLINE, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("W&B: off, the wandb package is not installed") == 1
    run = only_run(runs_dir)
    assert read_status(run)["state"] == "finished" and not (run / "wandb").exists()


def test_online_with_no_network_trains_to_the_end_and_says_wandb_is_off(procs, runs_dir, tmp_path):
    env = _env(tmp_path, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="x" * 40,
               GPU_CONSOLE_WANDB_INIT_TIMEOUT_S="5")  # fmt: skip
    online = ["--set", 'logging.wandb={project="gpuc-test", mode="online"}']
    done = procs.cli("run", str(fast_profile(tmp_path, max_steps=30)), "--headless",
                     "--runs-dir", str(runs_dir), *online, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = only_run(runs_dir)
    assert read_status(run)["state"] == "finished" and read_status(run)["step"] == 30
    status = wait_for(lambda: (s := _wandb_status(run)).get("state") == "off" and s,
                      what="W&B off")  # fmt: skip
    assert status["mode"] == "online" and status["why"]
    shown = procs.cli("status", run.name, "--runs-dir", str(runs_dir))
    assert f"W&B: off: {status['why']}" in shown.stdout
    # wandb styles some of its lines whatever it writes to: none of it reaches the log.
    log = run / "logs" / "wandb.log"
    logged = wait_for(lambda: "Find logs at" in (t := log.read_text()) and t,
                      what="wandb's closing lines")  # fmt: skip
    assert "W&B off for this session" in logged and "\x1b" not in logged


def test_a_bad_wandb_table_is_one_line_exit_2(procs, runs_dir, tmp_path):
    bad = ["--set", 'logging.wandb={mode="offline"}']
    done = procs.cli("run", str(fast_profile(tmp_path)), "--headless", "--runs-dir",
                     str(runs_dir), *bad, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and not run_dirs(runs_dir)
    assert done.stderr.strip() == (
        'gpu-console: --set: logging.wandb: needs project = "..." (the W&B project the run is '
        "logged into) (got {'mode': 'offline'})"
    )
