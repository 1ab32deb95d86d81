"""Values that passed every check and then crashed a rank (issue 39), each now refused before
launch through the real CLI: exit 2, one line naming where the value came from and its key,
nothing written. The built-in text tasks' data is judged on the console side, with no
subprocess and no time budget, so a busy machine gives the same answer as an idle one; and the
training set the console counts is the one the ranks build."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import test_env as cli_env
from conftest import unprivileged, write_profile
from test_bad_input import assert_bad, run_bad

from gpu_console import network
from gpu_console.profile import load_profile
from gpu_console.schema import KeyProblem

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

TEXT_TASKS = ["lm", "moe", "hf"]


@pytest.fixture
def busy_machine():
    """A process spinning on every core (ended by pid), and the data check's budget the
    launch used to fall back on cut to nothing: what a loaded machine left of it."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield cli_env(GPU_CONSOLE_DATA_CHECK_S="0.1")
    finally:
        for proc in burners:
            proc.kill()
        for proc in burners:
            proc.wait()


@pytest.mark.parametrize("kind", TEXT_TASKS)
def test_a_missing_text_file_is_one_line_on_a_busy_machine(
    procs, runs_dir, tmp_path, busy_machine, kind
):
    missing = tmp_path / "nope.txt"
    args = [kind, "--devices", "cpu:1", "--set", f"task.text_file={json.dumps(str(missing))}"]
    result = procs.cli("run", *args, "--headless", "--runs-dir", str(runs_dir), env=busy_machine)
    (line,) = assert_bad(result, runs_dir)
    assert line == (
        f"gpu-console: --set: task.text_file: no such file: {missing} (got {str(missing)!r})"
    )


@pytest.mark.parametrize(
    "kind, samples",
    [("lm", 6814), ("moe", 6814), ("hf", 6814), ("cvrp20", 25600)],
)
def test_a_built_in_tasks_batch_is_judged_without_a_subprocess(procs, runs_dir, kind, samples):
    """The data check's budget cut to nothing: a count that needed the engine's subprocess
    would be skipped ("not checked before launch") and the run launched."""
    args = [kind, "--devices", "cpu:1", "--set", "data.batch_size=1000000"]
    result = procs.cli(
        "run", *args, "--headless", "--runs-dir", str(runs_dir),
        env=cli_env(GPU_CONSOLE_DATA_CHECK_S="0.1"),
    )  # fmt: skip
    (line,) = assert_bad(result, runs_dir)
    assert line == (
        f"gpu-console: --set: data.batch_size: {samples} samples over 1 ranks "
        "is less than one batch (got 1000000)"
    )


# (--set, the key at fault, what the line must also say)
SET_CASES = [
    ("distributed.startup_timeout_s=1e30", "distributed.startup_timeout_s", "at most 604800"),
    ("distributed.collective_timeout_s=1e12", "distributed.collective_timeout_s", "at most 604800"),
    ("distributed.shutdown_grace_s=1e30", "distributed.shutdown_grace_s", "at most 86400"),
    ("distributed.bucket_cap_mb=1e30", "distributed.bucket_cap_mb", "at most 1048576"),
    ("distributed.max_restarts=1e9", "distributed.max_restarts", "at most 1000"),
    ("data.num_workers=100000", "data.num_workers", "at most 1024"),
    ("data.prefetch_factor=1e9", "data.prefetch_factor", "at most 1024"),
    ("train.seed=1e30", "train.seed", "64-bit integer"),
    ("train.max_steps=1e20", "train.max_steps", "64-bit integer"),
    ("task.data_seed=-1e30", "task.data_seed", "64-bit integer"),
    ('distributed.env.LD_PRELOAD="/x.so"', "distributed.env.LD_PRELOAD", "dynamic loader"),
    ('distributed.env.LD_LIBRARY_PATH="/x"', "distributed.env.LD_LIBRARY_PATH", "dynamic loader"),
    ('distributed.env.PYTHONPATH="/x"', "distributed.env.PYTHONPATH", "Python reads it only"),
    ('distributed.env.PYTHONHOME="/x"', "distributed.env.PYTHONHOME", "Python reads it only"),
]


@pytest.mark.parametrize("override, key, says", SET_CASES, ids=[c[1] for c in SET_CASES])
def test_a_value_that_crashed_a_rank_is_refused(procs, runs_dir, override, key, says):
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--set", override), runs_dir)
    assert line.startswith(f"gpu-console: --set: {key}: "), line
    assert says in line, line


def test_an_environment_variable_read_at_start_names_what_to_do_instead(procs, runs_dir, tmp_path):
    path = write_profile(
        tmp_path / "p.toml",
        '[distributed]\nenv = { LD_PRELOAD = "/x.so" }\nstartup_timeout_s = 1e30\n',
    )
    lines = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir, lines=2)
    assert (
        lines[0]
        == f"gpu-console: {path}: distributed.startup_timeout_s: must be at most 604800 (got 1e+30)"
    )
    assert lines[1] == (
        f"gpu-console: {path}: distributed.env.LD_PRELOAD: cannot take effect here: the dynamic "
        "loader reads it only when a process starts, before a rank applies distributed.env; "
        "export it in the shell that runs gpu-console (the ranks inherit it) (got '/x.so')"
    )


def test_variables_read_after_start_are_still_accepted():
    good, problems = network.env_problems(
        {"NCCL_DEBUG": "INFO", "PYTHONBREAKPOINT": "0", "OMP_NUM_THREADS": 2, "LDX": "1"}
    )
    assert problems == [] and good["OMP_NUM_THREADS"] == "2"
    _, problems = network.env_problems({"GLIBC_TUNABLES": "x", "PYTHONHASHSEED": "0"})
    assert [p.split(":")[0] for p in problems] == [
        "distributed.env.GLIBC_TUNABLES", "distributed.env.PYTHONHASHSEED",
    ]  # fmt: skip


def _text_case(tmp_path, case: str) -> str:
    """A ``task.text_file`` a rank could not train on."""
    if case == "directory":
        return str(tmp_path)
    path = tmp_path / f"{case}.txt"
    path.write_bytes({"empty": b"", "short": b"ten bytes\n", "unreadable": b"x" * 10_000}[case])
    if case == "unreadable":
        path.chmod(0)
    return str(path)


@pytest.mark.parametrize(
    "kind, case, says",
    [
        ("lm", "directory", "not a regular file: {path}"),
        ("moe", "empty", "the file is empty: {path}"),
        ("hf", "empty", "the file is empty: {path}"),
        ("lm", "short", "10 bytes (task.eval_fraction = 0.05 held out) hold no training "
         "sequence of 65 bytes"),
        ("lm", "unreadable", "cannot read {path}: Permission denied"),
    ],
)  # fmt: skip
def test_a_text_file_a_rank_could_not_train_on_is_refused(
    procs, runs_dir, tmp_path, kind, case, says
):
    text = _text_case(tmp_path, case)
    args = [kind, "--devices", "cpu:1", "--set", f"task.text_file={json.dumps(text)}"]
    result = procs.cli(
        "run", *args, "--headless", "--runs-dir", str(runs_dir), prefix=unprivileged()
    )
    (line,) = assert_bad(result, runs_dir)
    assert line == f"gpu-console: --set: task.text_file: {says.format(path=text)} (got {text!r})"


def test_hf_seq_len_beyond_the_config_tables_positions_is_refused(procs, runs_dir):
    (line,) = assert_bad(run_bad(procs, runs_dir, "hf", "--set", "task.seq_len=128"), runs_dir)
    assert line == (
        "gpu-console: --set: task.seq_len: above the model's n_positions = 64 (task.config), the "
        "longest it can read (got 128)"
    )


def test_hf_seq_len_beyond_a_saved_models_positions_is_refused(procs, runs_dir, tmp_path):
    """Read from the model directory's config.json as plain JSON; relative to where the run
    is launched (the ranks' directory)."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(
        json.dumps({"model_type": "bert", "max_position_embeddings": 16})
    )
    sets = ["--set", "task.model=saved", "--set", "task.seq_len=32"]
    (line,) = assert_bad(run_bad(procs, runs_dir, "hf", *sets, cwd=tmp_path), runs_dir)
    assert line == (
        "gpu-console: --set: task.seq_len: above the model's max_position_embeddings = 16 "
        "(task.model), the longest it can read (got 32)"
    )
    (saved / "config.json").unlink()
    (line,) = assert_bad(run_bad(procs, runs_dir, "hf", *sets, cwd=tmp_path), runs_dir)
    assert line == (
        f"gpu-console: --set: task.model: no config.json in {saved}: not a saved transformers "
        "model (got 'saved')"
    )


# -- the console's count is the ranks' ------------------------------------------------------


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["task.seq_len=7", "task.eval_fraction=0.0"],
        ["task.seq_len=100", "task.eval_fraction=0.5", "TEXT"],
        ["task.seq_len=2", "task.eval_fraction=0.13", "TEXT"],
    ],
)
@pytest.mark.parametrize("kind", ["lm", "moe"])
def test_the_console_counts_the_training_sequences_the_ranks_build(tmp_path, kind, sets):
    from gpu_console.tasks.lm import LMTask
    from gpu_console.tasks.moe import MoETask

    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 41 + b"tail")
    sets = [s if s != "TEXT" else f"task.text_file={text}" for s in sets]
    cfg = load_profile(kind, sets).task
    train, _ = {"lm": LMTask, "moe": MoETask}[kind](cfg).build_datasets()
    assert cfg.train_size() == len(train) > 0


@pytest.mark.parametrize("head", ["causal-lm", "sequence-classification"])
def test_hf_counts_a_config_tables_sequences_as_its_ranks_build_them(head):
    pytest.importorskip("transformers")
    from gpu_console.tasks.hf import HFTask

    cfg = load_profile("hf", [f"task.head={head}", "task.seq_len=33"]).task
    task = HFTask(cfg)
    task.build_model()
    train, _ = task.build_datasets()
    assert cfg.train_size() == len(train) > 0


def test_a_relative_text_file_is_judged_in_the_runs_own_directory(tmp_path, monkeypatch):
    """A resume from another directory: the ranks start in the run's launch directory."""
    (tmp_path / "t.txt").write_bytes(b"x" * 1000)
    cfg = load_profile("lm", ["task.text_file=t.txt", "task.eval_fraction=0.0"]).task
    monkeypatch.chdir("/")
    assert cfg.train_size(str(tmp_path)) == 1000 // 65
    with pytest.raises(KeyProblem, match="task.text_file: no such file: /t.txt"):
        cfg.train_size(None)


def test_hf_rotary_positions_do_not_limit_seq_len_but_a_learned_table_does():
    # max_position_embeddings is a hard limit for a learned table (BERT's), a training length
    # only for rotary positions (Llama's): a longer sequence runs there.
    from gpu_console.schema import KeyProblem
    from gpu_console.tasks.configs import HFConfig

    llama = {"model_type": "llama", "max_position_embeddings": 16, "rope_theta": 10000.0,
             "vocab_size": 256}  # fmt: skip
    assert HFConfig(config=llama, seq_len=64).train_size() > 0
    bert = {**llama, "model_type": "bert"}
    del bert["rope_theta"]
    with pytest.raises(KeyProblem, match="max_position_embeddings = 16"):
        HFConfig(config=bert, seq_len=64).train_size()
