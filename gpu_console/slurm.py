"""SLURM, as a job's environment describes it: the job, its nodes, its rendezvous, requeue.

Read from ``SLURM_*`` (no torch). Two programs of SLURM's are called, and only here:
``scontrol show hostnames`` (a node list's hosts; python-hostlist expands the syntax when scontrol
is missing) and ``scontrol requeue`` (the supervisor, when the time-limit signal stopped a run).
Tests put fakes of them on ``PATH``: the boundary.

A job's nodes agree on the rendezvous without talking: its id is the job's, its port is
derived from the job id (two jobs on one head node never share one) and checked free on the
head node before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

# Below Linux's ephemeral range (32768-60999): a port the kernel hands out to some client
# connection never takes ours. Two jobs collide only if their ids are equal modulo the span.
PORT_BASE, PORT_SPAN = 20000, 10000
SCONTROL_TIMEOUT_S = 30.0
SIGNALS = {"USR1": signal.SIGUSR1, "TERM": signal.SIGTERM}


class SlurmError(Exception):
    """A SLURM environment gpu-console cannot run in as asked (one line)."""


@dataclass(frozen=True)
class Job:
    job_id: str
    nnodes: int
    node_id: int
    nodelist: str
    restart_count: int = 0  # SLURM_RESTART_COUNT: how often the job was requeued
    tasks_per_node: int | None = None  # SLURM_STEP_TASKS_PER_NODE inside srun

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}"

    @property
    def rdzv_port(self) -> int:
        return PORT_BASE + int(self.job_id) % PORT_SPAN

    def fields(self) -> dict[str, object]:
        """What meta.json's session records: ``--resume auto`` finds the job's run by it."""
        return {
            "job_id": self.job_id,
            "nnodes": self.nnodes,
            "node_id": self.node_id,
            "nodelist": self.nodelist,
            "restart_count": self.restart_count,
        }


def _int(value: str | None, default: int) -> int:
    m = re.match(r"\d+", value or "")
    return int(m.group()) if m else default


def job(env: Mapping[str, str] | None = None) -> Job | None:
    """The SLURM job this process runs in; None outside one (no ``SLURM_JOB_ID``)."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id or not job_id.isdigit():
        return None
    step_tasks = env.get("SLURM_STEP_TASKS_PER_NODE")
    return Job(
        job_id=job_id,
        nnodes=_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"), 1),
        node_id=_int(env.get("SLURM_NODEID"), 0),
        nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "",
        restart_count=_int(env.get("SLURM_RESTART_COUNT"), 0),
        # "8(x2)": 8 tasks on each of 2 nodes; the first count is this step's per node
        tasks_per_node=_int(step_tasks, 1) if step_tasks else None,
    )


def grant_text(env: Mapping[str, str]) -> str:
    """What the job has on this node, as SLURM says: ``8 CPUs, GPUs 0,1`` (the host's cores
    are not the job's)."""
    cpus = _int(env.get("SLURM_CPUS_ON_NODE"), 0)
    gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    parts = [f"{cpus} CPUs" if cpus else "CPUs not said (SLURM_CPUS_ON_NODE unset)"]
    if gpus:
        parts.append(f"GPUs {gpus}")
    elif n := _int(env.get("SLURM_GPUS_ON_NODE"), 0):
        parts.append(f"{n} GPUs")
    else:
        parts.append("no GPU")
    return ", ".join(parts)


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's host list syntax (``gpu[01-03,07],rack[1-2]-n[01-02]``) as hosts, in order,
    by python-hostlist (the syntax has corners: several brackets in one name, zero padding);
    a list it cannot read is a :class:`SlurmError` naming it."""
    import hostlist

    try:
        return list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as e:
        raise SlurmError(
            f"SLURM_JOB_NODELIST: cannot read {nodelist!r} as a host list ({e})"
        ) from None


def _scontrol(*args: str) -> subprocess.CompletedProcess:
    """``scontrol ARGS``; OSError when it is not on PATH (or cannot run)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise FileNotFoundError("scontrol is not on PATH")
    return subprocess.run(
        [scontrol, *args],
        capture_output=True,
        text=True,
        timeout=SCONTROL_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def hostnames(nodelist: str) -> list[str]:
    """The node list's hosts, as ``scontrol show hostnames`` gives them (it knows every
    site's syntax); expanded here when scontrol is not on PATH or fails."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = _scontrol("show", "hostnames", nodelist)
        hosts = proc.stdout.split()
        if proc.returncode == 0 and hosts:
            return hosts
    return expand_hostlist(nodelist)


def check_one_console_per_node(j: Job) -> None:
    """``srun --ntasks-per-node=8 gpu-console run`` would start eight consoles, each with its
    own ranks: torchrun starts the ranks; SLURM starts one console per node."""
    if j.tasks_per_node is not None and j.tasks_per_node > 1:
        raise SlurmError(
            f"SLURM starts {j.tasks_per_node} tasks per node in this step; gpu-console needs one "
            "per node (srun --ntasks-per-node=1), and its torchrun starts a rank per device"
        )


def port_free(port: int) -> bool:
    """Whether the rendezvous store can listen on ``port`` here (every address, as it does).

    SO_REUSEADDR as the store sets it: the last session's connections in TIME_WAIT (a
    requeued job back on the same head node) do not hold the port; a listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def node_address(name: str) -> str:
    """The address SLURM reaches node ``name`` at (its ``NodeAddr``): a site's node names
    need not resolve (``NodeName=gpu01 NodeAddr=10.1.0.1``). The name itself where scontrol
    cannot say."""
    try:
        proc = _scontrol("show", "node", name)
    except (OSError, subprocess.SubprocessError):
        return name
    m = re.search(r"\bNodeAddr=(\S+)", proc.stdout) if proc.returncode == 0 else None
    return m.group(1) if m else name


def head_endpoint(j: Job) -> str:
    """``HEAD:PORT`` of the job's rendezvous: the address of the node list's first node, the
    job's port. On the head node the port is checked free (another program may hold it)."""
    hosts = hostnames(j.nodelist) if j.nodelist else []
    if not hosts:
        raise SlurmError(
            "SLURM_JOB_NODELIST is empty, so the head node is unknown; give --rdzv-endpoint"
        )
    head = node_address(hosts[0])
    if j.node_id == 0 and not port_free(j.rdzv_port):
        raise SlurmError(
            f"port {j.rdzv_port} (job {j.job_id}'s rendezvous port) is in use on {hosts[0]}; "
            f"give another with --rdzv-endpoint {head}:PORT on every node"
        )
    return f"{head}:{j.rdzv_port}"


def requeue_signal(setting: str) -> int | None:
    """``cluster.requeue_signal`` as a signal number; None for ``none``."""
    return SIGNALS.get(setting)


def requeue(job_id: str) -> dict[str, object]:
    """``scontrol requeue JOB``: the job goes back to the queue (SLURM ends this allocation's
    processes and starts the batch script again later). What happened, for status.json."""
    command = ["scontrol", "requeue", job_id]
    out: dict[str, object] = {"job_id": job_id, "command": command, "t": time.time()}
    try:
        proc = _scontrol(*command[1:])
    except (OSError, subprocess.SubprocessError) as e:
        out.update(exit_code=None, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
        return out
    out["exit_code"] = proc.returncode
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        out["error"] = lines[-1] if lines else f"exit code {proc.returncode}"
    return out
