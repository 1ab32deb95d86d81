"""User mistakes given to ``gpu-console run ... --headless``, each through the real CLI.

Every bad input must end fast with exit code 2, one ``gpu-console: ...`` line on stderr per
problem naming where it came from (the profile file, or ``--set``/``--devices``/
``--precision``/``--resume``) and the ``section.key`` at fault, no traceback, and no run
directory left behind. Nothing here reaches torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import REHEARSED_GPUS, run_dirs, unprivileged, write_profile

TIMEOUT_S = 60.0


def run_bad(procs, runs_dir: Path, *args: str, cwd: Path | None = None):
    return procs.cli(
        "run", *args, "--headless", "--runs-dir", str(runs_dir), cwd=cwd, timeout=TIMEOUT_S
    )


def assert_bad(
    result: subprocess.CompletedProcess,
    runs_dir: Path,
    *,
    lines: int = 1,
    existing: list[Path] | None = None,
) -> list[str]:
    """Exit 2, ``lines`` one-line messages, no traceback, no run directory made."""
    both = result.stdout + result.stderr
    assert result.returncode == 2, both
    assert "Traceback" not in both, both
    assert result.stdout == "", both
    got = result.stderr.splitlines()
    assert len(got) == lines, result.stderr
    for line in got:
        assert line.strip(), result.stderr
        assert line.startswith("gpu-console: "), result.stderr
    assert run_dirs(runs_dir) == (existing or []), "a bad input left a run directory behind"
    if existing is None and runs_dir.is_dir():
        assert list(runs_dir.iterdir()) == [], "a bad input wrote into the runs directory"
    return got


# -- problems in the profile file -------------------------------------------------------------

# (id, profile text, section.key at fault, more text the message must contain)
FILE_CASES = [
    ("malformed-toml", "[train\nlr = 1\n", None, ["not valid TOML", "line 1"]),
    ("unknown-section", "[trian]\nlr = 0.1\n", "trian", ["unknown section", "[train]"]),
    ("not-a-table", "train = 3\n", "train", ["[train] table", "got 3"]),
    ("unknown-key-near-miss", "[train]\nlrr = 0.1\n", "train.lrr", ["did you mean 'lr'"]),
    (
        "string-for-int",
        '[train]\nmax_steps = "ten"\n',
        "train.max_steps",
        ["expected an integer", "'ten'"],
    ),
    (
        "fraction-for-int",
        "[train]\nmax_steps = 10.5\n",
        "train.max_steps",
        ["expected an integer", "10.5"],
    ),
    ("float-for-bool", "[data]\npin_memory = 1.5\n", "data.pin_memory", ["true or false", "1.5"]),
    (
        "bool-for-int",
        "[data]\nbatch_size = true\n",
        "data.batch_size",
        ["expected an integer", "got true"],
    ),
    (
        "list-for-string",
        '[hardware]\ndevices = ["cpu"]\n',
        "hardware.devices",
        ["expected a string"],
    ),
    ("negative-lr", "[train]\nlr = -0.1\n", "train.lr", ["greater than 0", "-0.1"]),
    ("batch-size-zero", "[data]\nbatch_size = 0\n", "data.batch_size", ["at least 1", "got 0"]),
    (
        "memory-fraction-above-one",
        "[hardware]\nmemory_fraction = 1.5\n",
        "hardware.memory_fraction",
        ["at most 1", "1.5"],
    ),
    (
        "warmup-beyond-max-steps",
        "[train]\nmax_steps = 10\nwarmup_steps = 20\n",
        "train.warmup_steps",
        ["train.max_steps", "20"],
    ),
    (
        "schedule-not-a-choice",
        '[train]\nschedule = "exp"\n',
        "train.schedule",
        ["'exp'", "cosine"],
    ),
    (
        "precision-not-a-choice",
        '[train]\nprecision = "fp8"\n',
        "train.precision",
        ["'fp8'", "bf16"],
    ),
    (
        "devices-malformed-in-file",
        '[hardware]\ndevices = "gpu0"\n',
        "hardware.devices",
        ["'gpu0'"],
    ),
    ("unknown-task-kind", '[task]\nkind = "cnn"\n', "task.kind", ["'cnn'", "mlp"]),
    ("task-kind-not-a-string", "[task]\nkind = 3\n", "task.kind", ["expected a string"]),
    (
        "task-module-missing",
        '[task]\nkind = "no_such_module_xyz.tasks:MyTask"\n',
        "task.kind",
        ["no_such_module_xyz"],
    ),
    (
        "mlp-wrong-key",
        '[task]\nkind = "mlp"\nhidden = 3\n',
        "task.hidden",
        ["unknown key", "hidden_dim"],
    ),
    (
        "transformer-heads-do-not-divide",
        '[task]\nkind = "transformer"\nd_model = 130\nn_heads = 4\n',
        "task.n_heads",
        ["task.d_model", "130"],
    ),
    (
        "distributed-env-owned-by-the-console",
        '[distributed]\nenv = { NCCL_DEBUG = "INFO", CUDA_VISIBLE_DEVICES = "0" }\n',
        "distributed.env.CUDA_VISIBLE_DEVICES",
        ["may not be set here", "--devices", "'0'"],
    ),
    (
        "distributed-env-bad-name",
        '[distributed]\nenv = { "MY-FLAG" = "x" }\n',
        "distributed.env.MY-FLAG",
        ["not an environment variable name", "'x'"],
    ),
    (
        "distributed-env-torchelastic",
        '[distributed]\nenv = { TORCHELASTIC_MAX_RESTARTS = "3" }\n',
        "distributed.env.TORCHELASTIC_MAX_RESTARTS",
        ["torchrun's own"],
    ),
    (
        "distributed-env-a-list",
        "[distributed]\nenv = { NCCL_DEBUG = [1] }\n",
        "distributed.env.NCCL_DEBUG",
        ["expected a string"],
    ),
    ("distributed-env-not-a-table", '[distributed]\nenv = "x"\n', "distributed.env", ["table"]),
    (
        "early-stop-patience-zero",
        '[train]\neval_every = 5\nearly_stop_metric = "eval.loss"\nearly_stop_patience = 0\n',
        "train.early_stop_patience",
        ["at least 1", "got 0"],
    ),
    (
        "early-stop-negative-min-delta",
        '[train]\neval_every = 5\nearly_stop_metric = "eval.loss"\nearly_stop_min_delta = -1\n',
        "train.early_stop_min_delta",
        ["at least 0", "got -1"],
    ),
    (
        "early-stop-without-evals",
        '[train]\nearly_stop_metric = "eval.loss"\n',
        "train.early_stop_metric",
        ["needs evals during the run", "'eval.loss'"],
    ),
    (
        "early-stop-metric-not-an-eval-metric",
        '[train]\neval_every = 5\nearly_stop_metric = "val_loss"\n',
        "train.early_stop_metric",
        ["expected eval.<metric>", "'val_loss'"],
    ),
    (
        "distributed-startup-timeout-zero",
        "[distributed]\nstartup_timeout_s = 0\n",
        "distributed.startup_timeout_s",
        ["greater than 0"],
    ),
]


@pytest.mark.parametrize(
    "text, key, extra", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_bad_profile_file(procs, runs_dir, tmp_path, text, key, extra):
    path = write_profile(tmp_path / "bad.toml", text)
    result = run_bad(procs, runs_dir, str(path))
    (line,) = assert_bad(result, runs_dir)
    assert line.startswith(f"gpu-console: {path}: "), line
    if key is not None:
        assert f": {key}: " in line, line
    for text_part in extra:
        assert text_part in line, line


def test_missing_profile_file(procs, runs_dir, tmp_path):
    path = tmp_path / "nothere.toml"
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir)
    assert line == f"gpu-console: {path}: no such profile file"


def test_unknown_profile_name(procs, runs_dir):
    (line,) = assert_bad(run_bad(procs, runs_dir, "nosuchprofile"), runs_dir)
    assert line.startswith("gpu-console: nosuchprofile: no such profile"), line
    assert "quickstart" in line, "the message should list the profiles there are"


def test_no_profile_and_no_resume(procs, runs_dir):
    (line,) = assert_bad(run_bad(procs, runs_dir), runs_dir)
    assert line.startswith("gpu-console: PROFILE: "), line


def test_several_problems_in_one_file_are_all_reported(procs, runs_dir, tmp_path):
    path = write_profile(
        tmp_path / "many.toml",
        '[train]\nlr = "fast"\nmax_steps = -1\n[data]\nbatch_size = -1\n[foo]\na = 1\n',
    )
    lines = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir, lines=4)
    prefix = f"gpu-console: {path}: "
    assert all(line.startswith(prefix) for line in lines), lines
    keys = {line[len(prefix) :].split(":", 1)[0] for line in lines}
    assert keys == {"train.lr", "train.max_steps", "data.batch_size", "foo"}


def test_file_and_set_problems_each_name_their_source(procs, runs_dir, tmp_path):
    path = write_profile(tmp_path / "bad.toml", "[train]\nmax_steps = -1\n")
    result = run_bad(procs, runs_dir, str(path), "--set", "data.batch_size=0")
    lines = assert_bad(result, runs_dir, lines=2)
    assert sorted(lines) == sorted(
        [
            f"gpu-console: {path}: train.max_steps: must be at least 0 (got -1)",
            "gpu-console: --set: data.batch_size: must be at least 1 (got 0)",
        ]
    )


# -- --set ------------------------------------------------------------------------------------

# (id, --set argument, section.key at fault or None, more text the message must contain)
SET_CASES = [
    ("no-equals", "train.lr", None, ["SECTION.KEY=VALUE", "'train.lr'"]),
    ("no-dot", "lr=3e-4", None, ["SECTION.KEY=VALUE", "'lr=3e-4'"]),
    ("unknown-key", "train.lrr=0.1", "train.lrr", ["unknown key", "did you mean 'lr'"]),
    ("unknown-section", "trian.lr=0.1", "trian", ["unknown section", "[train]"]),
    ("wrong-type", "train.lr=abc", "train.lr", ["expected a number", "'abc'"]),
    ("out-of-range", "data.batch_size=0", "data.batch_size", ["at least 1"]),
    ("bad-literal", 'train.schedule="exp"', "train.schedule", ["'exp'"]),
    ("bad-devices", "hardware.devices=gpu0", "hardware.devices", ["'gpu0'"]),
    ("unknown-task-key", "task.hidden=3", "task.hidden", ["hidden_dim"]),
    (
        "early-stop-accuracy-without-mode",
        "train.early_stop_metric=eval.accuracy",
        "train.early_stop_metric",
        ["needs train.early_stop_mode = min or max"],
    ),
    (
        "distributed-env-rank",
        "distributed.env.MASTER_PORT=29500",
        "distributed.env.MASTER_PORT",
        ["may not be set here", "torchrun"],
    ),
    (
        "distributed-env-gpu-console",
        "distributed.env.GPU_CONSOLE_X=1",
        "distributed.env.GPU_CONSOLE_X",
        ["the console's own"],
    ),
]


@pytest.mark.parametrize(
    "override, key, extra", [c[1:] for c in SET_CASES], ids=[c[0] for c in SET_CASES]
)
def test_bad_set(procs, runs_dir, override, key, extra):
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--set", override), runs_dir)
    assert line.startswith("gpu-console: --set: "), line
    if key is not None:
        assert line.startswith(f"gpu-console: --set: {key}: "), line
    for text_part in extra:
        assert text_part in line, line


# -- --devices and --precision ----------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, extra",
    [
        ("gpu0", ["'gpu0'"]),
        ("cpu:0", ["cpu:N", "'cpu:0'"]),
        ("cpu:two", ["cpu:N"]),
        ("0,0", ["twice"]),
        ("1,", ["'1,'"]),
    ],
    ids=["gpu0", "cpu0", "cpu-two", "duplicate", "trailing-comma"],
)
def test_bad_devices_syntax(procs, runs_dir, spec, extra):
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--devices", spec), runs_dir)
    assert line.startswith("gpu-console: --devices: "), line
    for text_part in extra:
        assert text_part in line, line


def _gpus_visible() -> int:
    """GPUs the CLI sees: none (conftest pins NVML to no driver), unless rehearsed."""
    return REHEARSED_GPUS


NO_SOURCE = (
    "launch.prepare reports devices/precision problems found after loading (no GPU visible, "
    "fp16 on CPU) as bare 'hardware.devices: ...'/'train.precision: ...', without naming "
    "the flag or profile file they came from"
)


def test_gpu_index_without_any_gpu(procs, runs_dir):
    if _gpus_visible():
        pytest.skip("a GPU is visible here")
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--devices", "0"), runs_dir)
    assert "no GPU is visible" in line, line
    assert line.startswith("gpu-console: --devices: "), line


def test_gpu_index_without_any_gpu_says_so(procs, runs_dir):
    """The half of the contract that holds today: exit 2 and 'no GPU is visible'."""
    if _gpus_visible():
        pytest.skip("a GPU is visible here")
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--devices", "0"), runs_dir)
    assert "no GPU is visible" in line, line
    assert "hardware.devices" in line, line


def test_gpu_index_in_profile_without_any_gpu(procs, runs_dir, tmp_path):
    if _gpus_visible():
        pytest.skip("a GPU is visible here")
    path = write_profile(tmp_path / "gpu.toml", '[hardware]\ndevices = "0"\n')
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir)
    assert line.startswith(f"gpu-console: {path}: hardware.devices: "), line
    assert "no GPU is visible" in line, line


def test_bad_precision_flag(procs, runs_dir):
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--precision", "fp8"), runs_dir)
    assert line.startswith("gpu-console: --precision: "), line
    assert "'fp8'" in line and "bf16" in line, line


def test_fp16_flag_on_cpu(procs, runs_dir):
    result = run_bad(procs, runs_dir, "quickstart", "--devices", "cpu:2", "--precision", "fp16")
    (line,) = assert_bad(result, runs_dir)
    assert line.startswith("gpu-console: --precision: "), line
    assert "fp16" in line, line


def test_fp16_on_cpu_is_refused(procs, runs_dir, tmp_path):
    """The half of the contract that holds today: exit 2 and a line naming the key."""
    path = write_profile(
        tmp_path / "half.toml", '[train]\nprecision = "fp16"\n[hardware]\ndevices = "cpu:2"\n'
    )
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir)
    assert "train.precision" in line and "fp16" in line, line


def test_fp16_in_profile_on_cpu_names_the_file(procs, runs_dir, tmp_path):
    path = write_profile(
        tmp_path / "half.toml", '[train]\nprecision = "fp16"\n[hardware]\ndevices = "cpu:2"\n'
    )
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir)
    assert line.startswith(f"gpu-console: {path}: train.precision: "), line


# -- --resume ---------------------------------------------------------------------------------


def hand_made_run(folder: Path, name: str = "hand-20240101-000000") -> Path:
    """A run directory with run.toml but no complete checkpoint."""
    run = folder / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.toml").write_text('[profile]\nname = "hand"\n')
    return run


def test_resume_of_a_run_that_does_not_exist(procs, runs_dir):
    (line,) = assert_bad(run_bad(procs, runs_dir, "--resume", "ghost"), runs_dir)
    assert line.startswith("gpu-console: --resume: ghost: "), line
    assert "no such run" in line, line


def test_resume_of_a_run_dir_without_checkpoint(procs, runs_dir, tmp_path):
    run = hand_made_run(tmp_path / "elsewhere")
    (line,) = assert_bad(run_bad(procs, runs_dir, "--resume", str(run)), runs_dir)
    assert line.startswith(f"gpu-console: --resume: {run}: "), line
    assert "no complete checkpoint" in line, line


def test_resume_by_name_without_checkpoint(procs, runs_dir):
    run = hand_made_run(runs_dir)
    result = run_bad(procs, runs_dir, "--resume", run.name)
    (line,) = assert_bad(result, runs_dir, existing=[run])
    assert line.startswith("gpu-console: --resume: "), line
    assert run.name in line and "no complete checkpoint" in line, line


def test_resume_with_latest_naming_an_incomplete_checkpoint(procs, runs_dir, tmp_path):
    run = hand_made_run(tmp_path / "elsewhere")
    (run / "checkpoints" / "step-00000010").mkdir()  # no meta.json: never completed
    (run / "checkpoints" / "LATEST").write_text("step-00000010\n")
    (line,) = assert_bad(run_bad(procs, runs_dir, "--resume", str(run)), runs_dir)
    assert line.startswith("gpu-console: --resume: "), line
    assert "no complete checkpoint" in line, line


# -- user tasks by import path (these import the user's module in a subprocess) ---------------


def test_task_class_missing_from_module(procs, runs_dir, tmp_path):
    (tmp_path / "mytasks.py").write_text("class Other:\n    pass\n")
    path = write_profile(tmp_path / "user.toml", '[task]\nkind = "mytasks:MyTask"\n')
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path), cwd=tmp_path), runs_dir)
    assert line.startswith(f"gpu-console: {path}: task.kind: "), line
    assert "'MyTask'" in line and "mytasks" in line, line


def test_task_class_that_is_not_a_task(procs, runs_dir, tmp_path):
    (tmp_path / "mytasks.py").write_text("class MyTask:\n    pass\n")
    path = write_profile(tmp_path / "user.toml", '[task]\nkind = "mytasks:MyTask"\n')
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path), cwd=tmp_path), runs_dir)
    assert line.startswith(f"gpu-console: {path}: task.kind: "), line
    assert "build_model" in line, line


def test_task_module_that_raises_on_import(procs, runs_dir, tmp_path):
    (tmp_path / "mytasks.py").write_text("raise RuntimeError('broken on purpose')\n")
    path = write_profile(tmp_path / "user.toml", '[task]\nkind = "mytasks:MyTask"\n')
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path), cwd=tmp_path), runs_dir)
    assert line.startswith(f"gpu-console: {path}: task.kind: "), line
    assert "broken on purpose" in line, line


# -- the runs directory -----------------------------------------------------------------------


def test_runs_dir_is_a_file(procs, tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a directory\n")
    result = procs.cli(
        "run", "quickstart", "--headless", "--runs-dir", str(blocker), timeout=TIMEOUT_S
    )
    both = result.stdout + result.stderr
    assert result.returncode == 2, both
    assert "Traceback" not in both, both
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpu-console: {blocker}: "), both
    assert blocker.read_text() == "not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_runs_dir_not_writable(procs, runs_dir):
    runs_dir.mkdir()
    runs_dir.chmod(0o500)
    try:
        # Root writes through chmod 0500: the CLI runs without that power (conftest).
        result = procs.cli(
            "run", "quickstart", "--headless", "--runs-dir", str(runs_dir),
            timeout=TIMEOUT_S, prefix=unprivileged(),
        )  # fmt: skip
        (line,) = assert_bad(result, runs_dir)
        assert line.startswith(f"gpu-console: {runs_dir}: "), line
        assert "not writable" in line, line
        assert list(runs_dir.iterdir()) == []
    finally:
        runs_dir.chmod(0o700)


def _resumable(folder: Path, name: str = "real-20240101-000000") -> Path:
    """A run directory that looks complete: run.toml, a complete checkpoint at step 10."""
    run = hand_made_run(folder, name)
    ckpt = run / "checkpoints" / "step-00000010"
    ckpt.mkdir()
    with zipfile.ZipFile(ckpt / "state.pt", "w"):  # a whole (empty) torch file, as far as
        pass  # the launch can tell without torch
    (ckpt / "meta.json").write_text('{"step": 10}')
    (run / "checkpoints" / "LATEST").write_text("step-00000010\n")
    return run


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# (id, how RUN is spelled given tmp_path and a complete-looking run, what the line says)
RESUME_SPELLINGS = [
    ("name-with-a-slash", lambda tmp, run: "ghost/run", "ghost/run: no such run directory"),
    ("absolute-missing", lambda tmp, run: str(tmp / "nowhere"), "nowhere: no such run directory"),
    ("a-file", lambda tmp, run: "notes.txt", "notes.txt: a file, not a run directory"),
    ("dot-dot", lambda tmp, run: "..", "..: not a run directory (no run.toml in it)"),
    ("empty", lambda tmp, run: "", "'': no such run (an empty name)"),
    ("unknown-user", lambda tmp, run: "~no-such-user-xyz/run", "no such run directory"),
    (
        "checkpoint-dir",
        lambda tmp, run: str(run / "checkpoints" / "step-00000010"),
        "a checkpoint, not a run: give its run, ",
    ),
    (
        "glob-characters",
        lambda tmp, run: "real[",
        "real[: no such run (looked for a directory and under ",
    ),
]


@pytest.mark.parametrize(
    "spell, says", [c[1:] for c in RESUME_SPELLINGS], ids=[c[0] for c in RESUME_SPELLINGS]
)
def test_resume_spellings_of_no_run(procs, runs_dir, tmp_path, spell, says):
    run = _resumable(runs_dir)
    (tmp_path / "notes.txt").write_text("not a run\n")
    before = _files(tmp_path)
    result = run_bad(procs, runs_dir, "--resume", spell(tmp_path, run), cwd=tmp_path)
    (line,) = assert_bad(result, runs_dir, existing=[run])
    assert line.startswith("gpu-console: --resume: "), line
    assert says in line, line
    assert _files(tmp_path) == before


@pytest.mark.parametrize(
    "status, says",
    [
        ("{not json", "status.json: cannot be read (not valid JSON)"),
        ("[1, 2]", "status.json: not a JSON object"),
    ],
    ids=["corrupt", "a-list"],
)
def test_resume_of_a_run_whose_status_cannot_be_read(procs, runs_dir, tmp_path, status, says):
    run = _resumable(runs_dir)
    (run / "status.json").write_text(status)
    before = _files(tmp_path)
    (line,) = assert_bad(run_bad(procs, runs_dir, "--resume", run.name), runs_dir, existing=[run])
    assert line.startswith(f"gpu-console: --resume: {run}/status.json: "), line
    assert says in line and "cannot tell whether the run is still live" in line, line
    assert _files(tmp_path) == before


def test_resume_of_a_checkpoint_without_its_step(procs, runs_dir, tmp_path):
    run = _resumable(runs_dir)
    (run / "checkpoints" / "step-00000010" / "meta.json").write_text("{}")
    before = _files(tmp_path)
    (line,) = assert_bad(run_bad(procs, runs_dir, "--resume", run.name), runs_dir, existing=[run])
    assert line == (
        f"gpu-console: --resume: {run}/checkpoints/step-00000010/meta.json: no step in it "
        "(got None)"
    ), line
    assert _files(tmp_path) == before


# -- what a launch can check before writing anything (issue 25) ---------------------------------


@pytest.mark.parametrize("dry", [False, True], ids=["launch", "dry-run"])
def test_more_cpu_ranks_than_cores_is_refused_naming_the_override(procs, runs_dir, dry):
    cores = len(os.sched_getaffinity(0))
    args = ["quickstart", "--devices", f"cpu:{cores + 1}", *(["--dry-run"] if dry else [])]
    (line,) = assert_bad(run_bad(procs, runs_dir, *args), runs_dir)
    assert line == (
        f"gpu-console: --devices: hardware.devices: {cores + 1} CPU ranks on {cores} usable "
        f"cores; use cpu:{cores} or fewer, or set hardware.oversubscribe = true to run more "
        f"ranks than cores on purpose (got 'cpu:{cores + 1}')"
    )


def test_more_cpu_ranks_than_cores_in_a_profile_names_the_file(procs, runs_dir, tmp_path):
    path = write_profile(tmp_path / "many.toml", '[hardware]\ndevices = "cpu:999"\n')
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path)), runs_dir)
    assert line.startswith(f"gpu-console: {path}: hardware.devices: 999 CPU ranks on "), line


def test_oversubscribing_on_purpose_is_accepted(procs, runs_dir):
    cores = len(os.sched_getaffinity(0))
    result = procs.cli(
        "run", "quickstart", "--dry-run", "--devices", f"cpu:{cores + 1}",
        "--set", "hardware.oversubscribe=true", "--runs-dir", str(runs_dir),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{cores + 1} × cpu" in result.stdout
    assert not runs_dir.exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=inf", "train.lr"),
        ("train.weight_decay=nan", "train.weight_decay"),
        ("train.clip_grad_norm=-inf", "train.clip_grad_norm"),
        ("train.betas=[0.9, nan]", "train.betas"),
        ("task.noise=inf", "task.noise"),
    ],
)
def test_a_number_that_is_not_finite_is_refused(procs, runs_dir, override, key):
    (line,) = assert_bad(run_bad(procs, runs_dir, "quickstart", "--set", override), runs_dir)
    assert line.startswith(f"gpu-console: --set: {key}: expected "), line
    assert "finite" in line, line


@pytest.mark.parametrize("dry", [False, True], ids=["launch", "dry-run"])
def test_a_batch_larger_than_the_data_set_is_refused_before_launch(procs, runs_dir, dry):
    args = ["quickstart", "--devices", "cpu:2", "--set", "data.batch_size=1000000000"]
    (line,) = assert_bad(run_bad(procs, runs_dir, *args, *(["--dry-run"] if dry else [])), runs_dir)
    assert line == (
        "gpu-console: --set: data.batch_size: 32768 samples over 2 ranks is less than one batch "
        "(got 1000000000)"
    )


def test_a_user_tasks_data_set_smaller_than_a_batch_per_rank_is_refused(procs, runs_dir, tmp_path):
    """A user task's data set is built before launch (a subprocess): 40 samples, 2 ranks of
    32 each cannot take one batch."""
    (tmp_path / "tiny.py").write_text(
        "from gpu_console.tasks.mlp import MLPTask\nclass Tiny(MLPTask):\n    pass\n"
    )
    path = write_profile(
        tmp_path / "tiny.toml",
        '[task]\nkind = "tiny:Tiny"\ntrain_samples = 40\n[data]\nbatch_size = 32\n'
        '[hardware]\ndevices = "cpu:2"\n',
    )
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path), cwd=tmp_path), runs_dir)
    assert line == (
        f"gpu-console: {path}: data.batch_size: 40 samples over 2 ranks is less than one batch "
        "(got 32)"
    )


def test_a_profile_path_that_is_a_directory_says_so(procs, runs_dir, tmp_path):
    (tmp_path / "prof.toml").mkdir()
    (line,) = assert_bad(run_bad(procs, runs_dir, str(tmp_path / "prof.toml")), runs_dir)
    assert line == f"gpu-console: {tmp_path / 'prof.toml'}: a directory, not a profile file"


def test_a_profile_with_a_byte_order_mark_is_read(procs, runs_dir, tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'[profile]\nname = "bom"\n[hardware]\ndevices = "cpu:1"\n')
    result = procs.cli("run", str(path), "--dry-run", "--runs-dir", str(runs_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("dry run of bom: nothing was written"), result.stdout


def test_a_syntax_error_in_a_task_module_names_its_file_and_line(procs, runs_dir, tmp_path):
    (tmp_path / "mytasks.py").write_text("import math\n\ndef broken(:\n    pass\n")
    path = write_profile(tmp_path / "user.toml", '[task]\nkind = "mytasks:MyTask"\n')
    (line,) = assert_bad(run_bad(procs, runs_dir, str(path), cwd=tmp_path), runs_dir)
    assert line.startswith(f"gpu-console: {path}: task.kind: {tmp_path / 'mytasks.py'}:3: "), line
    assert line.endswith("(got 'mytasks:MyTask')"), line


def test_a_unicode_run_name_keeps_its_letters(procs, runs_dir):
    result = procs.cli(
        "run", "quickstart", "--dry-run", "--json", "--devices", "cpu:1",
        "--name", "ünïcødé run", "--runs-dir", str(runs_dir),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(result.stdout)
    assert Path(plan["run_dir"]).name.startswith("ünïcødé-run-"), plan["run_dir"]


def test_a_damaged_run_toml_on_resume_is_one_line(procs, runs_dir, tmp_path):
    run = _resumable(runs_dir)
    # A whole run.toml cut short: what is left parses, but most of its tables are gone.
    (run / "run.toml").write_text('[profile]\nname = "real"\n\n[task]\nkind = "mlp"\n')
    before = _files(tmp_path)
    (line,) = assert_bad(run_bad(procs, runs_dir, "--resume", run.name), runs_dir, existing=[run])
    assert line == (
        f"gpu-console: --resume: {run}/run.toml is damaged (no [data], [train], [distributed], "
        "[checkpoint], [hardware] tables); restore it from a backup, or start a new run"
    )
    assert _files(tmp_path) == before
