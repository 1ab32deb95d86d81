"""Sweeps (gpu_console/sweep/, issue 41): the file judged in full before anything starts, the
trials a search makes, and real sweeps through the CLI: trials packed on ``--devices cpu:2``
one rank each, every trial an ordinary run, the best named; a console that goes away, a
driver killed with SIGKILL and trials killed with it, then ``sweep --resume``.
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import optuna
import psutil
import pytest
from conftest import (
    deadline,
    events_of,
    fast_profile,
    paced_profile,
    read_status,
    run_dirs,
    wait_for,
    without_packages,
)
from conftest import test_env as cli_env

from gpu_console.runs import latest_checkpoint
from gpu_console.sweep import store
from gpu_console.sweep.spec import SweepError, load_sweep
from gpu_console.sweep.study import storage_url
from gpu_console.sweep.trials import make_trials


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def sweep_file(tmp_path: Path, params: str, extra: str = "", sweep: str = "") -> Path:
    if "trial_devices" not in sweep:
        sweep = f'trial_devices = "cpu:1"\n{sweep}'
    return write(
        tmp_path / "lr.toml",
        f'[sweep]\nprofile = "fast.toml"\n{sweep}\n'
        f'[objective]\nmetric = "eval.loss"\n\n[parameters]\n{params}\n{extra}',
    )


# -- the file and the trials ---------------------------------------------------------------


@pytest.mark.quick
def test_a_grid_takes_every_combination_in_order_and_trials_caps_it(tmp_path):
    fast_profile(tmp_path)
    path = sweep_file(
        tmp_path,
        '"train.lr" = {log_range = [1e-4, 1e-2], num = 3}\n'
        '"data.batch_size" = [16, 32]\n'
        '"train.warmup_steps" = {range = [0, 10], step = 5}\n',
    )
    trials = make_trials(load_sweep(path))
    assert len(trials) == 3 * 2 * 3
    assert [t["train.lr"] for t in trials[::6]] == pytest.approx([1e-4, 1e-3, 1e-2])
    assert [t["data.batch_size"] for t in trials[:6:3]] == [16, 32]
    assert [t["train.warmup_steps"] for t in trials[:3]] == [0, 5, 10]
    path.write_text(path.read_text().replace("[sweep]\n", "[sweep]\ntrials = 4\n"))
    assert make_trials(load_sweep(path)) == trials[:4]


@pytest.mark.quick
def test_a_random_search_is_seeded_and_stays_in_its_ranges(tmp_path):
    fast_profile(tmp_path)
    params = (
        '"train.lr" = {log_range = [1e-5, 1e-1]}\n'
        '"data.batch_size" = {range = [8, 64]}\n'
        '"task.hidden_dim" = [32, 64]\n'
    )
    path = sweep_file(tmp_path, params, sweep='search = "random"\ntrials = 200\nseed = 3')
    first, again = make_trials(load_sweep(path)), make_trials(load_sweep(path))
    assert first == again and len(first) == 200
    lrs = [t["train.lr"] for t in first]
    assert all(1e-5 <= v <= 1e-1 for v in lrs)
    # log-uniform: about as many draws in each decade
    decades = [sum(10 ** (-5 + d) <= v < 10 ** (-4 + d) for v in lrs) for d in range(4)]
    assert min(decades) > 25, decades
    assert all(type(t["data.batch_size"]) is int and 8 <= t["data.batch_size"] <= 64 for t in first)
    assert {t["task.hidden_dim"] for t in first} == {32, 64}
    path.write_text(path.read_text().replace("seed = 3", "seed = 4"))
    assert make_trials(load_sweep(path)) != first


@pytest.mark.quick
def test_the_file_is_judged_in_full_every_problem_naming_its_key(tmp_path):
    fast_profile(tmp_path)
    path = write(
        tmp_path / "bad.toml",
        '[sweep]\nprofile = "fast.toml"\nsearch = "bayes"\ntrails = 3\n'
        '[objective]\nmetric = "accuracy"\n[pruning]\nkind = "hyperband"\nwarmup_evals = -1\n'
        '[parameters]\n"train.lr" = {range = [0.1, 0.1]}\n"data.batch_size" = []\n'
        '"train.warmup_steps" = {log_range = [0, 10], num = 3}\n',
    )
    with pytest.raises(SweepError) as e:
        load_sweep(path)
    problems = e.value.problems
    expected = [
        "sweep.trails: unknown key",
        "sweep.search: expected one of grid, random, tpe (got 'bayes')",
        "objective.metric: expected eval.<metric>",
        "pruning.kind: expected one of none, median (got 'hyperband')",
        "pruning.warmup_evals: expected a whole number >= 0 (got -1)",
        "parameters.train.lr.range: an empty range",
        "parameters.data.batch_size.values: expected a non-empty list",
        "parameters.train.warmup_steps.log_range: a log range needs low > 0",
    ]
    for part in expected:
        assert any(p.startswith(f"{path}: ") and part in p for p in problems), (part, problems)
    assert len(problems) == len(expected), problems


# -- the CLI: bad input is one line, exit 2, nothing written ----------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    "params, sweep, devices, expected",
    [
        ('"train.lrr" = [0.1, 0.2]', "", "cpu:2", "lr.toml: parameters.train.lrr: unknown key"),
        ('"train.lr" = {range = [0.2, 0.1], step = 0.1}', "", "cpu:2",
         "lr.toml: parameters.train.lr.range: an empty range"),
        ('"train.lr" = [0.1, 0.2]', 'trial_devices = "cpu:3"', "cpu:2",
         "lr.toml: sweep.trial_devices: a trial needs 3 CPU ranks, the sweep has 2"),
        ('"train.lr" = [0.1, 0.2]', "trial_devices = 1", "cpu:2",
         "lr.toml: sweep.trial_devices: a trial of 1 GPU(s), but the sweep's devices are 2 CPU"),
        ('"train.lr" = [0.1, -0.2]', "", "cpu:2", "lr.toml: trial 1 (train.lr=-0.2): "),
        ('"train.lr" = [0.1]', "", "cpu:9999", "--devices: 9999 CPU ranks on"),
        ('"train.lr" = {range = [0.1, 0.2], step = 1e-9}', "", "cpu:2",
         "lr.toml: parameters.train.lr.step: a grid of 100,000,001 values; at most 10,000"),
    ],
    ids=["unknown key", "empty range", "more cpus than granted", "gpus on a cpu grant",
         "a trial's value refused", "devices", "a grid too big"],
)  # fmt: skip
def test_a_bad_sweep_is_one_line_exit_2_and_nothing_started(
    tmp_path, procs, runs_dir, params, sweep, devices, expected
):
    fast_profile(tmp_path)
    path = sweep_file(tmp_path, params, sweep=sweep)
    r = procs.cli("sweep", str(path), "--devices", devices, "--runs-dir", str(runs_dir))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not runs_dir.exists(), "nothing written"


# -- real sweeps ------------------------------------------------------------------------------


def overlapping(events: list[dict]) -> int:
    """The most trials running at once, by the driver's own events."""
    live, most = 0, 0
    for e in events:
        if e.get("kind") != "trial":
            continue
        if e["state"] in ("started", "resumed"):
            live += 1
        elif e["state"] in ("finished", "failed", "stopped"):
            live -= 1
        most = max(most, live)
    return most


def test_eight_trials_two_at_a_time_every_trial_a_run_and_the_best_named(tmp_path, procs, runs_dir):
    fast_profile(tmp_path, max_steps=12, extra="[checkpoint]\nevery_steps = 0\n")
    path = sweep_file(
        tmp_path,
        '"train.lr" = [1e-3, 3e-3, 1e-2, 3e-2]\n"data.batch_size" = [16, 32]\n',
        extra='[set]\n"train.eval_every" = 6\n',
    )
    r = procs.cli("sweep", str(path), "--devices", "cpu:2", "--runs-dir", str(runs_dir),
                  timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    (sweep_dir,) = [p.parent for p in runs_dir.glob("*/sweep.json")]
    events = store.read_events(sweep_dir)
    assert overlapping(events) == 2, "two slots, both used, never a third trial"
    trials = run_dirs(sweep_dir)
    assert [t.name for t in trials] == [f"trial-{n:03d}" for n in range(8)]
    plan = store.read_plan(sweep_dir)
    values = {}
    for n, run in enumerate(trials):
        assert read_status(run)["state"] == "finished"
        toml = (run / "run.toml").read_text()
        params = plan["trials"][n]["params"]
        assert (
            f"lr = {params['train.lr']!r}" in toml
            and f"batch_size = {params['data.batch_size']}" in toml
        )
        evals = events_of(run, "eval")
        assert [e["step"] for e in evals] == [6, 12]
        values[n] = evals[-1]["loss"]
        meta = json.loads((run / "meta.json").read_text())
        assert meta["placement"]["nproc"] == 1 and meta["placement"]["device_type"] == "cpu"
    ends = {
        e["trial"]: e["objective"]
        for e in events
        if e["kind"] == "trial" and e["state"] == "finished"
    }
    assert ends == values, "each trial's objective is its last eval's loss"
    best = min(values, key=values.get)
    assert events[-1]["kind"] == "sweep" and events[-1]["state"] == "finished"
    assert events[-1]["best"]["trial"] == best and events[-1]["best"]["run"] == f"trial-{best:03d}"
    assert f"best: trial {best}, eval.loss = {values[best]:.6g}" in r.stdout
    assert r.stdout.count(" finished: eval.loss = ") == 8
    # The sweep's Optuna study holds the same trials, values and objectives.
    study = optuna.load_study(study_name=sweep_dir.name, storage=storage_url(sweep_dir))
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 8
    assert {t.user_attrs["sweep_trial"]: t.value for t in study.trials} == values
    assert [t.params for t in study.trials] == [plan["trials"][n]["params"] for n in range(8)]
    assert [sorted(t.intermediate_values) for t in study.trials] == [[6, 12]] * 8
    # report SWEEP: the two figures and a page with every trial's objective, the best marked.
    rep = procs.cli("report", sweep_dir.name, "--runs-dir", str(runs_dir))
    assert rep.returncode == 0, rep.stderr
    page = (sweep_dir / "report" / "index.html").read_text()
    for n, value in values.items():
        star = "★ " if n == best else ""
        assert f"<td>{star}{n}</td><td>finished</td>" in page and f"<td>{value:.6g}</td>" in page
    for name in ("objective", "curves"):
        png = sweep_dir / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # ls finds the trials as the runs they are.
    ls = procs.cli("ls", "--json", "--sweep", sweep_dir.name, "--runs-dir", str(runs_dir))
    assert ls.returncode == 0, ls.stderr
    assert sorted(row["state"] for row in json.loads(ls.stdout)) == ["finished"] * 8


def started_sweep(runs_dir: Path, console) -> Path:
    """The sweep's directory once it exists; the console's words if it ended first."""

    def made() -> Path | None:
        found = next((p.parent for p in runs_dir.glob("*/sweep.json")), None)
        if found is None and console.poll() is not None:
            raise AssertionError(f"the console ended: {console.communicate()}")
        return found

    return wait_for(made, what="the sweep's directory")


def paced_sweep(tmp_path, procs, runs_dir, params, extra, devices, paced=True):
    """A sweep of paced.toml's task started by the console, paced while the file ``pace``
    exists (made here unless ``paced`` is False): (pace, env, console, sweep directory)."""
    pace = tmp_path / "pace"
    if paced:
        pace.touch()
    path = sweep_file(tmp_path, params, extra=extra)
    env = cli_env(PACE_S="0.05", PACE_WHILE=str(pace))
    console = procs.start("sweep", str(path), "--devices", devices, "--runs-dir", str(runs_dir),
                          env=env, cwd=tmp_path)  # fmt: skip
    return pace, env, console, started_sweep(runs_dir, console)


def _driver_pid(sweep_dir: Path) -> int:
    return [e["pid"] for e in store.read_events(sweep_dir) if e.get("pid")][-1]


def _kill_run_tree(run: Path) -> None:
    """A machine's reboot, for one trial: every process of its run, SIGKILL."""
    status = read_status(run)
    pids = status.get("pids", {})
    victims = []
    for pid in [pids.get("supervisor"), pids.get("torchrun"), *(pids.get("workers") or [])]:
        if pid:
            try:
                p = psutil.Process(pid)
                victims += [*p.children(recursive=True), p]
            except psutil.Error:
                pass
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(victims, timeout=deadline(30))


def _trial_events(sweep_dir: Path, n: int) -> list[str]:
    return [e["state"] for e in store.read_events(sweep_dir) if e.get("trial") == n]


def test_console_gone_driver_killed_then_resume_keeps_finished_takes_back_and_resumes(
    tmp_path, procs, runs_dir
):
    """Trials 0 and 1 are short and finish; 2 and 3 are long and paced. The console is
    killed (the sweep goes on), then the driver and trial 2's whole run (SIGKILL) while trial
    3 lives. ``sweep --resume``: trials 0 and 1 are not repeated, trial 3 is taken back where
    it runs, trial 2 resumes from its checkpoint, and the sweep ends with every trial."""
    paced_profile(tmp_path, max_steps=8, extra="[checkpoint]\nevery_steps = 4\n")
    pace, env, console, sweep_dir = paced_sweep(
        tmp_path, procs, runs_dir, '"train.max_steps" = [8, 400]\n"train.lr" = [1e-3, 2e-3]\n',
        '[set]\n"train.eval_every" = 4\n', "cpu:2",
    )  # fmt: skip
    wait_for(lambda: _trial_events(sweep_dir, 3)[:1] == ["started"], what="trial 3 started")
    console.send_signal(signal.SIGKILL)
    console.wait()
    # Both long trials past their first checkpoint, the console gone for a while.
    for n in (2, 3):
        run = sweep_dir / f"trial-{n:03d}"
        wait_for(lambda run=run: len(events_of(run, "checkpoint")) >= 2,
                 what=f"trial {n}'s second checkpoint")  # fmt: skip
    finished_before = {n for n in (0, 1) if _trial_events(sweep_dir, n)[-1:] == ["finished"]}
    assert finished_before == {0, 1}, "the short trials ended while the console was gone"
    driver = psutil.Process(_driver_pid(sweep_dir))
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=deadline(30))
    _kill_run_tree(sweep_dir / "trial-002")
    # Where it stopped: its newest complete checkpoint once every process of it is gone (read
    # before the kill, a checkpoint written meanwhile would be newer).
    stopped_at = int(latest_checkpoint(sweep_dir / "trial-002").name.rsplit("-", 1)[-1])
    assert read_status(sweep_dir / "trial-003").get("ended") is None, "trial 3 still runs"
    pace.unlink()  # the rest at full speed

    r = procs.cli("sweep", "--resume", sweep_dir.name, "--runs-dir", str(runs_dir), env=env,
                  cwd=tmp_path, timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"trial 2 resumed from step {stopped_at}" in r.stdout, r.stdout
    assert "trial 3 still running" in r.stdout, r.stdout
    assert _trial_events(sweep_dir, 0) == ["started", "finished"], "not repeated"
    assert _trial_events(sweep_dir, 1) == ["started", "finished"]
    assert _trial_events(sweep_dir, 2) == ["started", "resumed", "finished"]
    assert _trial_events(sweep_dir, 3) == ["started", "adopted", "finished"]
    trial2 = json.loads((sweep_dir / "trial-002" / "meta.json").read_text())
    assert len(trial2["sessions"]) == 2, "one run, continued in place"
    steps = [e["step"] for e in events_of(sweep_dir / "trial-002", "step")]
    assert steps[-1] == 400 and min(s for s in steps if s > stopped_at) == stopped_at + 1
    last = store.read_events(sweep_dir)[-1]
    assert last["state"] == "finished" and last["best"] is not None
    for n in range(4):
        assert read_status(sweep_dir / f"trial-{n:03d}")["state"] == "finished"
    # A finished sweep is not resumed again.
    again = procs.cli("sweep", "--resume", str(sweep_dir), "--runs-dir", str(runs_dir))
    assert again.returncode == 2 and "nothing to resume" in again.stderr


def test_ctrl_c_stops_the_trials_with_checkpoints_and_resume_finishes_them(
    tmp_path, procs, runs_dir
):
    """While the driver lives a second is refused. Ctrl-C at the console: the running trial
    checkpoints and stops, the sweep ends ``stopped`` (exit 0), the trial not yet started
    stays pending; ``sweep --resume`` continues the one and starts the other."""
    paced_profile(tmp_path, max_steps=300)
    pace, env, console, sweep_dir = paced_sweep(
        tmp_path, procs, runs_dir, '"train.lr" = [1e-3, 2e-3]\n', "", "cpu:1"
    )
    run = sweep_dir / "trial-000"
    wait_for(lambda: len(events_of(run, "step")) >= 3, what="trial 0 training")
    r = procs.cli("sweep", "--resume", str(sweep_dir), "--runs-dir", str(runs_dir))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == (
        f"gpu-console: --resume: {sweep_dir}: its driver is running (pid "
        f"{_driver_pid(sweep_dir)}); one driver per sweep"
    )
    console.send_signal(signal.SIGINT)
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, (out, err)
    assert "stopping the sweep" in out and "sweep stopped: stop asked" in out, out
    status = read_status(run)
    assert status["state"] == "stopped" and status["checkpointed_on_stop"] is True
    assert _trial_events(sweep_dir, 0) == ["started", "stopped"]
    assert _trial_events(sweep_dir, 1) == [], "not started after the stop"
    stopped_at = status["step"]

    pace.unlink()
    r = procs.cli("sweep", "--resume", str(sweep_dir), "--runs-dir", str(runs_dir), env=env,
                  cwd=tmp_path, timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"trial 0 resumed from step {stopped_at}" in r.stdout, r.stdout
    assert _trial_events(sweep_dir, 0) == ["started", "stopped", "resumed", "finished"]
    assert _trial_events(sweep_dir, 1) == ["started", "finished"]
    assert [e["step"] for e in events_of(run, "step")][-1] == 300


def test_a_trial_clearly_worse_than_the_median_is_pruned_with_its_checkpoint(
    tmp_path, procs, runs_dir
):
    """One slot: trials 0 and 1 (a good lr) finish, then trial 2 (an lr that barely moves
    the weights) is worse than their median at its first eval and stops there, pruned, with
    its checkpoint; its slot goes on, the best is one of the others."""
    paced_profile(tmp_path, max_steps=200)
    # Trial 2 alone is paced (the file made once it started): it must not end before the
    # pruner acts.
    pace, _, console, sweep_dir = paced_sweep(
        tmp_path, procs, runs_dir, '"train.lr" = [3e-3, 2e-3, 1e-7]\n',
        '[pruning]\nkind = "median"\n\n[set]\n"train.eval_every" = 20\n', "cpu:1", paced=False,
    )  # fmt: skip
    wait_for(lambda: _trial_events(sweep_dir, 2)[:1] == ["started"], timeout=300,
             what="trial 2 started")  # fmt: skip
    pace.touch()
    out, err = console.communicate(timeout=deadline(300))
    assert console.returncode == 0, (out, err)
    assert _trial_events(sweep_dir, 2) == ["started", "pruning", "pruned"], out
    (pruned,) = [e for e in store.read_events(sweep_dir) if e.get("state") == "pruned"]
    assert (
        pruned["reason"].startswith("eval.loss ")
        and "at step 20, worse than the median" in (pruned["reason"])
    ), pruned
    assert f"trial 2 pruned at step {pruned['step']}: eval.loss" in out, out
    status = read_status(sweep_dir / "trial-002")
    assert status["state"] == "stopped" and status["checkpointed_on_stop"] is True
    assert 20 <= status["step"] < 200
    evals = {n: events_of(sweep_dir / f"trial-{n:03d}", "eval") for n in range(3)}
    median = sorted(e["loss"] for n in (0, 1) for e in evals[n] if e["step"] == 20)
    assert evals[2][0]["step"] == 20 and evals[2][0]["loss"] > sum(median) / 2
    last = store.read_events(sweep_dir)[-1]
    assert last["state"] == "finished" and last["best"]["trial"] in (0, 1)


@pytest.mark.quick
def test_tpe_without_optuna_is_one_line_naming_the_extra(tmp_path, procs, runs_dir):
    fast_profile(tmp_path)
    path = sweep_file(tmp_path, '"train.lr" = {log_range = [1e-4, 1e-2]}\n',
                      sweep='search = "tpe"\ntrials = 3')  # fmt: skip
    env = without_packages(tmp_path, "optuna")
    r = procs.cli("sweep", str(path), "--devices", "cpu:2", "--runs-dir", str(runs_dir), env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == (
        f"gpu-console: {path}: sweep.search: tpe needs Optuna: pip install "
        "\"gpu-console[sweep]\" (got 'tpe')"
    )
    assert not runs_dir.exists()


def test_a_tpe_search_asks_optuna_for_each_trial_and_its_study_reads_back(
    tmp_path, procs, runs_dir
):
    """Four trials chosen by Optuna's TPE (seeded) as slots free up, each in the plan as it
    starts; Optuna's own API opens the sweep's storage and lists them with their values."""
    fast_profile(tmp_path, max_steps=12, extra="[checkpoint]\nevery_steps = 0\n")
    path = sweep_file(
        tmp_path, '"train.lr" = {log_range = [1e-4, 1e-1]}\n"task.hidden_dim" = [16, 32, 64]\n',
        sweep='search = "tpe"\ntrials = 4\nseed = 7', extra='[set]\n"train.eval_every" = 6\n',
    )  # fmt: skip
    dry = procs.cli("sweep", str(path), "--devices", "cpu:2", "--dry-run", "--json",
                    "--runs-dir", str(runs_dir))  # fmt: skip
    assert dry.returncode == 0 and json.loads(dry.stdout)["trials"] == [], dry.stderr
    r = procs.cli("sweep", str(path), "--devices", "cpu:2", "--runs-dir", str(runs_dir),
                  timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    (sweep_dir,) = [p.parent for p in runs_dir.glob("*/sweep.json")]
    plan = store.read_plan(sweep_dir)
    assert [t["trial"] for t in plan["trials"]] == [0, 1, 2, 3]
    events = store.read_events(sweep_dir)
    assert overlapping(events) == 2
    ends = {e["trial"]: e["objective"] for e in events if e["kind"] == "trial"
            and e["state"] == "finished"}  # fmt: skip
    study = optuna.load_study(study_name=sweep_dir.name, storage=storage_url(sweep_dir))
    assert {t.user_attrs["sweep_trial"]: t.value for t in study.trials} == ends
    assert len(ends) == 4
    for t in study.trials:
        n = t.user_attrs["sweep_trial"]
        assert t.params == plan["trials"][n]["params"]
        assert 1e-4 <= t.params["train.lr"] <= 1e-1 and t.params["task.hidden_dim"] in (16, 32, 64)
        toml = (sweep_dir / f"trial-{n:03d}" / "run.toml").read_text()
        assert f"hidden_dim = {t.params['task.hidden_dim']}" in toml
    assert study.best_trial.user_attrs["sweep_trial"] == events[-1]["best"]["trial"]
