"""Shared test helpers: run the real CLI, wait on what we expect, clean up by pid.

Every process a test starts is recorded and ended by its pid at teardown (with the
supervisor's whole tree, read from status.json); every run directory lives under
``tmp_path``. Waiting is always on a condition with a generous deadline, never a sleep.

Every test sees a machine without GPUs (:func:`no_gpu_machine`): the default suite passes the
same on a laptop, in CI and on a GPU node. Tests marked ``gpu`` and tests that take the
``real_machine`` fixture see the machine as it is.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


# A deadline is a ceiling for a machine in trouble, never a sleep: a test that meets it on a
# quiet machine must meet it on a busy one too. So every test deadline is given as the
# seconds it allows on a quiet machine and stretched by slowdown(): how much slower than on
# a quiet CI machine the suite's work runs here now.
REFERENCE_WORK_S = 0.075  # _reference_work() on a quiet core of the 2-core CI machine (2026-11)
SLOWDOWN_ENV = "GPU_CONSOLE_TEST_SLOWDOWN"
_slowdown: float | None = None


def _reference_work() -> float:
    started = time.perf_counter()
    x = 0
    for i in range(1_000_000):
        x += i * i % 7
    return time.perf_counter() - started


def _busy_cores(window_s: float = 0.5) -> float:
    """Cores busy with other work over ``window_s`` while this process sleeps (/proc/stat)."""

    def busy() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle, iowait
        return sum(ticks) - idle, sum(ticks)

    try:
        b0, t0 = busy()
        time.sleep(window_s)
        b1, t1 = busy()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


def measure_slowdown(workers: int) -> float:
    """The larger of two readings, never below 1: a fixed piece of pure-Python work timed
    (the median of seven) against a quiet CI core's, which sees a slower machine and some of
    the load; and the share of the cores the suite's ``workers`` get beside the other work
    busy on them now (/proc/stat; not the load average, which still counts work that ended
    a minute ago), which a short timing misses (a process that just woke runs first)."""
    timed = sorted(_reference_work() for _ in range(7))[3] / REFERENCE_WORK_S
    cores = len(os.sched_getaffinity(0))
    shared = (_busy_cores() + workers) / cores
    return max(1.0, timed, shared)


def slowdown() -> float:
    """This session's factor: ``GPU_CONSOLE_TEST_SLOWDOWN`` where set (pytest's first
    process sets it for its workers: :func:`pytest_configure`), else measured here."""
    global _slowdown
    if _slowdown is None:
        given = os.environ.get(SLOWDOWN_ENV)
        _slowdown = max(1.0, float(given)) if given else measure_slowdown(1)
        os.environ[SLOWDOWN_ENV] = f"{_slowdown:.2f}"
    return _slowdown


def deadline(seconds: float) -> float:
    """A test's deadline of ``seconds`` on a quiet machine, stretched for this one now."""
    return seconds * slowdown()


def pytest_configure(config):
    """Measured once a session, by pytest's first process before its workers start (they
    inherit the environment) and before any test loads the machine."""
    if os.environ.get(SLOWDOWN_ENV) or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    n = getattr(config.option, "numprocesses", None)
    workers = n if isinstance(n, int) and n > 0 else 1
    global _slowdown
    _slowdown = measure_slowdown(workers)
    os.environ[SLOWDOWN_ENV] = f"{_slowdown:.2f}"


DEADLINE_S = 120.0  # the default wait on a quiet machine (wait_for and Procs.cli stretch it)
PER_TEST_TIMEOUT_S = 300.0  # pytest-timeout's, on a quiet machine (pyproject.toml's timeout)
# The environment as the test run found it, before any test pinned it (see no_gpu_machine).
MACHINE_ENV = dict(os.environ)
# What NVML shows the processes a test starts (tests/nvml_run_fake.py `machine`, through the
# GPU_CONSOLE_FAKE_NVML seam): no driver, unless GPU_CONSOLE_TEST_GPUS=N rehearses a GPU
# machine on one without (N fake GPUs).
REHEARSED_GPUS = int(os.environ.get("GPU_CONSOLE_TEST_GPUS") or 0)
TESTS = Path(__file__).resolve().parent
MACHINE_FAKE = "nvml_run_fake:machine"
# The suite runs as two workers on the machine's cores (-n 2): every engine a test runs, in
# a worker (the harness) or in the ranks it starts, takes one thread, as torchrun gives each
# of two ranks; a core a thread, not four threads on two cores. A thread count set by hand
# stands (launch.worker_env keeps it, as it keeps a user's).
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The modules that take longest, dealt first (scripts/heaviest_modules.py prints this from a
# full run's --durations=0; measured 2026-11-29): under --dist loadscope a module is one
# worker's unit, and xdist otherwise deals modules by their number of tests, so a long module
# of few tests (the real SLURM's) came last and one worker ended the suite alone.
HEAVIEST_FIRST = (
    "tests/test_slurm_real.py",
    "tests/test_sweep.py",  # 206 s of real sweeps (measured 2026-11-29, the faster machine)
    "tests/test_slurm.py",
    "tests/test_survive_signals.py",
    "tests/test_multinode.py",
    "tests/test_tensorboard.py",
    "tests/test_resume_in_place.py",
    "tests/test_control.py",
    "tests/test_stall_real_run.py",
    "tests/test_timeouts.py",
    "tests/test_bad_input.py",
    "tests/test_wandb.py",
    "tests/test_engine.py",
)


def heaviest_first(items: list) -> None:
    """Reorder ``items`` in place: HEAVIEST_FIRST's modules first, in its order; the rest
    after them as collected (pyproject.toml's --no-loadscope-reorder keeps this order)."""
    rank = {module: i for i, module in enumerate(HEAVIEST_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}

    def key(item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        return (rank.get(module, len(rank)), order[id(item)])

    items.sort(key=key)


def pytest_collection_modifyitems(config, items):
    """The heaviest modules first (:func:`heaviest_first`); pytest-timeout's limit per test
    (pyproject.toml's, on a quiet machine) stretched as every deadline is; a test's own
    ``timeout`` marker likewise."""
    heaviest_first(items)
    for item in items:
        own = item.get_closest_marker("timeout")
        seconds = own.args[0] if own and own.args else config.getini("timeout") or 0
        if float(seconds) > 0:
            item.add_marker(pytest.mark.timeout(deadline(float(seconds))))


@pytest.fixture(autouse=True)
def stretched_screen_wait(monkeypatch):
    """Textual's Pilot waits up to 30 s for a screen to settle at each press and pause,
    then fails the test (WaitForScreenTimeout): on a busy machine, the same wait stretched
    as every deadline is. Only where a test module imported Textual."""
    pilot = sys.modules.get("textual.pilot")
    if pilot is None:
        return
    wait = pilot.Pilot._wait_for_screen

    async def stretched(self, timeout: float = 30.0) -> bool:
        return await wait(self, deadline(timeout))

    monkeypatch.setattr(pilot.Pilot, "_wait_for_screen", stretched)


@pytest.fixture(autouse=True, scope="session")
def own_cache_dir(tmp_path_factory):
    """The suite's caches (torchrun's accepted flags) live under its temporary folder, never
    in the user's ~/.cache; one folder for the session, so each torch is asked once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def engine_zygote():
    """The zygote tests/harness.py forks two-rank engines from, if a test started one, ends
    with the session (by its pid, waited for)."""
    yield
    harness = sys.modules.get("harness")
    if harness is not None:
        harness.close_zygote()


@pytest.fixture(autouse=True)
def no_gpu_machine(request, monkeypatch):
    """Pin what a test can see of the hardware: no GPU, whatever the machine has.

    In this process, NVML is the fake at the ``gpu_console.telemetry.nvml`` seam with no driver
    (what CI sees); a test that wants GPUs installs its own fake over it. The processes a test
    starts (the CLI, the supervisor, torchrun's ranks, the console under tmux, ``check``'s
    workers) get the same fake through the seam's ``GPU_CONSOLE_FAKE_NVML`` (this folder last
    on their PYTHONPATH, so the fake's module imports and shadows nothing) and
    ``CUDA_VISIBLE_DEVICES=""``, which hides every GPU from torch. So ``--devices auto``, the
    launch screen, ``check`` and the supervisor's telemetry resolve to the CPU everywhere.
    Tests still pass ``--devices cpu:N`` where they launch a run: it says what they depend on.
    """
    if request.node.get_closest_marker("gpu") or "real_machine" in request.fixturenames:
        if REHEARSED_GPUS:
            pytest.skip("GPU_CONSOLE_TEST_GPUS pretends GPUs: this test reads the real machine")
        yield
        return
    import pynvml
    from test_telemetry_fake import FakeNvml, install

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    install(monkeypatch, FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    monkeypatch.setenv("GPU_CONSOLE_TEST_GPUS", str(REHEARSED_GPUS))
    monkeypatch.setenv("GPU_CONSOLE_FAKE_NVML", MACHINE_FAKE)
    rest = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (rest, str(TESTS)) if p))
    yield


@pytest.fixture
def real_machine(monkeypatch):
    """The machine as it is: its NVML, its GPUs and its own ``CUDA_VISIBLE_DEVICES``."""
    return MACHINE_ENV


def wait_for(pred: Callable[[], Any], timeout: float = DEADLINE_S, what: str = "condition"):
    """Poll ``pred`` until it returns something truthy; fail the test at the deadline
    (``timeout`` on a quiet machine, stretched by :func:`deadline`)."""
    timeout = deadline(timeout)
    end = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def read_events(run_dir: Path) -> list[dict]:
    from gpu_console.events import read_events as _read

    return _read(Path(run_dir) / "events.jsonl")


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


def read_status(run_dir: Path) -> dict:
    from gpu_console.runs import read_status as _read

    return _read(run_dir)


def run_dirs(runs_dir: Path) -> list[Path]:
    if not runs_dir.is_dir():
        return []
    return sorted(p for p in runs_dir.iterdir() if p.is_dir() and (p / "run.toml").exists())


def the_run(runs_dir: Path) -> Path | None:
    """The one run under ``runs_dir`` once it exists (for ``wait_for``), else None."""
    dirs = run_dirs(runs_dir)
    assert len(dirs) <= 1, f"expected one run under {runs_dir}, found {dirs}"
    return dirs[0] if dirs else None


def only_run(runs_dir: Path) -> Path:
    dirs = run_dirs(runs_dir)
    assert len(dirs) == 1, f"expected one run under {runs_dir}, found {dirs}"
    return dirs[0]


def start_nodes(
    procs,
    profile: Path,
    runs_dirs: list[Path],
    *,
    node_ranks: bool = False,
    envs: list[dict] | None = None,
    cwd: Path | None = None,
    devices: str = "cpu:1",
    extra: tuple[str, ...] = (),
) -> tuple[list[subprocess.Popen], str]:
    """A run over len(runs_dirs) "nodes" on loopback (one rank each unless ``devices`` says
    more), started as a user starts one: the same command on every node (``extra``: more of
    it, as ``--resume RUN``), each with its runs directory (the same one where the file system
    is shared), through one c10d rendezvous endpoint. Returns the consoles and it."""
    endpoint = f"127.0.0.1:{rendezvous_port()}"
    consoles = []
    for node, runs in enumerate(runs_dirs):
        where = ["--node-rank", str(node)] if node_ranks else []
        consoles.append(
            procs.start(
                "run",
                str(profile),
                "--headless",
                "--devices",
                devices,
                "--nnodes",
                str(len(runs_dirs)),
                *where,
                "--rdzv-endpoint",
                endpoint,
                "--runs-dir",
                str(runs),
                *extra,
                env=envs[node] if envs else None,
                cwd=cwd,
            )  # fmt: skip
        )
    return consoles, endpoint


def rendezvous_port() -> int:
    """A free port for a several-node rendezvous, below Linux's ephemeral range (32768 up).

    The head node's agent binds it seconds after this pick (its torch import); a port from the
    ephemeral range can meanwhile become any process's outgoing connection, and the agent then
    connects to a stranger instead of hosting the store. Random, so two test workers rarely
    pick the same one (the system's randomness: a test may have seeded ``random``), and
    checked free as the store binds (SO_REUSEADDR). The harness's two ranks use one too."""
    import random

    from gpu_console.slurm import port_free

    for _ in range(200):
        port = random.SystemRandom().randrange(20000, 32768)
        if port_free(port):
            return port
    raise AssertionError("no free port in 20000-32767 for the rendezvous")


def repo_pythonpath() -> str:
    """PYTHONPATH with this checkout first and what the machine had after it (a GPU node may
    carry the console's own dependencies on PYTHONPATH)."""
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(REPO), *rest.split(os.pathsep)) if p)


def test_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GPU_CONSOLE_RUNS", None)
    env["GPU_CONSOLE_PLAIN_EVERY_S"] = "0.5"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def fake_gpus_env(fake: str = "nvml_run_fake:two_gpus", **extra: str) -> dict[str, str]:
    """:func:`test_env` with the NVML seam's fake GPUs (tests/nvml_run_fake.py), for runs on
    CPU ranks through the real CLI; wide columns, so no summary line wraps."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return test_env(GPU_CONSOLE_FAKE_NVML=fake, PYTHONPATH=path, COLUMNS="200", **extra)


def without_packages(where: Path, *names: str, **extra: str) -> dict[str, str]:
    """:func:`test_env` for processes that cannot import ``names``: an import hook finds none
    of them, as on a machine where they are not installed (an optional extra's absence, met
    where the code meets it: at its import)."""
    hook = where / f"without-{'-'.join(names)}"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        f"NAMES = {names!r}\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in NAMES:\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Absent())\n"
    )
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return test_env(PYTHONPATH=path, **extra)


class Procs:
    """Processes started by a test, ended by pid at teardown (never by name)."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self.started: list[subprocess.Popen] = []

    def cli(
        self,
        *args: str,
        cwd: Path | None = None,
        env: dict | None = None,
        timeout: float = DEADLINE_S,
        input: str | None = None,
        prefix: list[str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``gpu-console ARGS`` to completion (as a user would, in a subprocess);
        ``prefix``: a command it runs under (:func:`unprivileged`)."""
        stdin = subprocess.PIPE if input else None
        proc = self.start(*args, cwd=cwd, env=env, stdin=stdin, prefix=prefix)
        try:
            out, err = proc.communicate(input=input, timeout=deadline(timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"gpu-console {' '.join(args)} timed out\n{out}\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def start(
        self,
        *args: str,
        cwd: Path | None = None,
        env: dict | None = None,
        stdin=None,
        new_session: bool = True,
        stdout=subprocess.PIPE,
        prefix: list[str] | None = None,
    ) -> subprocess.Popen:
        """Start ``gpu-console ARGS``; ``stdout`` may be an open file a test polls."""
        proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "gpu_console", *args],
            cwd=cwd or self.runs_dir.parent,
            env=env or test_env(),
            stdin=stdin or subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=new_session,
        )
        self.started.append(proc)
        return proc

    def cleanup(self) -> None:
        pids: set[int] = set()
        for proc in self.started:
            pids.add(proc.pid)
        sweeps = sorted(self.runs_dir.glob("*/sweep.json")) if self.runs_dir.is_dir() else []
        for plan in sweeps:  # a sweep's driver, and its trials below
            for line in (plan.parent / "sweep.jsonl").read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, psutil.Error):
                    pid = json.loads(line).get("pid")
                    if pid and "gpu_console.sweep.driver" in psutil.Process(pid).cmdline():
                        pids.add(pid)
        trials = [run for plan in sweeps for run in run_dirs(plan.parent)]
        for run_dir in [*run_dirs(self.runs_dir), *trials]:
            status = read_status(run_dir)
            for key in ("supervisor", "torchrun"):
                pid = status.get("pids", {}).get(key)
                if pid:
                    pids.add(pid)
            pids.update(status.get("pids", {}).get("workers") or [])
        victims: list[psutil.Process] = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                victims.extend(p.children(recursive=True))
                victims.append(p)
            except psutil.Error:
                continue
        for p in victims:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.send_signal(signal.SIGKILL)
            except psutil.Error:
                continue
        psutil.wait_procs(victims, timeout=10)
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    path = tmp_path / "runs"
    return path


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


def describe_runs(runs_dir: Path, lines: int = 15) -> str:
    """What a failed test's runs left: each run's status and the tails of its events and
    logs (CI keeps only the log, and a deadline missed says nothing of why)."""
    parts = []
    for run_dir in run_dirs(runs_dir):
        parts.append(f"== {run_dir.name}: status {json.dumps(read_status(run_dir))}")
        for path in [run_dir / "events.jsonl", *sorted((run_dir / "logs").glob("*"))]:
            if path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"-- {path.relative_to(run_dir)} (last {len(tail)} lines)")
                parts.extend(tail)
    return "\n".join(parts)


@pytest.fixture
def procs(runs_dir: Path, request):
    p = Procs(runs_dir)
    yield p
    if request.node.stash.get(_CALL_FAILED, False):
        print(describe_runs(runs_dir))
    p.cleanup()


def write_profile(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# A small, fast profile for integration tests: exact fp32 on CPU ranks (one unless a test needs
# more: every rank is a torch import and a torch._dynamo import, the most of a session's CPU).
FAST = """
[profile]
name = "{name}"
[task]
kind = "mlp"
hidden_dim = 64
train_samples = 8192
eval_samples = 512
[data]
batch_size = 32
[train]
max_steps = {max_steps}
lr = 3e-3
log_every = 1
precision = "fp32"
[hardware]
devices = "{devices}"
"""


def fast_profile(
    tmp_path: Path,
    name: str = "fast",
    max_steps: int = 40,
    extra: str = "",
    ranks: int = 1,
    devices: str | None = None,
) -> Path:
    """``devices`` other than CPU ranks ("auto", "0") replaces ``cpu:{ranks}``."""
    text = FAST.format(name=name, max_steps=max_steps, devices=devices or f"cpu:{ranks}")
    return write_profile(tmp_path / f"{name}.toml", text + extra)


def pinned_env(**extra: str) -> dict[str, str]:
    """:func:`test_env` with the hardware pinned as :func:`no_gpu_machine` pins it, for a
    module- or session-scoped fixture: those start before any test's autouse fixture runs."""
    rest = os.environ.get("PYTHONPATH", "")
    return test_env(
        CUDA_VISIBLE_DEVICES="",
        GPU_CONSOLE_TEST_GPUS=str(REHEARSED_GPUS),
        GPU_CONSOLE_FAKE_NVML=MACHINE_FAKE,
        PYTHONPATH=os.pathsep.join(p for p in (rest, str(TESTS)) if p),
        **extra,
    )


FAST_RUN_STEPS = 12


class FinishedRun:
    """A run that ended: its directory, the profile it ran and the CLI's result."""

    def __init__(self, run: Path, profile: Path | None, result: subprocess.CompletedProcess):
        self.run, self.profile, self.result = run, profile, result

    @property
    def runs_dir(self) -> Path:
        return self.run.parent

    def copy(self, runs_dir: Path) -> Path:
        """The run copied under ``runs_dir``, for a test that changes it (a resume, a damage)."""
        import shutil

        runs_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copytree(self.run, runs_dir / self.run.name, symlinks=True))


@pytest.fixture(scope="session")
def fast_run(tmp_path_factory) -> FinishedRun:
    """One finished run of the fast profile (FAST_RUN_STEPS steps, 2 CPU ranks, its defaults,
    a checkpoint at the end), shared by the tests that only read a finished run. Read it, never
    change it: a test that resumes or damages a run takes :meth:`FinishedRun.copy`."""
    tmp = tmp_path_factory.mktemp("fast_run")
    profile = fast_profile(tmp, max_steps=FAST_RUN_STEPS, ranks=2)
    return _finished(tmp / "runs", profile, str(profile), cwd=tmp)


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> FinishedRun:
    """One real quickstart run (300 steps; 2 CPU ranks through torchrun, pinned: its profile
    says "auto"), recorded headless once for the session and shared by the tests that only
    read it (tests/test_engine.py, tests/test_status_cmd.py, tests/tui/). Never change it:
    copy it first."""
    runs = tmp_path_factory.mktemp("recorded") / "runs"
    return _finished(runs, None, "quickstart", "--devices", "cpu:2")


def _finished(runs: Path, profile: Path | None, *args: str, cwd: Path | None = None):
    """A headless run of ``args`` to its end under ``runs``, its processes ended at once (by
    the session's end a pid in its status may be another's)."""
    procs = Procs(runs)
    try:
        result = procs.cli("run", *args, "--headless", "--runs-dir", str(runs), cwd=cwd,
                           env=pinned_env())  # fmt: skip
    finally:
        procs.cleanup()
    assert result.returncode == 0, result.stdout + result.stderr
    return FinishedRun(only_run(runs), profile, result)


@pytest.fixture(scope="session")
def recorded_run(quickstart_run) -> Path:
    """The session's quickstart run's directory."""
    return quickstart_run.run


def pid_alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]


def run_finished(procs, profile: Path, runs_dir: Path, cwd: Path) -> tuple[Path, str]:
    """``run PROFILE --headless`` to its end, which must be a success: (the run, its output)."""
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=cwd)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    return only_run(runs_dir), out


def task_profile(tmp_path: Path, module: str, source: str, cls: str, **kw) -> Path:
    """A fast profile whose task is ``module:cls``, written from ``source`` into tmp_path."""
    (tmp_path / f"{module}.py").write_text(source)
    profile = fast_profile(tmp_path, **kw)
    profile.write_text(profile.read_text().replace('kind = "mlp"', f'kind = "{module}:{cls}"'))
    return profile


# A run a test must act on before it ends: each step sleeps PACE_S seconds (0 when unset), so
# the run's length has a floor that a fast, idle machine cannot shorten; with PACE_WHILE set,
# only while the file it names exists (a test lets the run go at full speed once it acted).
# Numerics are the MLP's.
PACED_TASK = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class Paced(MLPTask):
    def compute(self, model, batch):
        gate = os.environ.get("PACE_WHILE")
        if not gate or os.path.exists(gate):
            time.sleep(float(os.environ.get("PACE_S", "0")))
        return super().compute(model, batch)
"""


def paced_profile(tmp_path: Path, **kw) -> Path:
    """A fast profile of the paced task (run it with ``cwd=tmp_path``)."""
    return task_profile(tmp_path, "paced", PACED_TASK, "Paced", **kw)


# For worker scripts run under torchrun (they need ``torch`` and ``rank`` defined): a small
# model, and one step's all-reduced gradients, flattened, from rank-dependent data.
DDP_STEP = """
def model(dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))
    return m.to(dtype)

def grads(ddp, seed, dtype):
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(16, 7, generator=g, dtype=dtype)
    ddp(x).square().mean().backward()
    flat = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    ddp.zero_grad(set_to_none=True)
    return flat
"""

# Rank 1's loss is NaN on its 5th and 6th batches.
POISONED_TASK = """
import os
from gpu_console.tasks.mlp import MLPTask


class Poisoned(MLPTask):
    calls = 0

    def compute(self, model, batch):
        Poisoned.calls += 1
        out = super().compute(model, batch)
        if os.environ["RANK"] == "1" and Poisoned.calls in (5, 6):
            out.loss = out.loss * float("nan")
        return out
"""

# Every rank hangs in its 6th batch: a graceful stop can never reach a step boundary.
HANGING_TASK = """
import time
from gpu_console.tasks.mlp import MLPTask


class Hanging(MLPTask):
    calls = 0

    def compute(self, model, batch):
        Hanging.calls += 1
        if Hanging.calls == 6:
            time.sleep(600)
        return super().compute(model, batch)
"""


# -- permission faults that root writes through ---------------------------------------------


def unprivileged() -> list[str]:
    """A command prefix that runs a program without the power to ignore file permissions:
    as root, ``setpriv`` drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so a chmod 0500
    directory refuses it as it would refuse any user (the interpreter, perhaps under a /root
    only root may enter, still runs). Not root: nothing to drop."""
    if os.geteuid() != 0:
        return []
    import shutil

    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to test permission faults as root")
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group in this process (in-process engine tests)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def set_args(*sets: str) -> list[str]:
    """``--set`` before each ``SECTION.KEY=VALUE``: the command line of many overrides."""
    return [arg for s in sets for arg in ("--set", s)]


def ctrl_c_then_resume(procs, runs_dir: Path, *run_args: str, after: int = 8) -> tuple[Path, int]:
    """``gpu-console run RUN_ARGS --headless`` stopped by a Ctrl-C once ``after`` steps are
    done, then resumed to its end: the run directory and the step it stopped at."""
    console = procs.start("run", *run_args, "--headless", "--runs-dir", str(runs_dir))
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step") and events_of(run, "step")[-1]["step"] >= after,
             what=f"{after} steps")  # fmt: skip
    os.kill(console.pid, signal.SIGINT)
    console.communicate(timeout=DEADLINE_S)
    stopped = read_status(run)
    assert stopped["state"] == "stopped", stopped
    again = procs.cli("run", "--resume", str(run), "--headless", "--runs-dir", str(runs_dir))
    assert again.returncode == 0, again.stdout + again.stderr
    return run, stopped["step"]


# -- a real full disk: a small tmpfs (root only) -----------------------------------------


class Disk:
    """A tmpfs of its own at ``path``."""

    def __init__(self, path: Path):
        self.path = path

    def mount(self, size: str) -> None:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path))

    def resize(self, size: str) -> None:
        _mount("-o", f"remount,size={size}", str(self.path))

    def fill(self, name: str = "ballast") -> Path:
        """Take every free byte: writes of a page, then of a byte, until ENOSPC (what a
        process then frees is free again: a test asserts what it needs)."""
        path = self.path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for chunk in (1 << 16, 4096, 1):
                try:
                    while os.write(fd, b"x" * chunk):
                        pass
                except OSError as e:
                    assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        return path


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise PermissionError(done.stderr.strip() or f"mount exited {done.returncode}")


@pytest.fixture
def small_disk(tmp_path: Path):
    where = tmp_path / "disk"
    where.mkdir()
    disk = Disk(where)
    try:
        disk.mount("3m")
    except (OSError, PermissionError) as e:
        pytest.skip(f"a real full disk needs a tmpfs, and this user cannot mount one: {e}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
