"""From a validated profile to a running supervisor: run directory, torchrun argv, spawn.

Nothing is written until every check has passed, and a failure after the run directory
exists removes it, so a user mistake never leaves a half-made run behind. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import getpass
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import diskfull, held_signals, lost, runs, session_lock, slurm, torchrun
from .batching import IN_EPOCHS, batch_problem, epochs_to_steps
from .devices import (
    FUSED_UNDER_SHARDED_SCALER,
    RANK_DEVICES,
    DeviceSpecError,
    Placement,
    bf16_native,
    check_cpu_ranks,
    fused_steps_ok,
    parse_devices,
    place,
    precision_refusals,
    read_grant,
)
from .profile import Profile, ProfileError, find_profile, load_profile
from .results import tensorboard
from .resume_changes import refused
from .schema import KeyProblem, show
from .tasks import BUILTIN


class LaunchError(Exception):
    """A run that cannot start as asked (bad device, resume target, runs directory)."""


# torchrun's default set. Not SIGUSR1, which SLURM sends every process of the step before a
# time limit (`--signal=USR1@120`): torchrun holds it, for the supervisor and the ranks.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # SIGUSR1: held (held_signals.py)
# One rendezvous per endpoint: every node must give torchrun the same id.
MULTINODE_RDZV_ID = "gpu-console"


@dataclass(frozen=True)
class Nodes:
    """Several machines: the same command on every node, passed to torchrun unchanged."""

    nnodes: str  # "N", or "MIN:MAX" for an elastic range
    node_rank: int | None
    endpoint: str  # HOST:PORT of the c10d rendezvous
    rdzv_id: str = MULTINODE_RDZV_ID  # a SLURM job's own (slurm.Job.rdzv_id)

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])


def parse_nodes(nnodes: str | None, node_rank: int | None, endpoint: str | None) -> Nodes | None:
    """Check --nnodes/--node-rank/--rdzv-endpoint; None for a single machine."""
    if nnodes is None and endpoint is None and node_rank is None:
        return None
    nnodes = "1" if nnodes is None else str(nnodes).strip()
    if not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", nnodes):
        raise LaunchError(f"--nnodes: expected N or MIN:MAX, positive integers (got {nnodes!r})")
    low, _, high = nnodes.partition(":")
    if high and int(high) < int(low):
        raise LaunchError(f"--nnodes: MIN is larger than MAX (got {nnodes!r})")
    if endpoint is None:
        if nnodes == "1":
            if node_rank not in (None, 0):
                raise LaunchError(f"--node-rank: one node has rank 0 (got {node_rank})")
            return None
        raise LaunchError("--rdzv-endpoint: several nodes need HOST:PORT of the rendezvous")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv-endpoint: expected HOST:PORT (got {endpoint!r})")
    if node_rank is not None and not 0 <= node_rank < int(high or low):
        raise LaunchError(f"--node-rank: expected 0 to {int(high or low) - 1} (got {node_rank})")
    return Nodes(nnodes, node_rank, endpoint)


def job_nodes(nodes: Nodes | None, job: slurm.Job | None) -> Nodes | None:
    """Several nodes as the SLURM job has them, unless the flags say otherwise: nodes from
    ``SLURM_NNODES``/``SLURM_NODEID``, the rendezvous on the node list's first host at the
    job's port, under the job's id (two jobs on one head node never meet)."""
    if job is None:
        return nodes
    try:
        slurm.check_one_console_per_node(job)
        if nodes is not None:
            return dataclasses.replace(nodes, rdzv_id=job.rdzv_id)
        if job.nnodes < 2:
            return None
        endpoint = slurm.head_endpoint(job)
    except slurm.SlurmError as e:
        raise LaunchError(f"SLURM job {job.job_id}: {e}") from None
    return Nodes(str(job.nnodes), job.node_id, endpoint, job.rdzv_id)


@dataclass
class Launched:
    run_dir: Path
    supervisor: subprocess.Popen
    placement: Placement


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_user_task(
    profile: Profile,
    source: str,
    overridden: set[str],
    cwd: str | None = None,
    count_for: tuple[Placement, int] | None = None,
):
    """Validate a user task's keys in a subprocess: its module may import torch.

    ``count_for`` (the placement and the world): that subprocess stays, to count the task's
    training set when :func:`check_data` asks (``dry_run.TaskProcess``); returned beside the
    profile (None otherwise). :func:`prepare` ends it when it returns, whatever happened."""
    if profile.task_kind in BUILTIN:
        return profile, None
    task = None
    if count_for is not None:
        from .dry_run import TaskProcess

        task = TaskProcess(profile, *count_for, cwd or os.getcwd())
        _task_processes.append(task)
        answer, why = task.verdict()
    else:
        answer, why = _check_only(profile, cwd)
    if answer is None:
        raise ProfileError([f"{source}: task.kind: cannot load {profile.task_kind} ({why})"])
    if answer["errors"]:
        raise ProfileError(
            [
                f"{'--set' if e.split(':')[0] in overridden else source}: {e}"
                for e in answer["errors"]
            ]
        )
    mode = profile.train.activation_checkpointing
    if mode != "none" and answer.get("blocks") is False:
        where = "--set" if "train.activation_checkpointing" in overridden else source
        raise ProfileError(
            [
                f"{where}: train.activation_checkpointing: {profile.task_kind} has no "
                f"blocks(model) naming its blocks (docs/performance.md: Activation "
                f"checkpointing) (got {mode!r})"
            ]
        )
    profile.task = answer["task"]
    return profile, task


# How long a user task's module may take to import and check its keys.
CHECK_TIMEOUT_S = 300.0

# The key check's subprocess of the launch being checked (check_user_task), ended when
# prepare returns (_launch_checks).
_task_processes: list = []


def _check_only(profile: Profile, cwd: str | None) -> tuple[dict | None, str]:
    """``tasks/check.py``'s answer (None if it gave none) and its last line of stderr."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gpu_console.tasks.check", profile.task_kind,
             json.dumps(profile.task)],
            capture_output=True,
            text=True,
            cwd=cwd or os.getcwd(),
            timeout=CHECK_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"no answer within {CHECK_TIMEOUT_S:.0f} s"
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, (proc.stderr.strip().splitlines()[-1:] or ["no answer"])[0]


def resolve_placement(devices: str, oversubscribe: bool = False) -> Placement:
    """``devices`` against the GPUs this user is granted and a torch that can use them
    (``oversubscribe``: CPU ranks above the usable cores are asked for on purpose)."""
    spec = parse_devices(devices)
    check_cpu_ranks(spec, oversubscribe)
    if spec.kind == "cpu":
        return place(spec, 0)
    from . import torch_build
    from .telemetry import nvml  # not for a CPU run: it starts sooner without

    gpus = nvml.identities()
    reason = "" if gpus else nvml.status().reason
    grant = read_grant(gpus)
    return place(spec, grant, reason, torch_build.cuda_problem() if grant.gpus else "")


def precision_refusal(placement: Placement, precision: str) -> str:
    """Why ``precision`` cannot run on the placement ("" when it can, or cannot be told):
    :func:`devices.precision_refusals`, with NVML's capabilities for a GPU placement."""
    known = {}
    if placement.device_type == "cuda":
        from .telemetry import nvml

        known = {g["index"]: g["compute_capability"] for g in nvml.identities()}
    refused = precision_refusals(placement.device_type, placement.gpus, known)
    return refused.get(precision, "")


def precision_of(placement: Placement, precision: str) -> str:
    """``precision`` as the ranks will resolve it (engine/precision.py): ``auto`` on GPUs is
    bf16, or fp16 where NVML says a granted GPU is older than compute capability 8.0."""
    if precision != "auto" or placement.device_type != "cuda":
        return precision
    from .telemetry import nvml

    known = {g["index"]: g["compute_capability"] for g in nvml.identities()}
    old = any(known.get(i) is not None and not bf16_native(known[i]) for i in placement.gpus)
    return "fp16" if old else "bf16"


# Where the installed torchrun lacks one of these flags, the run gets its behaviour this way.
TORCHRUN_FALLBACKS = {
    "shutdown_timeout": (
        "the supervisor: when torchrun is signalled it gives the ranks the profile's "
        "shutdown_grace_s after torchrun's SIGTERM, then SIGKILLs them"
    ),
    "monitor_interval": "torchrun's default interval (a rank's exit is seen later)",
    "signals_to_handle": (
        "not provided: torchrun handles its default signals (SIGTERM, SIGINT, SIGHUP, "
        "SIGQUIT); SIGUSR1 it holds either way"
    ),
}


def torchrun_argv(
    run_dir: Path, profile: Profile, placement: Placement, nodes: Nodes | None = None
) -> list[str]:
    """torchrun's command line: an argument list, never a shell string.

    One machine: the rendezvous endpoint's port is 0, so the agent's store binds a free port
    itself (as ``torchrun --standalone`` does). A port picked here and bound there a second
    later could be taken in between (by any process's outgoing connection: it is in the
    ephemeral range); the agent then connects to a stranger's socket and fails its rendezvous.

    Only flags the installed torchrun accepts, in its parser's spelling; one it lacks is left
    out where :data:`TORCHRUN_FALLBACKS` provides its behaviour another way.
    """
    # Absolute: a resume's torchrun starts in the run's own launch directory, which may not
    # be the console's (--resume runs/X from elsewhere).
    run_dir = run_dir.absolute()
    d = profile.distributed
    if nodes is None:
        where = [("nnodes", "1"), ("rdzv_endpoint", "127.0.0.1:0"), ("rdzv_id", run_dir.name)]
    else:
        where = [("nnodes", nodes.nnodes)]
        if nodes.node_rank is not None:
            where.append(("node_rank", str(nodes.node_rank)))
        where += [("rdzv_endpoint", nodes.endpoint), ("rdzv_id", nodes.rdzv_id)]
    wanted = [
        *where,
        ("nproc_per_node", str(placement.nproc)),
        ("rdzv_backend", "c10d"),
        ("max_restarts", str(d.max_restarts)),
        # torchrun's default: a rank's exit (the run's end, a crash) is seen within 0.1 s.
        ("monitor_interval", "0.1"),
        # On SIGTERM torchrun forwards the signal and SIGKILLs the ranks after this long
        # (default 30 s): give them the profile's grace period to write their checkpoint.
        ("shutdown_timeout", str(math.ceil(d.shutdown_grace_s))),
        ("signals_to_handle", TORCHRUN_SIGNALS),
        # Per-rank files; without them ranks' lines interleave mid-line.
        ("log_dir", str(run_dir / "logs")),
        ("tee", "3"),
    ]
    options = torchrun.accepted_options()
    flags = []
    for dest, value in wanted:
        flag = options.flag(dest, "--" + dest.replace("_", "-"))
        if flag is not None:
            flags.append(f"{flag}={value}")
        elif dest not in TORCHRUN_FALLBACKS:
            raise LaunchError(
                f"torchrun (torch {_version('torch')}) has no --{dest.replace('_', '-')}, "
                "which gpu-console needs: install a newer torch"
            )
    module = options.flag("module", "--module") or "--module"
    return [
        sys.executable,
        "-m",
        "gpu_console.quick_exit",  # torchrun, without its interpreter's teardown at the end
        "torch.distributed.run",
        *flags,
        module,
        "gpu_console.engine",
        str(run_dir),
    ]


def torchrun_compat() -> dict[str, object]:
    """For meta.json: the flags left out for the installed torchrun, and who does their job."""
    options = torchrun.accepted_options()
    dropped = {
        "--" + dest.replace("_", "-"): how
        for dest, how in TORCHRUN_FALLBACKS.items()
        if options.flag(dest, dest) is None
    }
    return {"dropped": dropped, "detection_error": options.error or None}


def worker_env(placement: Placement) -> dict[str, str]:
    env = dict(os.environ)
    # Sharing the rendezvous store with the workers makes restarts hang or fail here.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if placement.device_type == "cuda":
        # The mask names GPUs by UUID (a subset of the user's grant, never wider): exact
        # whatever CUDA's order; PCI_BUS_ID keeps any index a tool reads equal to NVML's.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices or ""
    env.pop(RANK_DEVICES, None)
    if placement.per_rank:  # MIG: a mask of its own for each rank (engine/__main__.py)
        env[RANK_DEVICES] = placement.cuda_visible_devices or ""
    if placement.device_type != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
        # A thread count the user set stands; torchrun would otherwise set 1.
        env.setdefault("OMP_NUM_THREADS", str(placement.cpu_threads_per_rank()))
    # train.compile's kernels outlive the run, so a restart or --resume reuses them; never
    # /tmp (torch's default, which a reboot or a tmp cleaner empties). A user's own stands.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    return env


def inductor_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/gpu-console/inductor`` (default ``~/.cache/gpu-console/inductor``)."""
    return torchrun.cache_dir() / "inductor"


def resume_target(arg: str, runs_dir: Path, hold: bool = True) -> tuple[Path, Path, int, str]:
    """``--resume RUN``: the run, its checkpoint to resume from (LATEST's, else the newest
    complete one that looks loadable: runs.resume_checkpoint), that checkpoint's step, and
    the line saying why it is not LATEST's ("" when it is).

    Refused (nothing written) when RUN is not a run, has no complete checkpoint, or may
    still be live: its status cannot be read, another session holds its lock
    (:mod:`.session_lock`), or one of its processes is still alive. The lock is taken here,
    before anything is written, and kept (:func:`held_lock`) until :func:`continue_run`
    hands it to the new supervisor: two resumes at the same instant cannot both pass.
    A run whose supervisor died unrecorded is recorded ``lost`` once it continues
    (:func:`continue_run`, :mod:`.lost`): its ``history/status-N.json`` says how it ended.

    ``hold=False`` (several nodes: each makes a run directory of its own, the run is only
    read): the lock is let go once the checks are made, so every node's console can check the
    same run at the same time (a requeued job's nodes all start at once).
    """
    try:
        run = runs.find_run(arg, runs_dir)
    except runs.RunDirError as e:
        raise LaunchError(f"--resume: {e}") from None
    status = _resume_status(run)
    legacy = not (run / session_lock.LOCK).exists()
    if legacy:
        _refuse_live(run, status)  # a run made before the lock: only its pids can tell
    try:
        lock = session_lock.take(run)
    except session_lock.RunLockedError:
        # Another session holds it: its own launch, or a resume that took it a moment ago
        # (after a lost supervisor, two resumes meet here). Stopping it would end that
        # session, maybe the resume that just won: the safe advice is to watch it.
        state = _resume_status(run).get("state")
        now = f" (state {state})" if state and state != "lost" else ""
        raise LaunchError(
            f"--resume: {run}: another session is continuing it now{now}; "
            f"watch it with gpu-console attach {run}"
        ) from None
    try:
        _refuse_live(run, _resume_status(run))  # again, under the lock
        _room_to_continue(run)
        found = _resume_point(run)
    except BaseException:
        _drop(lock, legacy)
        raise
    if not hold:
        _drop(lock, legacy)
        return found
    _held[run.resolve()] = (lock, legacy)
    return found


# ``--resume auto``: the run this SLURM job (or --exact-name's directory) started, if any.
RESUME_AUTO = "auto"


def auto_resume(runs_dir: Path, name: str | None, exact_name: bool) -> tuple[str | None, str]:
    """What ``--resume auto`` continues (None: nothing yet, a new run) and the line that says
    so. Under SLURM: the newest run whose sessions ran in this job (a requeued job keeps its
    id) and that has a checkpoint to resume from; else ``--exact-name``'s directory if it
    exists. The same command thus starts a job's run and continues it after each requeue."""
    job = slurm.job()
    if job is not None:
        mine = []
        for run, meta in _run_metas(runs_dir):
            sessions = meta.get("sessions") if isinstance(meta.get("sessions"), list) else []
            if any(
                isinstance(s, dict) and (s.get("slurm") or {}).get("job_id") == job.job_id
                for s in sessions
            ):
                mine.append((meta.get("created") or 0, run))
        for _, run in sorted(mine, key=lambda c: c[0], reverse=True):
            if runs.resume_checkpoint(run)[0] is not None:
                return str(run), f"--resume auto: {run.name}, the run of SLURM job {job.job_id}"
        why = "its run has no checkpoint yet" if mine else "no run of it yet"
        return None, f"--resume auto: SLURM job {job.job_id}: {why}; a new run"
    if exact_name and name:
        if (Path(runs_dir) / name).is_dir():
            return name, f"--resume auto: {name}"
        return None, f"--resume auto: no run {name} yet; a new run"
    raise LaunchError(
        "--resume auto: continues the run of this SLURM job (SLURM_JOB_ID), or the run "
        "--exact-name --name NAME names; there is neither here (give the run: --resume RUN)"
    )


def _exact_name(name: str | None, runs_dir: Path, resume: str | None, nodes) -> None:
    """``--exact-name``: the run directory is ``runs_dir/NAME`` itself, so NAME must be one
    as it stands, and free; a resume keeps its own directory, several nodes make one each."""
    if resume is not None:
        raise LaunchError("--exact-name: a resumed run keeps its own directory; leave it out")
    if not name:
        raise LaunchError("--exact-name: give the run's name with --name NAME")
    if nodes is not None and nodes.max_nodes > 1:
        raise LaunchError(
            "--exact-name: one machine only (each node of a run makes a run directory of its own)"
        )
    if problem := runs.exact_name_problem(name):
        raise LaunchError(f"--name: {problem}")
    if (Path(runs_dir) / name).exists():
        raise LaunchError(
            f"--name: {Path(runs_dir) / name} already exists; --exact-name never reuses a "
            f"directory (continue it with --resume {name}, or pick another name)"
        )


def _room_to_continue(run: Path) -> None:
    """Refused before anything is written (the lock's pid included): a full disk."""
    if full := diskfull.short_of_room(run, diskfull.SESSION_ROOM):
        raise runs.RunDirError(f"{run}: cannot continue the run: {full}; free some first")


def _room_to_start(runs_dir: Path) -> None:
    """A new run is refused on a full disk as a resume is (the same room: what a session
    writes before its first checkpoint), before its run directory is made."""
    if full := diskfull.short_of_room(runs_dir, diskfull.SESSION_ROOM):
        raise runs.RunDirError(f"{runs_dir}: cannot start a run: {full}; free some first")


def _drop(lock: session_lock.SessionLock, created: bool) -> None:
    """A refused resume leaves the run as it found it: a lock file it created goes too."""
    if created:
        with contextlib.suppress(OSError):
            os.unlink(lock.run_dir / session_lock.LOCK)
    lock.release()


def release_resumes() -> None:
    """Resumes prepared in this process that will not start (a later check failed)."""
    while _held:
        _drop(*_held.pop(next(iter(_held))))


# The session locks this process took for a resume, by run (and whether it made the lock
# file): handed to the run's new supervisor by continue_run.
_held: dict[Path, tuple[session_lock.SessionLock, bool]] = {}


def held_lock(run: Path) -> tuple[session_lock.SessionLock, bool] | None:
    """The lock :func:`resume_target` took for ``run`` in this process, and whether it made
    the lock file (handed over once)."""
    return _held.pop(Path(run).resolve(), None)


def _resume_status(run: Path) -> dict:
    """status.json of a run to resume ({} when absent); refused when it cannot be read."""
    status_path = run / runs.STATUS
    if not status_path.exists():
        return {}
    try:
        status = json.loads(status_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "not valid JSON"
        raise LaunchError(
            f"--resume: {status_path}: cannot be read ({why}); "
            "cannot tell whether the run is still live"
        ) from None
    if not isinstance(status, dict):
        raise LaunchError(
            f"--resume: {status_path}: not a JSON object; cannot tell whether the run is still live"
        )
    return status


def _still_live(run: Path, state: object) -> LaunchError:
    return LaunchError(
        f"--resume: {run}: the run is still live (state {state}); "
        f"stop it first (gpu-console stop {run})"
    )


def _refuse_live(run: Path, status: dict) -> None:
    """Not recorded as over: over only if none of its processes is left (a lost run)."""
    if status.get("ended"):
        return
    if lost.live_pids(status):
        raise _still_live(run, status.get("state"))


def _resume_point(run: Path) -> tuple[Path, Path, int, str]:
    """The checkpoint to resume from (LATEST's, else the newest complete one that looks
    loadable: runs.resume_checkpoint), its step, and why it is not LATEST's ("" when it is);
    refused without one."""
    if not os.access(run, os.W_OK | os.X_OK):
        raise LaunchError(f"--resume: {run}: not writable (a resumed run continues in it)")
    ckpt, note = runs.resume_checkpoint(run)
    if ckpt is None:
        raise LaunchError(f"--resume: {run}: {note or 'has no complete checkpoint to resume from'}")
    meta = runs.read_json(ckpt / "meta.json")
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LaunchError(f"--resume: {ckpt / 'meta.json'}: no step in it (got {show(step)})")
    return run, ckpt, step, note


def resumed_name(run: Path) -> str:
    """The name a run was launched under (:func:`runs.given_name`), else its directory's."""
    return runs.given_name(run) or run.name


def run_cwd(run: Path) -> str | None:
    """Where the run was first launched: a user task's module is found from there again."""
    meta = runs.read_json(run / "meta.json")
    cwd = meta.get("cwd") if isinstance(meta, dict) else None
    return cwd if isinstance(cwd, str) and os.path.isdir(cwd) else None


def _launch_checks(fn):
    """A launch refused after its resume's session lock was taken lets the lock go; a user
    task's key-check subprocess ends, whatever happened (refused before its data count, or
    done)."""

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException:
            release_resumes()
            raise
        finally:
            while _task_processes:
                _task_processes.pop().close()

    return checked


@_launch_checks
def prepare(
    profile_arg: str | None,
    *,
    devices: str | None = None,
    precision: str | None = None,
    overrides: list[str] | None = None,
    resume: str | None = None,
    runs_dir: Path,
    name: str | None = None,
    nodes: Nodes | None = None,
    build_data: bool = True,
    exact_name: bool = False,
) -> tuple[Profile, Placement, Path | None]:
    """Everything that can be wrong with a launch, checked before anything is written: the
    one list of checks ``--dry-run`` makes too (``nodes``: the world is every node's ranks).

    ``build_data=False``: a user task's data sets are not built here, because the caller
    builds them next and applies the same rule (``--dry-run``'s plan: engine/plan.py).

    A resume's session lock (:func:`resume_target`) is held from the first check on; a
    launch refused later lets it go."""
    auto_note = ""
    if resume == RESUME_AUTO:
        resume, auto_note = auto_resume(runs_dir, name, exact_name)
        exact_name = exact_name and resume is None  # a run found continues in its directory
    if exact_name:  # before a resume's lock is taken
        _exact_name(name, runs_dir, resume, nodes)
    if resume is None:
        _room_to_start(runs_dir)
    resume_from = resume_run = None
    resume_note = ""
    resume_step = 0
    if resume is not None:
        several = nodes is not None and nodes.max_nodes > 1
        resume_run, resume_from, resume_step, resume_note = resume_target(
            resume, runs_dir, hold=not several
        )
        if profile_arg is None:
            _intact_run_toml(resume_run)  # the profile it continues with: said as damaged
            profile_arg = str(resume_run / "run.toml")
    if profile_arg is None:
        raise LaunchError("PROFILE: give a profile name or file (or --resume RUN)")
    sets = list(overrides or [])
    flags = {}
    if devices is not None:
        sets.append(f"hardware.devices={json.dumps(devices)}")
        flags["hardware.devices"] = "--devices"
    if precision is not None:
        sets.append(f"train.precision={json.dumps(precision)}")
        flags["train.precision"] = "--precision"
    source = str(find_profile(profile_arg))
    set_keys = {s.split("=")[0].strip() for s in overrides or []}

    def bad(key: str, problem: str, value: object) -> LaunchError:
        """A problem with a resolved value, blamed on where that value came from."""
        origin = flags.get(key) or ("--set" if key in set_keys else source)
        return LaunchError(f"{origin}: {key}: {problem} (got {show(value)})")

    if resume_run is not None:
        _intact_run_toml(resume_run)  # what a resume is compared against, and continues with
        _same_task_kind(resume_run, profile_arg, sets, bad)  # before its keys are judged
    profile = load_profile(profile_arg, sets)
    if auto_note:
        profile.notes.append(auto_note)
    task_cwd = None
    if resume_run is not None:
        # The run continues in its own directory, under its own name and its profile's.
        run_name = resumed_name(resume_run)
        if name and name != run_name:
            raise LaunchError(
                f"--name: a resumed run continues in its own directory under its own name "
                f"({run_name}); leave --name out (got {name!r})"
            )
        profile.run_name = run_name
        profile.profile.name = runs.profile_name(resume_run) or profile.profile.name
        task_cwd = run_cwd(resume_run)
        if resume_note:  # said at launch; the engine's resume line says it again (loop.py)
            profile.notes.append(f"--resume: {resume_run.name}: {resume_note}")
    elif name:
        if "/" in name or "\0" in name:
            # RUN arguments with a separator are paths (runs.find_run): such a name could
            # never find its run again.
            raise LaunchError(f"--name: a run's name cannot hold '/' (got {name!r})")
        profile.run_name = name
    if profile.logging.tensorboard and not tensorboard.available():
        profile.notes.append(tensorboard.off_note())
    if profile.logging.wandb and not _importable("wandb"):
        profile.notes.append(
            "W&B: off, the wandb package is not installed (pip install wandb); the run trains"
        )
    # Resolved now, judged at its place below: a user task's one subprocess also counts its
    # data, for which it needs the ranks' world.
    wrong_devices = None
    try:
        placement = resolve_placement(profile.hardware.devices, profile.hardware.oversubscribe)
        world = placement.nproc * (nodes.max_nodes if nodes else 1)
    except DeviceSpecError as e:
        placement, world, wrong_devices = None, 0, e
    count_for = (placement, world) if build_data and placement is not None else None
    profile, task = check_user_task(
        profile, source, set_keys | set(flags), cwd=task_cwd, count_for=count_for
    )
    if resume_run is not None:
        _keep_chosen_batch(profile, resume_run)
        # A changed [task] key: refused where the checkpoint's model does not load into the
        # one it builds (or its task's resume_keys says so), else a warning naming it.
        no = refused(resume_changes(profile, resume_run, None, bad))
        if no:
            more = f"; also {', '.join(c.key for c in no[1:])}" if no[1:] else ""
            first = no[0]
            raise bad(
                first.key, f"a resumed run cannot change it (was {show(first.old)}): "
                f"{first.why}{more}", first.new,
            )  # fmt: skip
    if placement is None:
        raise bad("hardware.devices", str(wrong_devices), profile.hardware.devices) from None
    if placement.per_rank and placement.nproc > 1 and profile.distributed.backend == "nccl":
        raise bad(
            "distributed.backend",
            f"NCCL does not run across MIG instances ({placement.nproc} granted); use gloo "
            "(auto picks it there) or one MIG instance",
            "nccl",
        )
    if placement.device_type == "cpu" and profile.distributed.sync_batchnorm is True:
        raise bad(
            "distributed.sync_batchnorm",
            "SyncBatchNorm runs only on GPUs; this run is on CPU",
            True,
        )
    instead = {"fp16": "use bf16 or fp32 on CPU", "bf16": "use auto (fp16 there) or fp32"}
    if why := precision_refusal(placement, profile.train.precision):
        prec = profile.train.precision
        raise bad("train.precision", f"{why}; {instead[prec]}", prec)
    if profile.train.optimizer_impl == "fused" and not fused_steps_ok(
        profile.distributed.strategy,
        precision_of(placement, profile.train.precision),
        placement.device_type,
    ):
        raise bad(
            "train.optimizer_impl", f"{FUSED_UNDER_SHARDED_SCALER}; use auto or foreach", "fused"
        )
    # What a built-in task refuses once the world is known (moe: its experts over the
    # ranks; cvrp: a sharded policy).
    judge = getattr(profile.task, "launch_problem", None)
    if callable(judge) and (problem := judge(world, profile)):
        raise bad(*problem)
    samples = check_data(profile, placement, world, task_cwd or os.getcwd(), bad, build_data, task)
    if build_data or samples is not None:  # else --dry-run's plan turns them into steps
        epochs_to_steps(profile, samples, world, bad)
    if resume_run is not None and not any(getattr(profile.train, k) for k in IN_EPOCHS):
        steps_left(resume_run, resume_step, profile.train.max_steps, bad)  # else --dry-run's
    if resume_run is not None and resume_from is not None:
        stopped_early(resume_run, resume_from, profile.train)
    return profile, placement, resume_from


# How long a launch waits for a user task's data sets to check their size (batching.py);
# $GPU_CONSOLE_DATA_CHECK_S sets it (tests).
DATA_CHECK_S = 20.0


def data_check_s() -> float:
    try:
        return max(0.1, float(os.environ.get("GPU_CONSOLE_DATA_CHECK_S", DATA_CHECK_S)))
    except ValueError:
        return DATA_CHECK_S


def check_data(
    profile: Profile,
    placement: Placement,
    world: int,
    cwd: str,
    bad,
    build: bool = True,
    task=None,
) -> int | None:
    """``data.batch_size`` against the training set (batching.py), as the ranks would judge it
    after launch. A built-in task's size is a key of its own; a user task's data sets are
    built once by the engine's own code in a subprocess (the console never imports torch),
    unless ``build`` is False; ``task``: the key check's subprocess (``dry_run.TaskProcess``),
    which counts them in place of a new one. The training set's size, where it was found."""
    samples = getattr(profile.task, "train_samples", None)
    size = getattr(profile.task, "train_size", None)
    if profile.task_kind in BUILTIN and callable(size):
        # Counted here, torch-free (a text file's size: tasks/text_data.py), so the verdict
        # never waits on a subprocess that a busy machine makes late; in the ranks' directory.
        try:
            samples = size(cwd)
        except KeyProblem as e:
            raise bad(e.key, e.why, e.value) from None
    if profile.task_kind not in BUILTIN or not isinstance(samples, int):
        if not build:
            return None
        from .dry_run import DataSize, PlanTimeout, engine_plan

        if task is not None:
            count = task.count(profile, data_check_s())
        else:
            try:
                answer = engine_plan(
                    profile, placement, world, cwd, only="data", timeout_s=data_check_s()
                )
                count = DataSize(samples=answer["train_samples"])
            except PlanTimeout as e:
                count = DataSize(late=str(e))
        if count.late:
            # A data set that takes minutes to load must not hold (or refuse) the launch
            # twice over: the ranks apply the same rule once they have built it.
            profile.notes.append(
                f"data.batch_size: not checked before launch ({count.late}); the ranks check it"
            )
            return None
        if count.error:
            raise LaunchError(count.error)
        samples = count.samples
    if problem := batch_problem(samples, world, profile.data.batch_size, profile.data.drop_last):
        raise bad("data.batch_size", problem, profile.data.batch_size)
    return samples


def _keep_chosen_batch(profile: Profile, run: Path) -> None:
    """``data.batch_size = "auto"`` on a resume: the size the run chose at its start (its
    run.toml holds the number), not a new search."""
    from .profile import parse_toml

    if profile.data.batch_size != "auto":
        return
    try:
        data = parse_toml(run / "run.toml").get("data")
    except ProfileError:
        return
    chosen = data.get("batch_size") if isinstance(data, dict) else None
    if isinstance(chosen, int) and not isinstance(chosen, bool) and chosen > 0:
        profile.data.batch_size = chosen
        profile.notes.append(f"data.batch_size = auto: {chosen}, as {run.name} chose at its start")


def _importable(name: str) -> bool:
    """Whether a package can be imported (looked up, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# Every run.toml a launch writes (Profile.to_toml) has these tables, and task.kind.
RUN_TOML_TABLES = ("profile", "task", "data", "train", "distributed", "checkpoint", "hardware")


def _intact_run_toml(run: Path) -> None:
    """A run.toml that is not what a launch wrote (cut short, edited into another shape) says
    so in one line: compared key by key it would list every key as a change from None."""
    from .profile import parse_toml

    path = run / "run.toml"
    try:
        data = parse_toml(path)
    except ProfileError as e:
        why = "missing" if not path.exists() else e.problems[0].removeprefix(f"{path}: ")
    else:
        missing = [t for t in RUN_TOML_TABLES if not isinstance(data.get(t), dict)]
        task = data.get("task")
        if missing:
            tables = ", ".join(f"[{t}]" for t in missing)
            why = f"no {tables} table{'s' if missing[1:] else ''}"
        elif not isinstance(task.get("kind"), str):
            why = "no task.kind"
        else:
            return
    copies = sorted(
        (p for p in (run / "history").glob("run-*.toml") if p.stem[4:].isdigit()),
        key=lambda p: int(p.stem[4:]),
    )
    fix = f"restore it from {copies[-1]}" if copies else "restore it from a backup"
    what = "is missing" if why == "missing" else f"is damaged ({why})"
    raise LaunchError(f"--resume: {path} {what}; {fix}, or start a new run")


def _same_task_kind(run: Path, profile_arg: str, sets: list[str], bad) -> None:
    """Another task (another profile's, or ``--set task.kind``): one line, before the new
    task's keys are checked against the old task's (which would name each of them)."""
    from .profile import apply_overrides, parse_toml

    def kind(data: dict) -> object:
        task = data.get("task")
        return task.get("kind", "mlp") if isinstance(task, dict) else "mlp"

    try:
        old = kind(parse_toml(run / "run.toml"))
    except ProfileError:
        return  # nothing to compare with (resume_changes says the same)
    new = kind(apply_overrides(parse_toml(find_profile(profile_arg)), sets)[0])
    if new != old:
        raise bad(
            "task.kind",
            f"{run.name} trained task {show(old)}: a resumed run keeps its task and model; "
            "start a new run, or resume without PROFILE",
            new,
        )


def steps_left(run: Path, step: int, max_steps: int, bad) -> None:
    """A run whose newest checkpoint is at (or past) max_steps has nothing left to train."""
    if not max_steps:  # until stopped
        return
    if step == max_steps:
        raise LaunchError(
            f"--resume: {run}: already at max_steps {step}; raise train.max_steps to continue "
            "(--set train.max_steps=N)"
        )
    if step > max_steps:
        raise bad(
            "train.max_steps",
            f"{run.name} is already at step {step}; raise it above {step} to continue",
            max_steps,
        )


def stopped_early(run: Path, checkpoint: Path, train) -> None:
    """A run whose checkpoint ended it by early stopping (engine/early_stop.py, recorded in
    its meta.json) would stop again at its next eval with the same settings: refused, saying
    what lets it train on (a larger patience, another metric, or early stopping off)."""
    meta = runs.read_json(Path(checkpoint) / "meta.json") or {}
    rec = meta.get("early_stop")
    if not isinstance(rec, dict) or not rec.get("stopped") or not train.early_stop_metric:
        return
    if (rec.get("metric"), rec.get("mode")) != (
        train.early_stop_metric,
        train.early_stop_direction(),
    ):
        return  # another judge: a new count
    stale = rec.get("stale")
    if not isinstance(stale, int) or stale < train.early_stop_patience:
        return
    best = rec.get("best")
    known = type(best) in (int, float)
    shown = f", best {best:.6g} at step {rec.get('best_step')}" if known else ""
    raise LaunchError(
        f"--resume: {run}: stopped early at step {meta.get('step')} ({rec.get('metric')} did "
        f"not improve for {stale} evals{shown}); to train on, raise "
        f"train.early_stop_patience above {stale} (--set train.early_stop_patience=N) or turn "
        "early stopping off (--set train.early_stop_metric='')"
    )


def resume_changes(profile: Profile, run: Path, world_size: int | None, bad=None) -> list:
    """What resuming ``run`` with ``profile`` on ``world_size`` ranks changes, each classified
    (resume_changes.TABLE): against its run.toml and the world size of its last session
    (``world_size`` None: not compared, as before the devices are placed). A changed
    ``[task]`` key is judged by the model it builds (resume_model.py, once per process);
    a model that cannot be built is ``bad``'s one line (else a LaunchError's)."""
    from . import resume_model
    from .profile import parse_toml
    from .resume_changes import classify

    try:
        old = parse_toml(run / "run.toml")
    except ProfileError:
        return []  # a run without a readable run.toml: nothing to compare with
    meta = runs.read_json(run / "meta.json")
    world = runs.current_session(meta).get("world_size") if isinstance(meta, dict) else None
    new = profile.to_dict()
    changes = classify(old, new, world if isinstance(world, int) else None, world_size)
    try:
        return resume_model.judged(changes, run, new, run_cwd(run))
    except resume_model.ModelCheckError as e:
        if bad is not None:
            raise bad(e.key, e.problem, e.value) from None
        why = f"--resume: {run.name}: {e.key}: {e.problem} (got {show(e.value)})"
        raise LaunchError(why) from None


def start(
    profile: Profile,
    placement: Placement,
    runs_dir: Path,
    resume_from: Path | None = None,
    argv: list[str] | None = None,
    nodes: Nodes | None = None,
    launched: float | None = None,
    exact_name: bool = False,
) -> Launched:
    """Create the run directory, write run.toml and meta.json, start the supervisor.

    ``launched``: when the command started (its process's start; default now), which the
    start event's stage times count from (:mod:`.timings`).

    ``--resume`` on one machine continues in the resumed run's own directory (its
    ``checkpoints/<step>`` names it), wherever ``runs_dir`` points: see :func:`continue_run`.
    On several nodes each node's console makes a run directory of its own, as at launch.
    """
    if resume_from is not None and nodes is None:
        return continue_run(
            profile, placement, resume_from.parent.parent, resume_from, argv, launched
        )
    release_resumes()  # several nodes: a run directory of its own, with a lock of its own
    if nodes is not None and nodes.node_rank not in (None, 0) and (job := slurm.job()):
        wait_for_head(runs_dir, job)
    changes = []
    if resume_from is not None:
        world = placement.nproc * (nodes.max_nodes if nodes else 1)
        changes = resume_changes(profile, resume_from.parent.parent, world)
    name = profile.run_name or profile.profile.name or "run"
    run_dir = runs.create_run_dir(runs_dir, name, exact_name)
    lock = None
    try:
        # Before the run is one (run.toml makes it so): its session holds it from the start.
        lock = session_lock.take(run_dir, "run")
        lock.claim(os.getpid())
        runs.atomic_write_text(run_dir / "run.toml", profile.to_toml())
        session = _session(
            run_dir, profile, placement, resume_from, argv, nodes, os.getcwd(), launched
        )
        session["changes"] = [c.as_dict() for c in changes]
        meta = {
            "id": run_dir.name,
            "name": name,  # the run's own: run.toml's [profile] name is the profile's
            "command": session["command"],
            "cwd": session["cwd"],
            "host": session["host"],
            "user": getpass.getuser(),
            "created": session["started"],
            "versions": session["versions"],
            "placement": session["placement"],
            "world_size": session["world_size"],
            "nodes": session["nodes"],
            "resume_from": session["resume_from"],
            "torchrun": session["torchrun"],
            "sessions": [session],
            "torchrun_compat": session["torchrun_compat"],
        }
        runs.atomic_write_json(run_dir / "meta.json", meta)
        proc = spawn_supervisor(run_dir, placement, lock)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()  # the supervisor holds it now (or the run is gone)
    return Launched(run_dir, proc, placement)


HEAD_WAIT_S = 600.0


def wait_for_head(runs_dir: Path, job: slurm.Job, timeout_s: float = HEAD_WAIT_S) -> None:
    """A SLURM job's other nodes write nothing until the head node has started its run: the
    head makes checks no other node can (its rendezvous port), and a job it refuses must
    leave no run behind on any node (``srun --kill-on-bad-exit`` ends the others while they
    wait here). The head's run is in the shared runs directory (docs/clusters.md): a run
    whose latest session is this job's start on node 0."""
    deadline = time.monotonic() + timeout_s
    while not _head_started(runs_dir, job):
        if signal.SIGTERM in held_signals.pending():
            raise LaunchError(
                f"SLURM job {job.job_id}, node {job.node_id}: cancelled (SIGTERM) while waiting "
                "for the head node's run; nothing written"
            )
        if time.monotonic() > deadline:
            raise LaunchError(
                f"SLURM job {job.job_id}, node {job.node_id}: the head node (node 0) started no "
                f"run in {runs_dir} within {timeout_s:.0f} s: it refused (its output says why), "
                "or that directory is not shared by the job's nodes (it must be: "
                "docs/clusters.md); nothing written"
            )
        time.sleep(0.5)


def _head_started(runs_dir: Path, job: slurm.Job) -> bool:
    head = {**job.fields(), "node_id": 0}
    for _, meta in _run_metas(runs_dir):
        started = runs.current_session(meta).get("slurm")
        if isinstance(started, dict) and all(
            started.get(k) == head[k] for k in ("job_id", "node_id", "restart_count")
        ):
            return True
    return False


def _run_metas(runs_dir: Path) -> Iterator[tuple[Path, dict]]:
    """Each run directory under ``runs_dir`` with a readable meta.json, and that meta.json."""
    with contextlib.suppress(OSError):
        for run in Path(runs_dir).iterdir():
            with contextlib.suppress(OSError):
                meta = runs.read_json(run / "meta.json") if (run / "meta.json").is_file() else None
                if isinstance(meta, dict):
                    yield run, meta


def _session(
    run_dir: Path,
    profile: Profile,
    placement: Placement,
    resume_from: Path | None,
    argv: list[str] | None,
    nodes: Nodes | None,
    cwd: str,
    launched: float | None = None,
) -> dict:
    """One launch of a run: what meta.json's ``sessions`` records, and what it runs."""

    def size(name: str) -> int:
        try:
            return (run_dir / name).stat().st_size
        except FileNotFoundError:
            return 0

    started = time.time()
    return {
        "command": argv if argv is not None else sys.argv,
        "cwd": cwd,
        "host": socket.gethostname(),
        "launched": launched or started,  # the command's start (timings.py)
        "started": started,
        "versions": {
            "python": sys.version.split()[0],
            "torch": _version("torch"),
            "gpu_console": _version("gpu-console"),
        },
        "placement": {
            "device_type": placement.device_type,
            "nproc": placement.nproc,
            "cuda_visible_devices": placement.cuda_visible_devices,
            "gpus": list(placement.gpus),  # NVML indices; the mask names them by UUID
        },
        "world_size": placement.nproc * (nodes.max_nodes if nodes else 1),
        "nodes": (
            {"nnodes": nodes.nnodes, "node_rank": nodes.node_rank, "endpoint": nodes.endpoint}
            if nodes
            else None
        ),
        "resume_from": str(resume_from.resolve()) if resume_from else None,
        # The SLURM job this session ran in: --resume auto finds the job's run by it.
        "slurm": job.fields() if (job := slurm.job()) else None,
        "torchrun": torchrun_argv(run_dir, profile, placement, nodes),
        # Flags this torchrun lacks, left out, and who provides their behaviour instead.
        "torchrun_compat": torchrun_compat(),
        # Where this session's events and commands begin: its supervisor folds only its own
        # events, its engine acts only on commands sent after it was launched.
        "events_from": size("events.jsonl"),
        "control_from": size("control.jsonl"),
    }


def continue_run(
    profile: Profile,
    placement: Placement,
    run_dir: Path,
    resume_from: Path,
    argv: list[str] | None = None,
    launched: float | None = None,
) -> Launched:
    """A new session of an ended run, in its own directory (``prepare`` checked it is over).

    Nothing of the previous session is lost, and nothing of it is mistaken for the new one:
    its run.toml and status.json go to ``history/`` (``run-N.toml``, ``status-N.json``), its
    logs (torchrun's, the ranks', the supervisor's) to ``logs/session-N/``, which the
    failure diagnosis does not read; its heartbeats are removed (the new session may have
    fewer ranks). events.jsonl, control.jsonl, checkpoints/ and telemetry go on appending.
    """
    # The lock resume_target took (a caller that skipped it takes it now): first of all.
    lock, created = held_lock(run_dir) or (session_lock.take(run_dir), False)
    try:
        launched_run = _continue_run(profile, placement, run_dir, resume_from, lock, argv, launched)
    except BaseException:
        _drop(lock, created)  # refused: the run as it was found, a lock file made here gone
        raise
    lock.release()  # the supervisor holds it now
    return launched_run


def _continue_run(
    profile: Profile,
    placement: Placement,
    run_dir: Path,
    resume_from: Path,
    lock: session_lock.SessionLock,
    argv: list[str] | None,
    launched: float | None,
) -> Launched:
    meta = runs.read_json(run_dir / "meta.json")
    meta = meta if isinstance(meta, dict) else {"id": run_dir.name}
    sessions = meta.get("sessions")
    if not isinstance(sessions, list) or not sessions:
        # A run launched before sessions were recorded: its launch was the first session.
        keys = ("command", "cwd", "host", "versions", "placement", "world_size", "nodes")
        sessions = [{k: meta.get(k) for k in keys} | {
            "started": meta.get("created"),
            "resume_from": meta.get("resume_from"),
            "torchrun": meta.get("torchrun"),
        }]  # fmt: skip
    n = len(sessions)  # the session that ended
    _room_to_continue(run_dir)  # again: the disk may have filled since the checks
    lock.claim(os.getpid())  # the run is this session's from here on
    # A session whose supervisor died unrecorded: its end (lost) goes to history/ with it.
    lost.record_lost(run_dir)
    changes = resume_changes(profile, run_dir, placement.nproc)  # before run.toml is rewritten
    before = dict(meta)  # as it was (the sessions list is replaced below, not changed)
    try:
        history = run_dir / "history"
        history.mkdir(mode=0o700, exist_ok=True)
        _keep(run_dir / "run.toml", history / f"run-{n}.toml")
        if (run_dir / runs.STATUS).exists():
            _keep(run_dir / runs.STATUS, history / f"status-{n}.json")
        logs = run_dir / "logs"
        logs.mkdir(exist_ok=True)
        old_logs = logs / f"session-{n}"
        old_logs.mkdir(exist_ok=True)
        for entry in logs.iterdir():
            if not re.fullmatch(r"session-\d+", entry.name):
                os.replace(entry, old_logs / entry.name)
        shutil.rmtree(run_dir / "heartbeats", ignore_errors=True)
        runs.atomic_write_text(run_dir / "run.toml", profile.to_toml())
        cwd = run_cwd(run_dir) or os.getcwd()
        session = _session(run_dir, profile, placement, resume_from, argv, None, cwd, launched)
        # What changed against the session that ended, classified: the engine's start event
        # carries it, and it tells the engine the batch size an old checkpoint counted in.
        session["changes"] = [c.as_dict() for c in changes]
        meta["sessions"] = [*sessions, session]
        runs.atomic_write_json(run_dir / "meta.json", meta)
        # The new supervisor writes status.json from scratch; until it does, no reader may
        # take the previous session's end (state, exit code, failure) for this one's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(run_dir / runs.STATUS)
        proc = spawn_supervisor(run_dir, placement, lock)
    except BaseException as e:
        _undo_continue(run_dir, n, before)
        if not isinstance(e, OSError):
            raise
        why = diskfull.classify(e, run_dir) or e
        raise runs.RunDirError(f"{run_dir}: cannot continue the run ({why})") from None
    return Launched(run_dir, proc, placement)


def _undo_continue(run_dir: Path, n: int, meta: dict) -> None:
    """A session that could not start leaves the run as the last one ended it: its run.toml,
    status.json and meta.json back from what was kept (moved logs stay under session-N/)."""
    history = run_dir / "history"
    with contextlib.suppress(OSError):
        if (history / f"run-{n}.toml").is_file():
            _keep(history / f"run-{n}.toml", run_dir / "run.toml")
    with contextlib.suppress(OSError):
        if (history / f"status-{n}.json").is_file() and not (run_dir / runs.STATUS).exists():
            _keep(history / f"status-{n}.json", run_dir / runs.STATUS)
    with contextlib.suppress(OSError):
        runs.atomic_write_json(run_dir / "meta.json", meta)


def _keep(src: Path, dst: Path) -> None:
    """A copy into history/ that is whole or absent (a full disk cuts a plain copy short)."""
    runs.atomic_write_text(dst, src.read_text(encoding="utf-8"))


def spawn_supervisor(
    run_dir: Path, placement: Placement, lock: session_lock.SessionLock | None = None
) -> subprocess.Popen:
    """The supervisor gets a session of its own: a closed terminal never ends the run.

    ``lock``: the run's session lock, inherited by the supervisor alone (``pass_fds``; it
    keeps it from torchrun), which holds it until it exits; the caller then closes its copy.
    """
    log = open(run_dir / "logs" / "supervisor.log", "ab")  # noqa: SIM115 - handed to the child
    held = [] if lock is None else ["--lock-fd", str(lock.fd)]
    try:
        # It starts with the scheduler's signals held, until its handlers are in place.
        with held_signals.held_for_child():
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpu_console.supervisor", str(run_dir.absolute()), *held],
                pass_fds=() if lock is None else (lock.fd,),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=worker_env(placement),
                cwd=os.getcwd(),
            )
    finally:
        log.close()
    return proc


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None
