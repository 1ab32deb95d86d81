"""From a validated profile to a running supervisor: run directory, torchrun argv, spawn.

Nothing is written until every check has passed, and a failure after the run directory
exists removes it, so a user mistake never leaves a half-made run behind. No torch here.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import runs, torchrun
from .devices import DeviceSpecError, Placement, parse_devices, place
from .profile import Profile, ProfileError, find_profile, load_profile
from .schema import show
from .tasks import BUILTIN


class LaunchError(Exception):
    """A run that cannot start as asked (bad device, resume target, runs directory)."""


# torchrun's default (SIGTERM, SIGINT, SIGHUP, SIGQUIT) plus SIGUSR1, which SLURM sends
# before a time limit (`--signal=USR1@120`): without it SIGUSR1 kills torchrun outright.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# One rendezvous per endpoint: every node must give torchrun the same id.
MULTINODE_RDZV_ID = "gpu-console"


@dataclass(frozen=True)
class Nodes:
    """Several machines: the same command on every node, passed to torchrun unchanged."""

    nnodes: str  # "N", or "MIN:MAX" for an elastic range
    node_rank: int | None
    endpoint: str  # HOST:PORT of the c10d rendezvous

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


@dataclass
class Launched:
    run_dir: Path
    supervisor: subprocess.Popen
    placement: Placement


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_user_task(profile: Profile, source: str, overridden: set[str]) -> Profile:
    """Validate a user task's keys in a subprocess: its module may import torch."""
    if profile.task_kind in BUILTIN:
        return profile
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpu_console.tasks.check",
            profile.task_kind,
            json.dumps(profile.task),
        ],
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
        timeout=300,
    )
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        err = proc.stderr.strip().splitlines()[-1:] or ["no answer"]
        raise ProfileError(
            [f"{source}: task.kind: cannot load {profile.task_kind} ({err[0]})"]
        ) from None
    if answer["errors"]:
        raise ProfileError(
            [
                f"{'--set' if e.split(':')[0] in overridden else source}: {e}"
                for e in answer["errors"]
            ]
        )
    profile.task = answer["task"]
    return profile


def resolve_placement(devices: str) -> Placement:
    from .telemetry import nvml

    spec = parse_devices(devices)
    count = 0 if spec.kind == "cpu" else nvml.device_count()
    reason = "" if count else nvml.status().reason
    return place(spec, count, reason)


# Where the installed torchrun lacks one of these flags, the run gets its behaviour this way.
TORCHRUN_FALLBACKS = {
    "shutdown_timeout": (
        "the supervisor: when torchrun is signalled it gives the ranks the profile's "
        "shutdown_grace_s after torchrun's SIGTERM, then SIGKILLs them"
    ),
    "monitor_interval": "torchrun's default interval (a rank's exit is seen later)",
    "signals_to_handle": (
        "not provided: torchrun handles only its default signals (SIGUSR1 to torchrun ends it; "
        "signal the supervisor instead)"
    ),
}


def torchrun_argv(
    run_dir: Path, profile: Profile, placement: Placement, port: int, nodes: Nodes | None = None
) -> list[str]:
    """torchrun's command line: an argument list, never a shell string.

    Only flags the installed torchrun accepts, in its parser's spelling; one it lacks is left
    out where :data:`TORCHRUN_FALLBACKS` provides its behaviour another way.
    """
    d = profile.distributed
    if nodes is None:
        where = [("nnodes", "1"), ("rdzv_endpoint", f"127.0.0.1:{port}"), ("rdzv_id", run_dir.name)]
    else:
        where = [("nnodes", nodes.nnodes)]
        if nodes.node_rank is not None:
            where.append(("node_rank", str(nodes.node_rank)))
        where += [("rdzv_endpoint", nodes.endpoint), ("rdzv_id", MULTINODE_RDZV_ID)]
    wanted = [
        *where,
        ("nproc_per_node", str(placement.nproc)),
        ("rdzv_backend", "c10d"),
        ("max_restarts", str(d.max_restarts)),
        ("monitor_interval", "0.5"),
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
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the same indices as nvidia-smi and NVML
        env["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices or ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # A thread count the user set stands; torchrun would otherwise set 1.
        env.setdefault("OMP_NUM_THREADS", str(placement.cpu_threads_per_rank()))
    return env


def prepare(
    profile_arg: str | None,
    *,
    devices: str | None = None,
    precision: str | None = None,
    overrides: list[str] | None = None,
    resume: str | None = None,
    runs_dir: Path,
    name: str | None = None,
) -> tuple[Profile, Placement, Path | None]:
    """Everything that can be wrong with a launch, checked before anything is written."""
    resume_from = None
    if resume is not None:
        try:
            resume_run = runs.find_run(resume, runs_dir)
        except runs.RunDirError as e:
            raise LaunchError(f"--resume: {e}") from None
        resume_from = runs.latest_checkpoint(resume_run)
        if resume_from is None:
            raise LaunchError(f"--resume: {resume_run}: has no complete checkpoint to resume from")
        if profile_arg is None:
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

    profile = load_profile(profile_arg, sets)
    if name:
        profile.profile.name = name
    profile = check_user_task(profile, source, set_keys | set(flags))
    try:
        placement = resolve_placement(profile.hardware.devices)
    except DeviceSpecError as e:
        raise bad("hardware.devices", str(e), profile.hardware.devices) from None
    if placement.device_type == "cpu" and profile.distributed.sync_batchnorm:
        raise bad(
            "distributed.sync_batchnorm",
            "SyncBatchNorm runs only on GPUs; this run is on CPU",
            True,
        )
    if placement.device_type == "cpu" and profile.train.precision == "fp16":
        raise bad(
            "train.precision",
            "fp16 needs a GPU (its GradScaler is CUDA-only); use bf16 or fp32 on CPU",
            "fp16",
        )
    return profile, placement, resume_from


def start(
    profile: Profile,
    placement: Placement,
    runs_dir: Path,
    resume_from: Path | None = None,
    argv: list[str] | None = None,
    nodes: Nodes | None = None,
) -> Launched:
    """Create the run directory, write run.toml and meta.json, start the supervisor."""
    run_dir = runs.create_run_dir(runs_dir, profile.profile.name or "run")
    try:
        runs.atomic_write_text(run_dir / "run.toml", profile.to_toml())
        argv_torchrun = torchrun_argv(run_dir, profile, placement, free_port(), nodes)
        meta = {
            "id": run_dir.name,
            "command": argv if argv is not None else sys.argv,
            "cwd": os.getcwd(),
            "host": socket.gethostname(),
            "user": getpass.getuser(),
            "created": time.time(),
            "versions": {
                "python": sys.version.split()[0],
                "torch": _version("torch"),
                "gpu_console": _version("gpu-console"),
            },
            "placement": {
                "device_type": placement.device_type,
                "nproc": placement.nproc,
                "cuda_visible_devices": placement.cuda_visible_devices,
            },
            "world_size": placement.nproc * (nodes.max_nodes if nodes else 1),
            "nodes": (
                {"nnodes": nodes.nnodes, "node_rank": nodes.node_rank, "endpoint": nodes.endpoint}
                if nodes
                else None
            ),
            "resume_from": str(resume_from.resolve()) if resume_from else None,
            "torchrun": argv_torchrun,
            "torchrun_compat": torchrun_compat(),
        }
        runs.atomic_write_json(run_dir / "meta.json", meta)
        proc = spawn_supervisor(run_dir, placement)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return Launched(run_dir, proc, placement)


def spawn_supervisor(run_dir: Path, placement: Placement) -> subprocess.Popen:
    """The supervisor gets a session of its own: a closed terminal never ends the run."""
    log = open(run_dir / "logs" / "supervisor.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_console.supervisor", str(run_dir)],
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
