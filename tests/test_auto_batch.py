"""``data.batch_size = "auto"``: the search on real steps, its agreement over the ranks, the
state put back (training is bit-identical to a run given the size), run.toml, resume.

The GPU path (out of memory) runs on CPU ranks through the test-only seam
``GPU_CONSOLE_FAKE_OOM_ABOVE`` (engine/auto_batch.py); ``-m gpu`` runs it for real.
"""

from __future__ import annotations

import sys

import pytest
from conftest import events_of, only_run, read_status, run_dirs, write_profile
from conftest import test_env as cli_env
from harness import launch_notes, run_engine

from gpu_console.engine import auto_batch
from gpu_console.engine.auto_batch import OK, OOM, Trial, search

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

try:
    import torch

    CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    CUDA = False

PROFILE = """
[profile]
name = "{name}"
[task]
kind = "mlp"
hidden_dim = 64
train_samples = 4096
eval_samples = 256
[data]
batch_size = {batch}
[train]
max_steps = 6
lr = 3e-3
log_every = 1
precision = "fp32"
[distributed]
collective_timeout_s = 60
[hardware]
devices = "cpu:2"
"""


def profile(tmp_path, name: str, batch: str | int):
    return write_profile(tmp_path / f"{name}.toml", PROFILE.format(name=name, batch=batch))


def run(procs, runs_dir, path, *args: str, fake: str | None = None):
    env = cli_env(**({auto_batch.FAKE_OOM_ENV: fake} if fake else {}))
    result = procs.cli("run", str(path), "--headless", "--runs-dir", str(runs_dir), *args, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def trained(tmp_path, runs_dir, path, *sets: str, fake: str | None = None, resume=None):
    """``path`` run to its end (or ``resume`` resumed with it) on the engine harness
    (tests/harness.py): its run directory."""
    env = {auto_batch.FAKE_OOM_ENV: fake} if fake else {}
    return run_engine(tmp_path, path, *sets, ranks=2, resume=resume, runs_dir=runs_dir, env=env)


def last_state(run_dir) -> str:
    """How the run ended, as its last status event says (no supervisor folds status.json)."""
    return events_of(run_dir, "status")[-1]["state"]


def losses(run_dir) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in events_of(run_dir, "step")]


# -- the policy ---------------------------------------------------------------------------


def fits_up_to(limit: int, made: list[int]):
    def trial(size: int) -> Trial:
        made.append(size)
        return Trial(size, OK if size <= limit else OOM, 1.0, None, float(size))

    return trial


@pytest.mark.parametrize("limit", [1, 2, 3, 24, 100, 5000])
def test_memory_search_finds_the_largest_size_that_fits(limit):
    made: list[int] = []
    chosen, tried = search(fits_up_to(limit, made), 8192, by_memory=True)
    grain = 8 if limit >= 64 else 1
    assert chosen == limit // grain * grain  # from 64 up: a multiple of 8
    assert [t.size for t in tried] == made
    assert len(made) == len(set(made))  # no size tried twice


def test_memory_search_stops_at_the_bound_and_fails_when_nothing_fits():
    chosen, tried = search(fits_up_to(10**6, []), 100, by_memory=True)
    assert chosen == 100 and [t.size for t in tried] == [2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(auto_batch.AutoBatchError, match="not even a batch of 1"):
        search(fits_up_to(0, []), 100, by_memory=True)


def test_throughput_search_stops_where_samples_per_s_stop_growing():
    # 4: under 10 % more (noise, say), 8 well above the best: taken; then 16 and 32 under.
    rates = {2: 100.0, 4: 105.0, 8: 300.0, 16: 320.0, 32: 329.0, 64: 1000.0}

    def trial(size: int) -> Trial:
        return Trial(size, OK, 1.0, None, rates[size])

    chosen, tried = search(trial, 8192, by_memory=False)
    assert chosen == 8
    assert [t.size for t in tried] == [2, 4, 8, 16, 32]
    verdicts = [t.as_dict()["verdict"] for t in tried]
    assert verdicts[2] == "ok" and verdicts[1] == verdicts[3] == verdicts[4]
    assert verdicts[4].startswith("ok, under 10%")


def test_fake_oom_limits_are_read_per_rank(monkeypatch):
    monkeypatch.setenv(auto_batch.FAKE_OOM_ENV, "rank1:24")
    assert auto_batch.fake_oom_limit(0) is None and auto_batch.fake_oom_limit(1) == 24
    monkeypatch.setenv(auto_batch.FAKE_OOM_ENV, "40")
    assert auto_batch.fake_oom_limit(0) == auto_batch.fake_oom_limit(1) == 40


def test_run_toml_gets_the_number_in_data_only(tmp_path):
    text = '[task]\nkind = "x"\nbatch_size = "auto"\n\n[data]\nbatch_size = "auto"\nseed = 0\n'
    (tmp_path / "run.toml").write_text(text)
    auto_batch.write_run_toml(tmp_path, 24)
    doc = tomllib.loads((tmp_path / "run.toml").read_text())
    assert doc["data"]["batch_size"] == 24 and doc["task"]["batch_size"] == "auto"
    assert (
        'batch_size = 24  # chosen by data.batch_size = "auto"'
        in (tmp_path / "run.toml").read_text()
    )


# -- 2 CPU ranks: the engine harness (tests/harness.py), or real torchrun for the CLI's words --


def test_out_of_memory_search_agrees_and_trains_as_the_size_given(runs_dir, tmp_path):
    # Every rank's limit 24; then rank 1's only: one rank's out-of-memory is every rank's,
    # so rank 0 (which could go on) takes 24 too. Both then train exactly as a run
    # launched with 24.
    given = trained(tmp_path, runs_dir / "given", profile(tmp_path, "given", 24))
    assert events_of(given, "start")[0]["auto_batch"] is None
    for fake in ("24", "rank1:24"):
        auto = trained(tmp_path, runs_dir / fake, profile(tmp_path, "auto", '"auto"'), fake=fake)

        start = events_of(auto, "start")[0]
        ab = start["auto_batch"]
        assert ab["chosen"] == 24 and ab["rule"] == "memory", fake
        verdicts = {t["size"]: t["verdict"] for t in ab["tried"]}
        assert verdicts[24] == "ok" and verdicts[32] == verdicts[25] == "out of memory"
        assert all(v == "ok" for s, v in verdicts.items() if s <= 24)
        assert start["batch_size"] == 24 and start["global_batch"] == 48

        toml = (auto / "run.toml").read_text()
        assert tomllib.loads(toml)["data"]["batch_size"] == 24
        assert 'batch_size = 24  # chosen by data.batch_size = "auto"' in toml
        logs = [e["message"] for e in events_of(auto, "log")]
        assert any(m.startswith("data.batch_size = auto: 24 per rank") for m in logs), logs

        assert len(losses(auto)) == 6
        assert losses(auto) == losses(given), fake  # bit-identical: state and RNG put back
        assert last_state(auto) == "finished"


def test_a_resumed_auto_run_keeps_its_size_without_searching(monkeypatch, runs_dir, tmp_path):
    path = profile(tmp_path, "auto", '"auto"')
    first = trained(tmp_path, runs_dir, path, fake="20")
    assert events_of(first, "start")[0]["auto_batch"]["chosen"] == 20
    # The same profile (still "auto"), no seam: the run's 20 stands, no search. The launch's
    # notes are the lines `gpu-console run` prints on stderr before it starts the run.
    notes = launch_notes(monkeypatch)
    trained(tmp_path, runs_dir, path, "train.max_steps=8", resume=first)
    assert last_state(first) == "finished"
    assert "data.batch_size = auto: 20" in "\n".join(notes)
    assert len(run_dirs(runs_dir)) == 1
    second = events_of(first, "start")[1]
    assert second["auto_batch"] is None and second["batch_size"] == 20
    # Not a batch change against the run it resumes.
    assert [c["key"] for c in second["changes"]] == ["train.max_steps"]
    assert tomllib.loads((first / "run.toml").read_text())["data"]["batch_size"] == 20


def test_on_cpu_the_search_stops_where_samples_per_s_stop_growing(runs_dir, tmp_path):
    run_dir = trained(tmp_path, runs_dir, profile(tmp_path, "auto", '"auto"'), "train.max_steps=2")
    ab = events_of(run_dir, "start")[0]["auto_batch"]
    assert ab["rule"] == "throughput" and ab["headroom"] is None
    tried = ab["tried"]
    chosen = next(t for t in tried if t["size"] == ab["chosen"])
    taken = [t for t in tried if t["verdict"] == "ok"]
    assert taken[-1]["size"] == ab["chosen"]
    # Each size taken was at least 10 % faster than the one taken before it; the search
    # ended after two doublings in a row that were not (or at the bound, 2048 per rank).
    for before, after in zip(taken, taken[1:], strict=False):
        assert after["samples_per_s"] >= 1.1 * before["samples_per_s"]
    if tried[-1]["size"] < ab["largest"]:
        assert tried[-3]["size"] == ab["chosen"]
        for t in tried[-2:]:
            assert t["verdict"].startswith("ok, under 10%")
            assert t["samples_per_s"] < 1.1 * chosen["samples_per_s"]
    assert all(t["samples_per_s"] > 0 for t in tried)


@pytest.mark.parametrize(
    "where, setting, message",
    [
        ("set", "data.batch_size=big", "--set: data.batch_size: expected an integer or 'auto'"),
        ("set", "data.batch_size=0", "--set: data.batch_size: must be at least 1"),
        ("file", '"Auto"', "data.batch_size: expected an integer or 'auto' (got 'Auto')"),
        ("set", "data.auto_batch_headroom=0.95", "data.auto_batch_headroom: must be at most 0.9"),
        ("set", "data.auto_batch_headroom=-0.1", "data.auto_batch_headroom: must be at least 0"),
    ],
)
def test_bad_values_exit_2_naming_the_key(procs, runs_dir, tmp_path, where, setting, message):
    path = profile(tmp_path, "bad", setting if where == "file" else '"auto"')
    args = ["--set", setting] if where == "set" else []
    result = procs.cli("run", str(path), "--headless", "--runs-dir", str(runs_dir), *args)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and message in line and "Traceback" not in line
    if where == "file":
        assert line.startswith(f"gpu-console: {path}:")
    assert not runs_dir.exists()


def test_dry_run_says_the_size_is_searched_at_start(procs, runs_dir, tmp_path):
    path = profile(tmp_path, "auto", '"auto"')
    result = procs.cli("run", str(path), "--dry-run", "--runs-dir", str(runs_dir))
    assert result.returncode == 0, result.stderr
    assert "auto per rank (the largest that fits" in result.stdout
    assert not runs_dir.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_search_fits_under_the_headroom(procs, runs_dir, tmp_path):
    path = profile(tmp_path, "auto", '"auto"')
    run(procs, runs_dir, path, "--devices", "0", "--set", "task.train_samples=65536")
    run_dir = only_run(runs_dir)
    ab = events_of(run_dir, "start")[0]["auto_batch"]
    assert ab["rule"] == "memory" and ab["limit"] > 0
    chosen = next(t for t in ab["tried"] if t["size"] == ab["chosen"])
    assert chosen["verdict"] == "ok" and chosen["peak"] <= ab["limit"]
    for t in ab["tried"]:  # each verdict as its measured peak says
        if t["verdict"] == "ok":
            assert 0 < t["peak"] <= ab["limit"]
        elif t["verdict"] == "over headroom":
            assert t["peak"] > ab["limit"]
    assert read_status(run_dir)["state"] == "finished"
    assert tomllib.loads((run_dir / "run.toml").read_text())["data"]["batch_size"] == ab["chosen"]


def test_a_task_owned_step_is_searched_and_trains_as_the_size_given(runs_dir, tmp_path):
    # The GAN of tests/gan_task.py: train_step, two optimizers, their schedules (one on an
    # eval metric), each put back after the search.
    from test_task_optimizers import gan_profile, steps_of

    path = gan_profile(tmp_path, max_steps=6)
    given = path.read_text()
    path.write_text(given.replace("batch_size = 32", 'batch_size = "auto"'))
    auto = trained(tmp_path, runs_dir / "auto", path, fake="12")
    path.write_text(given.replace("batch_size = 32", "batch_size = 12"))
    given_run = trained(tmp_path, runs_dir / "given", path)
    assert events_of(auto, "start")[0]["auto_batch"]["chosen"] == 12
    assert steps_of(auto) == steps_of(given_run)
    assert len(steps_of(auto)) == 6
