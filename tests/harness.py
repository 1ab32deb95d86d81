"""A run's engine without torchrun: in the pytest worker, or as two ranks forked from a zygote.

The run directory is the product's own: ``launch.prepare`` checks the profile and
``launch.start`` (or ``continue_run``, for a resume) writes run.toml and meta.json; only the
supervisor is left out (the harness is the engine's parent, and nothing folds status.json).
Then the engine runs as torchrun would run it:

- one rank in this process, on a gloo group of one made here and destroyed afterwards, so
  that tests stay independent; an exception of the engine reaches the test as itself;
- two ranks forked from a zygote: a process started once per pytest worker that imported
  torch, ``torch._dynamo`` and the engine, and never computed anything (a fork after OpenMP
  or gloo started their threads can hang). Each rank runs the entry point that torchrun
  starts (``engine/__main__.main``) with torchrun's environment; an exception comes back to
  the test as itself (pickled), its traceback attached as the ``__cause__``.

A user task's key check and data count, which a launch makes in a subprocess (the console
never imports torch), run here in-process with the product's own functions
(``tasks.check.check``, ``engine.plan.data_size``). What stays on torchrun is what it is
there for (tests/README.md): the process tree, signals, faults, the supervisor, several
nodes, the console's launch.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
TESTS = HERE.parent
# A busy 2-core machine runs several sessions at once: a rank's run is given minutes (on a
# quiet machine; conftest.deadline stretches them as the machine is now).
RANK_TIMEOUT_S = 600.0
ZYGOTE_START_S = 300.0
# What the zygote imports once, so that a forked rank starts where a torchrun rank is after
# its imports (the most of its start-up: torch, and torch._dynamo that an optimizer's step
# imports).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing.errors",
    "gpu_console.engine.__main__",
    "gpu_console.engine.loop",
    "gpu_console.tasks.mlp",
    "gpu_console.tasks.moe",
)


class RemoteTraceback(Exception):
    """A rank's traceback, as its process formatted it: the ``__cause__`` of what it raised."""

    def __str__(self) -> str:
        return self.args[0]


class RankFailed(AssertionError):
    """A rank ended without an exception to hand back (killed, timed out, unpicklable)."""


def run_engine(
    tmp_path: Path,
    profile: str | Path | None,
    *sets: str,
    ranks: int = 1,
    resume: str | Path | None = None,
    name: str | None = None,
    runs_dir: Path | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = RANK_TIMEOUT_S,
    stop_after: int | None = None,
) -> Path:
    """Launch ``profile`` (a name, a file, or TOML text) with ``--set`` ``sets`` on ``ranks``
    CPU ranks (or ``--resume`` ``resume``), run its engine to its end and return the run
    directory. ``cwd``: where the run is launched from (a user task's module; default
    ``tmp_path``); ``env``: more environment for the launch and the ranks. ``stop_after``:
    a ``stop`` command appended to the run's control file, as ``gpu-console stop`` appends
    it, once the run wrote step ``stop_after``'s event (the run's steps must be paced to
    leave it time: a task's ``PACE_S``); the engine stops at a later step.

    A rank's exception is raised here (rank 0's first, the others' as notes); how the run
    ended otherwise is in its events, as in a real run (the supervisor is not there to fold
    them into status.json)."""
    if ranks not in (1, 2):
        raise ValueError(f"ranks: 1 or 2 (got {ranks})")
    cwd = Path(cwd or tmp_path)
    runs_dir = Path(runs_dir or tmp_path / "runs")
    if isinstance(profile, str) and "\n" in profile:  # TOML text
        text, profile = profile, tmp_path / f"{name or 'harness'}.toml"
        profile.write_text(text)
    with _environ(env or {}):  # a user task's data count at launch sees it too
        run_dir = launch_dir(profile, sets, ranks, resume, name, runs_dir, cwd)
        if ranks == 1:
            with _stopper(run_dir, stop_after):
                run_in_process(run_dir)
    if ranks > 1:
        from conftest import deadline  # here: the zygote imports this module without pytest

        with _stopper(run_dir, stop_after):
            run_forked(run_dir, ranks, cwd, env or {}, deadline(timeout))
    return run_dir


def preload(*modules: str) -> None:
    """The zygote imports ``modules`` too (this worker's, started here if it was not): the
    ranks forked from it after this start past those imports, as they start past torch's. For
    a module whose task imports a library of seconds in every rank (transformers, sklearn)."""
    from conftest import deadline

    answer = _zygote()._ask({"op": "import", "modules": list(modules)}, deadline(ZYGOTE_START_S))
    assert answer.get("imported") == list(modules), answer


def launch_notes(monkeypatch) -> list[str]:
    """The notes of the launches the test makes from now on: the lines ``gpu-console run``
    prints on stderr before it starts a run (``launch.prepare``'s, as the harness's launches
    make them); the list fills as they launch."""
    from gpu_console import launch

    notes: list[str] = []
    prepare = launch.prepare

    def noting(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        notes.extend(prepared[0].notes)
        return prepared

    monkeypatch.setattr(launch, "prepare", noting)
    return notes


@contextlib.contextmanager
def _stopper(run_dir: Path, after: int | None) -> Iterator[None]:
    """A thread that appends ``stop`` to the control file once this session's events hold
    step ``after``: the console's command, sent while the engine trains."""
    if after is None:
        yield
        return
    from gpu_console.events import JsonlTail, append_control

    events = run_dir / "events.jsonl"
    tail = JsonlTail(events, events.stat().st_size if events.exists() else 0)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            if any(e.get("kind") == "step" and e.get("step", 0) >= after for e in tail.read()):
                append_control(run_dir, "stop")
                return

    watcher = threading.Thread(target=watch, name="harness-stopper", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def cut_and_resumed(
    tmp_path: Path,
    profile: str | Path,
    *sets: str,
    cut_at: int,
    ranks: int = 2,
    runs_dir: Path | None = None,
    cwd: Path | None = None,
) -> Path:
    """``profile`` run to step ``cut_at`` (its ``max_steps`` there), then ``--resume``d to
    the ``max_steps`` ``sets`` give it: the engine's half of a stop and a resume (what a
    checkpoint keeps, what a resume restores), without the process tree's half (a Ctrl-C
    through the console, the supervisor and torchrun: test_engine.py). The decay of the lr
    is pinned to the whole run's length (``train.lr_decay_steps``: what 0 means for it), so
    each step of the cut run has the uninterrupted run's lr. Choose ``cut_at`` on the eval
    cadence: a run's end evaluates, and an eval may draw from the RNGs. Returns the run."""
    pinned, max_steps = pin_decay(tmp_path, profile, sets, cwd)
    assert 0 < cut_at < max_steps, (cut_at, max_steps)
    runs = Path(runs_dir or tmp_path / "cut")
    run = run_engine(tmp_path, profile, *pinned, f"train.max_steps={cut_at}", ranks=ranks,
                     runs_dir=runs, cwd=cwd)  # fmt: skip
    run_engine(tmp_path, None, f"train.max_steps={max_steps}", ranks=ranks, resume=run,
               runs_dir=runs, cwd=cwd)  # fmt: skip
    return run


def pin_decay(
    tmp_path: Path, profile: str | Path, sets: Sequence[str], cwd: Path | None = None
) -> tuple[list[str], int]:
    """``sets`` with the lr's decay pinned to the whole run's length (what
    ``train.lr_decay_steps = 0`` means for it), so that a session cut short of
    ``max_steps`` trains each of its steps at the uninterrupted run's lr; and that length."""
    from gpu_console.profile import load_profile

    with contextlib.chdir(cwd or tmp_path), _user_modules(Path(cwd or tmp_path)):
        train = load_profile(str(profile), list(sets)).train
    pinned = [*sets]
    if train.schedule != "constant" and not train.lr_decay_steps:
        pinned.append(f"train.lr_decay_steps={max(1, train.max_steps - train.warmup_steps)}")
    return pinned, train.max_steps


def launch_dir(
    profile: str | Path | None,
    sets: Sequence[str],
    ranks: int,
    resume: str | Path | None,
    name: str | None,
    runs_dir: Path,
    cwd: Path,
) -> Path:
    """The run directory as ``gpu-console run`` makes it, from ``cwd``, without a supervisor."""
    from gpu_console import dry_run, launch

    with contextlib.chdir(cwd), _user_modules(cwd), contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(launch, "spawn_supervisor", _no_supervisor))
        stack.enter_context(mock.patch.object(launch, "_check_only", _check_here))
        stack.enter_context(mock.patch.object(dry_run, "TaskProcess", _TaskHere))
        prepared, placement, resume_from = launch.prepare(
            None if profile is None else str(profile),
            devices=f"cpu:{ranks}",
            overrides=list(sets),
            resume=None if resume is None else str(resume),
            runs_dir=runs_dir,
            name=name,
        )
        return launch.start(prepared, placement, runs_dir, resume_from, argv=["harness"]).run_dir


def _no_supervisor(run_dir: Path, placement, lock=None) -> None:
    """In place of ``launch.spawn_supervisor``: the harness runs the engine itself."""
    return None


def _check_here(profile, cwd: str | None) -> tuple[dict | None, str]:
    """``launch._check_only``'s answer, from ``tasks.check`` in this process."""
    from gpu_console.tasks.check import check

    return check(profile.task_kind, profile.task), ""


class _TaskHere:
    """``dry_run.TaskProcess`` in this process: the key check, then the data count."""

    def __init__(self, profile, placement, world_size: int, cwd: str) -> None:
        self.profile, self.placement, self.world_size = profile, placement, world_size

    def verdict(self) -> tuple[dict | None, str]:
        return _check_here(self.profile, None)

    def count(self, profile, timeout_s: float):
        from gpu_console.dry_run import DataSize
        from gpu_console.engine.plan import data_size

        answer = data_size(profile, self.placement.device_type, self.world_size)
        return DataSize(samples=answer["train_samples"])

    def close(self) -> None:
        pass


# -- one rank, in this process ------------------------------------------------------------


def run_in_process(run_dir: Path) -> None:
    """Rank 0 of 1 here, on a gloo group of its own, as ``engine/__main__`` would run it,
    without what belongs to a rank's process (its signals, cores and threads)."""
    import torch.distributed as dist

    from gpu_console.engine import signals
    from gpu_console.engine.__main__ import run_rank
    from gpu_console.engine.heartbeat import Heartbeat
    from gpu_console.timings import Stopwatch

    meta = json.loads((run_dir / "meta.json").read_text())
    cwd = Path(meta["cwd"])
    assert not dist.is_initialized(), "a process group is left from an earlier test"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    heartbeat = Heartbeat(run_dir, rank=0, local_rank=0, restart=0)
    try:
        with _user_modules(cwd), _torch_flags():
            run_rank(run_dir, heartbeat, Stopwatch(), setup=_determinism_only)
        assert dist.is_initialized(), "the engine destroyed a process group it did not create"
    except BaseException:
        heartbeat.close("failed")
        raise
    else:
        heartbeat.close("done")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        signals.reset()  # a control stop marks the process as stopping (signals.stopping)
        # The run's objects that hold its process group in a reference cycle go now, in
        # this process: left to a later collection, one could run in a process forked from
        # this one (a DataLoader worker of a later test), whose ProcessGroupGloo destructor
        # then waits forever for the gloo threads that the fork did not copy.
        gc.collect()


def _determinism_only(profile, device_type: str) -> None:
    """``train.deterministic`` in this process (``_torch_flags`` restores it); its cores and
    threads stay pytest's."""
    from gpu_console.engine import determinism

    determinism.setup(profile.train.deterministic)


@contextlib.contextmanager
def _torch_flags() -> Iterator[None]:
    """What ``determinism.setup`` changes in this process, put back."""
    import torch

    from gpu_console.engine.determinism import CUBLAS_ENV

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    cublas = os.environ.get(CUBLAS_ENV)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:4]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[4:]
        if cublas is None:
            os.environ.pop(CUBLAS_ENV, None)
        else:
            os.environ[CUBLAS_ENV] = cublas


@contextlib.contextmanager
def _user_modules(cwd: Path) -> Iterator[None]:
    """A user task's module imported from ``cwd`` (as the engine puts it on sys.path) is
    forgotten afterwards: the next test's module of the same name is another file.

    Only new top-level modules (and their submodules) go: a submodule of a package loaded
    before (``torch._dynamo``, first imported by a compiled task) stays, even where the
    virtualenv lies under ``cwd``, as it does when a test runs from the project root. Torch
    cannot import such a module twice (its operator libraries register once a process)."""
    path = list(sys.path)
    if str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))
    before = set(sys.modules)
    tops = {mod.partition(".")[0] for mod in before}
    try:
        yield
    finally:
        sys.path[:] = path
        for mod in set(sys.modules) - before:
            if mod.partition(".")[0] in tops:
                continue
            file = getattr(sys.modules[mod], "__file__", None) or ""
            if file.startswith(str(cwd) + os.sep):
                del sys.modules[mod]


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# -- two ranks, forked from the zygote ----------------------------------------------------


def run_forked(run_dir: Path, ranks: int, cwd: Path, env: dict[str, str], timeout: float) -> None:
    """Every rank forked from the zygote with torchrun's environment; waited for, up to
    ``timeout``, then ended by pid. A rank's exception is raised here."""
    from conftest import rendezvous_port

    from gpu_console import launch

    base = launch.worker_env(launch.resolve_placement(f"cpu:{ranks}")) | env
    # Below the ephemeral range: a port the kernel handed out (bind to 0) can become another
    # process's outgoing connection before rank 0 binds it (EADDRINUSE on a busy machine).
    port = str(rendezvous_port())
    work = run_dir.parent / f".harness-{run_dir.name}"
    work.mkdir(exist_ok=True)
    for stale in work.glob("rank-*"):  # a previous session's (a resume in place)
        stale.unlink()
    zygote = _zygote()
    pids: list[int] = []
    try:
        for rank in range(ranks):
            rank_env = base | {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            }  # fmt: skip
            pids.append(
                zygote.fork(
                    run_dir=str(run_dir),
                    cwd=str(cwd),
                    env=rank_env,
                    result=str(work / f"rank-{rank}.pickle"),
                    log=str(work / f"rank-{rank}.log"),
                )  # fmt: skip
            )
        ended = zygote.wait(pids, timeout)
    except BaseException:
        for pid in pids:  # the test is going: its ranks too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            zygote.wait(pids, 30.0)
        raise
    _raise_from_ranks(work, ended["codes"], ended["order"], ended["timed_out"], timeout)


def _raise_from_ranks(work: Path, codes: list, order: list[int], timed_out: bool, timeout: float):
    """The exception of the rank that failed first, the others' as notes."""
    errors: list[tuple[bool, float, BaseException]] = []
    for rank in order:
        code = codes[rank]
        result = work / f"rank-{rank}.pickle"
        log = work / f"rank-{rank}.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
        if result.exists():
            caught, *sent = pickle.loads(result.read_bytes())
            exc, text = _rebuilt(*sent)
            exc.__cause__ = RemoteTraceback(f"\nrank {rank}'s traceback:\n{text}")
            errors.append((_peer_gone(exc), caught, exc))
        elif code != 0:
            why = f"ended by the harness after {timeout:.0f} s" if timed_out else f"exit {code}"
            ended = RankFailed(f"rank {rank}: {why}; its output's end:\n{tail}")
            errors.append((True, math.inf, ended))
    # The cause first: a rank that failed because another did (its peer gone from a
    # collective, or ended by the harness) says less than what that one raised.
    errors.sort(key=lambda e: e[:2])
    if errors:
        first = errors[0][2]
        for *_, other in errors[1:]:
            first.add_note(f"also: {type(other).__name__}: {other}")
        raise first


def _peer_gone(e: BaseException) -> bool:
    """A collective's failure because another rank left it (gloo's words for it)."""
    text = str(e)
    return type(e).__name__.startswith("Dist") or "by peer" in text


def _rebuilt(exc, text: str, shape: tuple | None = None) -> tuple[BaseException, str]:
    """The rank's exception: itself, or (one whose constructor pickle cannot call again, as
    ``Refused(key, problem)``) its class made anew with its args and attributes."""
    if exc is not None:
        return exc, text
    if shape is not None:
        module, qualname, args, attrs = shape
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            made = cls.__new__(cls, *args)
            made.args = args
            made.__dict__.update(attrs)
            return made, text
        except Exception:
            pass
    return RankFailed(f"a rank raised what cannot come back:\n{text}"), text


class Zygote:
    """The process the ranks are forked from (``python tests/harness.py --zygote``): one per
    pytest worker, ended with it (:func:`close_zygote`, and the kernel's parent-death signal).

    Line-delimited JSON on its stdin and stdout: ``fork`` answers the rank's pid; ``wait``
    waits for pids (their pidfds) up to a deadline, SIGKILLs what is left, reaps them all and
    answers their exit codes."""

    def __init__(self) -> None:
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        path = os.pathsep.join(dict.fromkeys([str(REPO), *rest, str(TESTS)]))
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - its stderr, read on a failure
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=os.environ | {"PYTHONPATH": path},
            cwd=str(REPO),
            text=True,
            bufsize=1,
        )
        from conftest import deadline

        ready = self._answer(deadline(ZYGOTE_START_S))
        assert ready.get("ready"), f"the zygote did not start: {ready}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, **request: object) -> int:
        return int(self._ask({"op": "fork", **request}, 60.0)["pid"])

    def wait(self, pids: list[int], timeout: float) -> dict:
        return self._ask({"op": "wait", "pids": pids, "timeout": timeout}, timeout + 60.0)

    def _ask(self, request: dict, within: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer(within)

    def _answer(self, within: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], within)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.log.seek(0)
            err = self.log.read().decode(errors="replace")[-3000:]
            self.close()
            raise RankFailed(f"the zygote gave no answer within {within:.0f} s; its stderr:\n{err}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


_zygotes: list[Zygote] = []


def _zygote() -> Zygote:
    if _zygotes and not _zygotes[0].alive():
        _zygotes.pop().close()
    if not _zygotes:
        _zygotes.append(Zygote())
    return _zygotes[0]


def zygote_pid() -> int | None:
    """This worker's zygote's pid, if it started one."""
    return _zygotes[0].proc.pid if _zygotes and _zygotes[0].alive() else None


def close_zygote() -> None:
    """End this worker's zygote, if it started one (conftest's session fixture)."""
    while _zygotes:
        _zygotes.pop().close()


# -- in the zygote --------------------------------------------------------------------------


def _zygote_main() -> None:
    from gpu_console.engine.signals import die_with_parent

    die_with_parent()  # pytest's worker gone: the zygote too (and its ranks, with theirs)
    for name in PRELOAD:
        importlib.import_module(name)
    answer = sys.stdout
    _say(answer, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                _rank(request)  # never returns
            _say(answer, {"pid": pid})
        elif request["op"] == "wait":
            _say(answer, _reap(request["pids"], float(request["timeout"])))
        elif request["op"] == "import":  # preload()
            for name in request["modules"]:
                importlib.import_module(name)
            _say(answer, {"imported": request["modules"]})
    os._exit(0)  # its parent closed the pipe: no interpreter teardown (torch's takes seconds)


def _say(answer, doc: dict) -> None:
    answer.write(json.dumps(doc) + "\n")
    answer.flush()


def _reap(pids: list[int], timeout: float) -> dict:
    """Each rank's exit code, reaped as it ends; as torchrun does, the first rank that fails
    ends the others (a rank left waiting in a collective would wait for its timeout)."""
    fds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[os.pidfd_open(pid)] = pid
    codes: dict[int, int | None] = dict.fromkeys(pids)
    order: list[int] = []  # the ranks in the order they ended: the first failure is the cause
    deadline = time.monotonic() + timeout
    waiting = set(fds)
    failed = False
    while waiting and not failed and (left := deadline - time.monotonic()) > 0:
        done, _, _ = select.select(list(waiting), [], [], left)
        for fd in done:
            waiting.discard(fd)
            code = _reaped(fds[fd])
            codes[fds[fd]] = code
            order.append(pids.index(fds[fd]))
            failed = failed or code != 0
    timed_out = bool(waiting) and not failed
    for fd in waiting:
        with contextlib.suppress(ProcessLookupError):
            os.kill(fds[fd], signal.SIGKILL)
        codes[fds[fd]] = _reaped(fds[fd])
    for fd in fds:
        os.close(fd)
    order += [r for r in range(len(pids)) if r not in order]
    return {"codes": [codes[pid] for pid in pids], "timed_out": timed_out, "order": order}


def _reaped(pid: int) -> int | None:
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except ChildProcessError:
        return None


def _rank(request: dict) -> None:
    """A forked rank: torchrun's environment, the run's directory, the entry point."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.close(out)
        import torch

        # What a fresh rank's OpenMP would have read from its environment (torchrun's 1);
        # the zygote's was loaded with another. engine/__main__ may set its own after.
        if threads := request["env"].get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(threads))
        from gpu_console.engine.__main__ import main

        main([request["run_dir"]])  # leaves with os._exit(0) when the run ends well
        code = 0
    except BaseException as e:
        caught = time.monotonic()  # the host's clock: the ranks' times compare
        text = "".join(traceback.format_exception(e))
        try:
            picked = pickle.dumps((caught, e, text))
            pickle.loads(picked)
        except Exception:
            picked = pickle.dumps((caught, None, text, _shape(e)))
        with open(request["result"], "wb") as f:
            f.write(picked)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _shape(e: BaseException) -> tuple | None:
    """What :func:`_rebuilt` makes the exception again from, where that pickles."""
    attrs = {}
    for k, v in vars(e).items():
        with contextlib.suppress(Exception):
            pickle.dumps(v)
            attrs[k] = v
    shape = (type(e).__module__, type(e).__qualname__, e.args, attrs)
    try:
        pickle.dumps(shape)
    except Exception:
        return None
    return shape


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
