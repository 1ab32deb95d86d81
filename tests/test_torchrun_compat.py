"""Launch passes torchrun only what the installed torchrun accepts, and a torchrun failure is
named in one line, whoever failed.

The argv tests parse the exact command line launch builds with the installed torchrun's own
parser, so a flag some torch lacks fails here on that torch. The failure tests provoke real
failures through real processes: torchrun rejecting a flag, a rank whose engine cannot be
imported, a supervisor that cannot start torchrun, a supervisor that crashes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fast_profile, only_run, read_status, wait_for
from conftest import test_env as cli_env

from gpu_console import launch, torchrun
from gpu_console.devices import Placement
from gpu_console.profile import load_profile

get_args_parser = pytest.importorskip("torch.distributed.run").get_args_parser


def installed_options() -> dict[str, list[str]]:
    return {a.dest: list(a.option_strings) for a in get_args_parser()._actions if a.option_strings}


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch) -> Path:
    """Each test's detection cache lives under its tmp_path (never the user's ~/.cache)."""
    home = tmp_path / "cache-home"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def flat(table: str) -> str:
    """The headless summary's text, without the table's borders and line wrapping."""
    return " ".join(table.replace("│", " ").split())


def seed_cache(options: dict[str, list[str]]) -> Path:
    """What the detection would have cached for this torch: the seam a CLI subprocess reads."""
    identity = torchrun.torch_identity()
    path = torchrun._cache_file(identity)
    torchrun._write_cache(path, identity, options)
    assert path.is_file()
    return path


# -- the argv launch builds, parsed by the installed torchrun --------------------------------

VARIANTS = {
    "one node, defaults": ([], Placement("cpu", 2), None),
    "one node, every knob": (
        ["distributed.max_restarts=3", "distributed.shutdown_grace_s=2.5"],
        Placement("cuda", 4, "0,1,2,3"),
        None,
    ),
    "elastic nodes with a rank": (
        ["distributed.max_restarts=1"],
        Placement("cpu", 2),
        launch.Nodes("2:4", 1, "head:29400"),
    ),
    "nodes without a rank": (
        [],
        Placement("cuda", 8, "0,1,2,3,4,5,6,7"),
        launch.Nodes("2", None, "10.0.0.1:29500"),
    ),
}


@pytest.mark.torch_floor
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_the_argv_launch_builds_parses_with_the_installed_torchruns_parser(tmp_path, variant):
    sets, placement, nodes = VARIANTS[variant]
    profile = load_profile(str(fast_profile(tmp_path)), sets)
    run_dir = tmp_path / "runs" / "fast-20260101-000000"
    argv = launch.torchrun_argv(run_dir, profile, placement, nodes)
    # torchrun itself, run by quick_exit (no interpreter teardown at its end)
    assert argv[:4] == [sys.executable, "-m", "gpu_console.quick_exit", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[4:])  # an unknown flag: SystemExit(2), a failure
    assert args.module and args.training_script == "gpu_console.engine"
    assert args.training_script_args == [str(run_dir)]
    assert args.nproc_per_node == str(placement.nproc)
    assert args.max_restarts == profile.distributed.max_restarts
    assert args.rdzv_backend == "c10d" and args.log_dir == str(run_dir / "logs")
    # SIGUSR1 is the supervisor's and the ranks': torchrun holds it (held_signals.py)
    assert "SIGTERM" in args.signals_to_handle and "SIGUSR1" not in args.signals_to_handle
    if nodes is None:
        assert args.nnodes == "1" and args.rdzv_endpoint == "127.0.0.1:0"
        assert args.rdzv_id == run_dir.name
    else:
        assert args.nnodes == nodes.nnodes and args.rdzv_endpoint == nodes.endpoint
        assert args.node_rank == (nodes.node_rank or 0)
    if "shutdown_timeout" in installed_options():
        assert args.shutdown_timeout == int(profile.distributed.shutdown_grace_s + 0.999)
        assert launch.torchrun_compat()["dropped"] == {}
    else:  # torch 2.11: the supervisor holds the grace instead
        assert not [a for a in argv if a.startswith("--shutdown")]
        assert "--shutdown-timeout" in launch.torchrun_compat()["dropped"]


def test_a_torchrun_without_shutdown_timeout_gets_an_argv_without_it(tmp_path, monkeypatch):
    options = installed_options()
    options.pop("shutdown_timeout", None)
    monkeypatch.setattr(torchrun, "accepted_options", lambda: torchrun.Options(options))
    profile = load_profile(str(fast_profile(tmp_path)))
    argv = launch.torchrun_argv(tmp_path / "r", profile, Placement("cpu", 2))
    assert not [a for a in argv if "shutdown" in a]
    get_args_parser().parse_args(argv[4:])
    dropped = launch.torchrun_compat()["dropped"]
    assert list(dropped) == ["--shutdown-timeout"] and "supervisor" in dropped["--shutdown-timeout"]


def test_a_flag_is_written_as_the_parser_prefers_it():
    both = torchrun.Options({"nproc_per_node": ["--nproc_per_node", "--nproc-per-node"]})
    assert both.flag("nproc_per_node", "--x") == "--nproc-per-node"
    old = torchrun.Options({"nproc_per_node": ["--nproc_per_node"]})
    assert old.flag("nproc_per_node", "--x") == "--nproc_per_node"
    assert old.flag("shutdown_timeout", "--x") is None
    # Parser unreachable: every flag as written; torchrun's own error will name a bad one.
    assert torchrun.Options(error="no torch").flag("shutdown_timeout", "--x") == "--x"


def test_a_flag_no_fallback_covers_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    options = installed_options()
    options.pop("log_dir")
    monkeypatch.setattr(torchrun, "accepted_options", lambda: torchrun.Options(options))
    profile = load_profile(str(fast_profile(tmp_path)))
    with pytest.raises(launch.LaunchError, match="has no --log-dir"):
        launch.torchrun_argv(tmp_path / "r", profile, Placement("cpu", 2))


# -- the detection and its cache ---------------------------------------------------------------


def test_the_parser_is_asked_once_per_installed_torch(cache_home, monkeypatch):
    asked = []
    real = torchrun.ask_parser
    monkeypatch.setattr(torchrun, "ask_parser", lambda: asked.append(1) or real())
    first = torchrun.accepted_options()
    assert first.spellings == installed_options() and not first.error and asked == [1]
    assert len(list((cache_home / "gpu-console").glob("torchrun-options-*.json"))) == 1
    assert torchrun.accepted_options() == first and asked == [1]  # from the cache
    # Another torch installed in its place: its own answer.
    identity = torchrun.torch_identity()
    monkeypatch.setattr(torchrun, "torch_identity", lambda: {**identity, "mtime_ns": 1})
    assert torchrun.accepted_options() == first and asked == [1, 1]


def test_a_broken_or_unwritable_cache_never_fails_a_launch(cache_home, tmp_path, monkeypatch):
    path = seed_cache({"nproc_per_node": ["--nproc-per-node"]})
    path.write_text('{"identity": ')  # torn
    assert torchrun.accepted_options().spellings == installed_options()
    assert json.loads(path.read_text())["options"] == installed_options()  # rewritten whole
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cache dir cannot be made
    assert torchrun.accepted_options().spellings == installed_options()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    broken = torchrun.accepted_options()
    assert broken.error.startswith("cannot ask torchrun's parser")
    assert broken.flag("shutdown_timeout", "--shutdown-timeout") == "--shutdown-timeout"


# -- a failure says why, whoever failed --------------------------------------------------------


def test_torchrun_rejecting_a_flag_is_named_everywhere(procs, runs_dir, tmp_path):
    options = installed_options()
    options["monitor_interval"] = ["--no-such-flag"]
    seed_cache(options)
    console = procs.cli(
        "run", str(fast_profile(tmp_path)), "--headless", "--runs-dir", str(runs_dir),
        env=cli_env(XDG_CACHE_HOME=os.environ["XDG_CACHE_HOME"]),
    )  # fmt: skip
    assert console.returncode == 1, console.stdout + console.stderr
    run = only_run(runs_dir)
    assert "--no-such-flag=0.1" in json.loads((run / "meta.json").read_text())["torchrun"]
    expected = "torchrun: error: unrecognized arguments: --no-such-flag=0.1"
    status = read_status(run)
    assert status["state"] == "failed" and status["reason"] == expected
    assert status["failure"]["summary"] == expected and status["failure"]["rank"] is None
    assert status["failure"]["source"] == "torchrun" and status["failure"]["exit_code"] == 2
    assert expected in flat(console.stdout)
    ls = procs.cli("ls", "--json", "--runs-dir", str(runs_dir))
    assert [r["reason"] for r in json.loads(ls.stdout)] == [expected]
    from gpu_console.tui.widgets.failure import failure_text

    panel = failure_text(status["failure"], status["reason"]).plain
    assert "torchrun  exit code 2" in panel and expected in panel and "rank ?" not in panel
    assert "logs/torchrun.log" in panel


BREAK_THE_ENGINE = """
import os
import sys

if "LOCAL_RANK" in os.environ:  # a rank, not the console, supervisor or torchrun
    sys.modules["gpu_console.engine.heartbeat"] = None
"""


def test_a_rank_whose_engine_cannot_be_imported_says_why(procs, runs_dir, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BREAK_THE_ENGINE)
    env = cli_env(PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    console = procs.cli(
        "run", str(fast_profile(tmp_path)), "--headless", "--runs-dir", str(runs_dir), env=env
    )
    assert console.returncode == 1, console.stdout + console.stderr
    failure = read_status(only_run(runs_dir))["failure"]
    why = "ModuleNotFoundError: import of gpu_console.engine.heartbeat halted; None in sys.modules"
    assert failure["rank"] in (0, 1) and failure["exit_code"] == 1
    assert failure["summary"] == f"rank {failure['rank']} exited with code 1: {why}"
    assert failure["traceback"].startswith("Traceback (") and why in failure["traceback"]
    assert why in flat(console.stdout)


def _run_dir_by_hand(tmp_path: Path, meta: dict, with_profile: bool = True) -> Path:
    run = tmp_path / "runs" / "hand-20260101-000000"
    (run / "logs").mkdir(parents=True)
    if with_profile:
        (run / "run.toml").write_text("[distributed]\nshutdown_grace_s = 3.0\n")
    (run / "meta.json").write_text(json.dumps(meta))
    return run


def _supervise(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_console.supervisor", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )


def test_a_supervisor_that_cannot_start_torchrun_says_so(tmp_path):
    missing = tmp_path / "no-such-python"
    run = _run_dir_by_hand(tmp_path, {"torchrun": [str(missing), "-m", "torch.distributed.run"]})
    assert _supervise(run).returncode == 1
    status = read_status(run)
    expected = (
        "supervisor: cannot start torchrun: "
        f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'"
    )
    assert status["state"] == "failed" and status["exit_code"] == 1 and status.get("ended")
    assert status["reason"] == expected and status["failure"]["summary"] == expected
    assert status["failure"]["source"] == "supervisor"


def test_a_crashing_supervisor_leaves_a_failed_status_that_says_why(tmp_path):
    run = _run_dir_by_hand(tmp_path, {"torchrun": ["true"]}, with_profile=False)
    proc = _supervise(run)
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    status = wait_for(lambda: read_status(run), 5, "status.json")
    assert status["state"] == "failed" and status["exit_code"] == 1
    assert status["reason"].startswith("supervisor: crashed: FileNotFoundError: ")
    assert "run.toml" in status["reason"] and "\n" not in status["reason"]
    assert "Traceback" in status["failure"]["traceback"]


def test_a_rendezvous_error_is_torchruns_last_exception_not_a_ranks(tmp_path):
    # torchrun.log as torchrun writes it: its ranks' lines (--tee) prefixed, its own bare.
    # (Provoked for real it takes torchrun's 60-90 s connect timeout, too long for a test.)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "torchrun.log").write_text(
        "[default0]:Traceback (most recent call last):\n"
        '[default0]:  File "x.py", line 1, in <module>\n'
        "[default0]:RuntimeError: not this one\n"
        "Traceback (most recent call last):\n"
        '  File "/site-packages/torch/distributed/run.py", line 936, in main\n'
        "    run(args)\n"
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to "
        "the C10d store has failed. See inner exception for details.\n"
    )
    from gpu_console import supervisor

    failure = supervisor.failure_summary(tmp_path, 1)
    assert failure["rank"] is None and failure["source"] == "torchrun"
    assert failure["summary"] == (
        "torchrun: RendezvousConnectionError: The connection to the C10d store has failed. "
        "See inner exception for details."
    )


def test_check_says_which_flags_this_torchrun_lacks_and_who_does_their_job(monkeypatch):
    from gpu_console.commands import check

    row = check._torchrun_flags_check()
    if "shutdown_timeout" in installed_options():  # torch 2.13
        assert row == check.Check(
            "torchrun flags", check.PASS, "every flag a launch passes is accepted"
        )
    else:  # torch 2.11
        assert row.detail.startswith("this torchrun lacks --shutdown-timeout: the supervisor")
    options = {k: v for k, v in installed_options().items() if k != "shutdown_timeout"}
    monkeypatch.setattr(torchrun, "accepted_options", lambda: torchrun.Options(options))
    row = check._torchrun_flags_check()
    assert row.status == check.PASS
    assert row.detail.startswith("this torchrun lacks --shutdown-timeout: the supervisor")
    monkeypatch.setattr(torchrun, "accepted_options", lambda: torchrun.Options({}, "no torch"))
    assert check._torchrun_flags_check() == check.Check(
        "torchrun flags", check.WARN, "cannot ask torchrun: no torch"
    )
