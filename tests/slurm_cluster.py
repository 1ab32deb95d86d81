"""A real SLURM on this machine, for the tests that need the scheduler itself.

Debian's ``slurm-wlm`` and ``munge``: one ``munged``, one ``slurmctld`` and one ``slurmd`` per
node, every daemon in the foreground and started here, with its own ports, socket, spool
and state under one temporary directory, so that two pytest workers can each run a cluster.
Several ``slurmd`` on one host make a several-node cluster on one machine (Debian builds
SLURM so): node ``n1`` and ``n2`` are the same host, reached at 127.0.0.1 (``NodeAddr``),
under names that do not resolve, as at many sites.

Settings a site would not use, and why:
- ``AuthInfo=cred_expire``: a requeued job waits ``cred_expire + 1`` s before it may start
  again (SLURM's default: 121 s); the tests set it low.
- ``SchedulerParameters=sched_interval``: how often pending jobs are looked at.
- ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups needed; the
  step's processes are the ones descended from its ``slurmstepd``, all signalled together
  as with cgroups.

Every daemon is ended by its pid; jobs are cancelled and waited for first, so no step of a
job outlives the cluster.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CRED_EXPIRE_S = 5  # a requeued job may start again this long (+1 s) after its requeue


def missing() -> str | None:
    """Why a real SLURM cannot run here (one line), or None."""
    absent = [d for d in DAEMONS if not _which(d)]
    if absent:
        return f"no real SLURM here ({', '.join(absent)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "no real SLURM here: its daemons need root (slurmd starts jobs as their user)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    """``nodes`` slurmd on this host, each offering ``cpus`` CPUs, one partition."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int | None = None):
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus or os.cpu_count() or 2
        self.procs: list[subprocess.Popen] = []
        ctld, *node_ports = _free_ports(1 + nodes)
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.env = {"SLURM_CONF": str(self.conf)}  # what SLURM's commands need (_env)
        (root / "munge").mkdir(parents=True)
        (root / "state").mkdir()
        (root / "spool").mkdir()
        (root / "log").mkdir()
        self.conf.write_text(self._conf_text(ctld, node_ports))

    def _conf_text(self, ctld_port: int, node_ports: list[int]) -> str:
        r = self.root
        host = socket.gethostname()
        lines = [
            "ClusterName=gctest",
            # A job's rendezvous port follows its id (slurm.rdzv_port): ids from a random
            # start, so that two clusters, or test_slurm.py's fake jobs, rarely share one.
            f"FirstJobId={random.randrange(100_000, 900_000)}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "MpiDefault=none",
            "JobRequeue=1",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=600",
            "InactiveLimit=0",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
        ]
        for name, port in zip(self.nodes, node_ports, strict=True):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=FORCE:4"
        )
        return "\n".join(lines) + "\n"

    # -- daemons -------------------------------------------------------------------------
    def start(self, deadline_s: float = 60.0) -> None:
        munge_dir = self.root / "munge"
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge_dir.chmod(0o755)
        self._daemon(
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--log-file={munge_dir / 'munged.log'}",
            f"--pid-file={munge_dir / 'munged.pid'}", f"--seed-file={munge_dir / 'seed'}",
        )  # fmt: skip
        self._wait(self.munge_socket.exists, deadline_s, "munged's socket")
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        for name in self.nodes:
            self._daemon("slurmd", "-D", "-N", name, "-f", str(self.conf))
        self._wait(self._nodes_idle, deadline_s, "every node idle")

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}-{len(self.procs)}.out", "wb")  # noqa: SIM115
        with log:
            self.procs.append(
                subprocess.Popen(
                    [_which(name) or name, *args],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    start_new_session=True,
                )  # fmt: skip
            )

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, deadline_s: float, what: str) -> None:
        end = time.monotonic() + deadline_s
        while not ready():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}: {self.logs()}")
            if time.monotonic() > end:
                raise TimeoutError(f"SLURM: no {what} after {deadline_s:.0f} s: {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, wait for their steps to end, then end the daemons by pid."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user", "root", check=False)
            end = time.monotonic() + 60
            while self.run("squeue", "-h", "-t", "R,CG", check=False).stdout.strip():
                if time.monotonic() > end:
                    break
                time.sleep(0.5)
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    # -- commands ------------------------------------------------------------------------
    def _env(self, env: dict | None = None) -> dict[str, str]:
        """``env`` (default: this process's) with the cluster's config, and the daemons'
        directories on PATH."""
        out = {**(os.environ if env is None else env), **self.env}
        out["PATH"] = os.pathsep.join([out.get("PATH", ""), "/usr/sbin", "/sbin"])
        return out

    def run(self, *argv: str, check: bool = True, env: dict | None = None, timeout: float = 60):
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=check,
            env=self._env(env), stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def sbatch(
        self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict | None = None,
        cwd: Path | None = None,
    ) -> str:  # fmt: skip
        """Submit ``script`` with ``args``; its job id. ``options``: sbatch's own, before the
        script (they override its ``#SBATCH`` lines). ``env``: the submitting shell's
        environment (the job inherits it, as sbatch's default ``--export=ALL`` does)."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args], capture_output=True, text=True,
            env=self._env(env), cwd=cwd, timeout=60,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"sbatch: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as KEY → VALUE (JobState, Restarts, ExitCode, Reason, …)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, ready, deadline_s: float, what: str) -> dict[str, str]:
        end = time.monotonic() + deadline_s
        while True:
            job = self.job(job_id)
            if ready(job):
                return job
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id}: no {what} after {deadline_s:.0f} s: {job}")
            time.sleep(0.5)
