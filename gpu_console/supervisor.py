"""``python -m gpu_console.supervisor RUN_DIR``: owns torchrun and records how the run ended.

Started by the console in a session of its own, so a closed terminal never ends training.
It is the sole writer of ``status.json`` and ``telemetry.jsonl`` (a thread of its own, see
:mod:`.telemetry.recorder`): its state mirrors the engine's ``status`` events,
plus pids, times, the exit code and, on failure, which rank failed and its traceback.

No process of the run outlives it: it is a child subreaper (orphaned workers reparent to
it), torchrun dies with it (PDEATHSIG), workers die with torchrun (PDEATHSIG, set by the
engine), and when torchrun exits it kills whatever of the run is left.

Signals: SIGTERM/SIGUSR1 (a scheduler) → SIGUSR1 to the workers, which checkpoint and stop
at the next step (reason ``signal``); ``shutdown_grace_s`` after the first rank was asked
(a signal may come before the ranks exist: they are asked as each starts), the tree is
killed. Signals that arrive within :data:`COALESCE_S` of the first are the same request (a
scheduler often signals every process of a job at once), and so is any later SIGUSR1; a
later SIGTERM → terminate the tree. SIGHUP is ignored. Both are held from this process's
start until its handlers are in (:mod:`.held_signals`); torchrun never gets SIGUSR1.

Kill on request (:data:`KILLS`): SIGUSR2 (``stop --now``, the console's kill) ends the run
``killed`` (exit 137), SIGINT (the headless console's second Ctrl-C) ``interrupted`` (exit
130). The supervisor records that state in status.json first, then SIGKILLs torchrun and
every process under it at once: no rank gets to checkpoint or print a traceback, and ranks
hung in a step or a collective die the same.

A rank that dies without having ended cleanly (its heartbeat does not say ``done``) is a
crash: its peers get :data:`REAP_PEERS_AFTER_S` to notice on their own, then they are
killed, so a peer blocked in a collective (NCCL waits for its timeout) never holds the run
(and its GPU memory) until then. torchrun then fails the run, or restarts the group.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from . import diskfull, held_signals, proc_tree, runs, session_lock, slurm, timings, toml_text
from .events import JsonlTail
from .exit_watch import ExitWatch
from .fold import RunFold
from .state import read_heartbeats
from .telemetry.fold import TELEMETRY_FILE
from .telemetry.recorder import Recorder

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TICK_S = 0.2
WANDB_GRACE_S = 15.0  # for the W&B follower to finish its run once the run's end is recorded
KILL_AFTER_TERM_S = 5.0
COALESCE_S = 5.0
REQUEUE_SAY_S = 1.0  # the console polls status.json every 0.2 s (headless.POLL_S)
REAP_PEERS_AFTER_S = 2.0
# The reserves (diskfull.make_reserve), one per writer so that neither takes the other's room.
RESERVES = ("supervisor", "engine")
FINAL_TRIES_S = 60.0
# A kill on request: the signal the supervisor gets → the run's final state and its reason.
KILLS = {
    signal.SIGUSR2: ("killed", "on request, no checkpoint"),
    signal.SIGINT: ("interrupted", "killed before a checkpoint"),
}


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _torchrun_preexec() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # torchrun never acts on the scheduler's SIGUSR1 (it would end the ranks without a
    # checkpoint); its ranks inherit the mask and let it through once their handler is in.
    held_signals.hold(held_signals.TORCHRUN_HOLDS)


class Supervisor:
    def __init__(self, run_dir: Path):
        self.up = time.time()  # a start-up stage (timings.py)
        self.run_dir = run_dir
        # This session's facts: a resumed run continues in its directory (runs.current_session).
        self.meta = runs.current_session(runs.read_json(run_dir / "meta.json") or {})
        profile_text = (run_dir / "run.toml").read_text()
        # Parsed once, here: the launch validated it; a reader falls back to the defaults.
        self.profile = toml_text.loads_or_empty(profile_text)
        self.grace_s = _grace_from(self.profile)
        self.events = JsonlTail(run_dir / "events.jsonl", int(self.meta.get("events_from") or 0))
        self.status: dict[str, Any] = {
            "state": "starting",
            "reason": "",
            "pids": {"supervisor": os.getpid()},
            "started": time.time(),
            "host": self.meta.get("host"),
            "step": None,
            "loss": None,
            "last_step_t": None,
        }
        self._written: str = ""
        self._written_state: Any = None  # the state of the last status.json written
        self.graceful_deadline: float | None = None
        self.graceful_since: float | None = None
        self.terminate_at: float | None = None
        self.terminated = False
        self.signal_stop = False
        self.first_signal: int | None = None  # the graceful stop's signal (requeue: slurm.py)
        self.proc: subprocess.Popen | None = None
        self.asked: set[int] = set()  # workers already sent the graceful SIGUSR1
        self.known: dict[int, psutil.Process] = {}  # the workers seen at the last tick
        self._torchrun: psutil.Process | None = None
        self.reap_at: float | None = None
        self.reap: set[int] = set()  # peers of a crashed rank, killed at reap_at
        self.fold = RunFold()
        # A resumed run's earlier sessions: their best loss, from their last status.json.
        self.fold.carry(
            runs.previous_status(run_dir, self.meta.get("sessions")), runs.resume_step(self.meta)
        )
        self.engine_checkpointed = True
        self.recorder = Recorder(run_dir)  # telemetry.jsonl, from start to the final status
        self.profile_text = profile_text
        # [logging] tensorboard: RUN/tensorboard/ from this session's events and telemetry,
        # opened in run() once torchrun is on its way (its import is not on the start path).
        self.tensorboard: Any = None
        self.follower: subprocess.Popen | None = None  # [logging] wandb (results/wandb_follower)
        telemetry = run_dir / TELEMETRY_FILE
        self.telemetry = JsonlTail(telemetry, telemetry.stat().st_size if telemetry.exists() else 0)
        self.torchrun_log_offset = 0
        self.torchrun_stop_deadline: float | None = None  # grace after torchrun was signalled
        self.kill_signal: int | None = None  # a kill on request, acted on at the next tick
        self.killed: tuple[str, str] | None = None  # (state, reason) once the tree was killed

    # -- signals -------------------------------------------------------------------------
    def on_graceful(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.graceful_since is None:
            self.signal_stop = True
            self.first_signal = signum
            self.graceful_since = now  # the loop asks the ranks (_ask_workers)
        elif signum == signal.SIGTERM and now - self.graceful_since > COALESCE_S:
            # A later SIGTERM: the graceful path is stuck, end it. A repeated SIGUSR1 is the
            # same warning (the console passes on the one it held while the run started).
            self.on_terminate(signum, frame)

    def on_kill(self, signum: int, frame) -> None:
        if self.kill_signal is None:  # the first request names the end (killed or interrupted)
            self.kill_signal = signum

    def on_terminate(self, signum: int, frame) -> None:
        if self.terminate_at is None:
            self.terminated = True
            self.terminate_at = time.monotonic() + KILL_AFTER_TERM_S
            for p in self._tree():
                _send(p, signal.SIGTERM)

    # -- processes -----------------------------------------------------------------------
    def _tree(self) -> list[psutil.Process]:
        """torchrun, the ranks and what they started; not the W&B follower (a reader of the
        run, ended by :meth:`_end_follower` once the run's end is recorded)."""
        try:
            tree = psutil.Process().children(recursive=True)
        except psutil.Error:
            return []
        spared = _subtree(self.follower.pid) if self.follower is not None else set()
        return [p for p in tree if p.pid not in spared]

    def _workers(self) -> list[psutil.Process]:
        """The ranks: torchrun's own children running the engine.

        Only direct children: a rank's DataLoader workers are forks with the same command line.
        Asked every tick: the kernel's list of torchrun's children (proc_tree.py), a rank
        already known not asked for its command line again.
        """
        if self.proc is None:
            return []
        try:
            if self._torchrun is None:  # one torchrun a session
                self._torchrun = psutil.Process(self.proc.pid)
            children = proc_tree.children(self._torchrun, known=self.known)
        except psutil.Error:
            return []
        out = []
        for p in children:
            try:
                if self.known.get(p.pid) is p or is_engine_cmdline(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def _ask_workers(self) -> None:
        """SIGUSR1 to every rank that has installed its handler (it has a heartbeat).

        A rank still starting would die of SIGUSR1's default action; it is asked as soon as
        its heartbeat appears (the handler is installed before the heartbeat is written).
        """
        ready = {b.get("pid") for b in read_heartbeats(self.run_dir)}
        for p in self._workers():
            if p.pid in ready and p.pid not in self.asked:
                self.asked.add(p.pid)
                _send(p, signal.SIGUSR1)
                if self.graceful_deadline is None:
                    # The grace counts from a rank being asked: a signal that came before the
                    # ranks existed (a job's first seconds) gives them the whole of it.
                    self.graceful_deadline = time.monotonic() + self.grace_s

    def _watch_workers(self, now: float) -> None:
        """Record the ranks' pids; a rank gone without ending cleanly dooms its peers."""
        current = {p.pid: p for p in self._workers()}
        for pid in set(self.known) - set(current):  # the kernel's list may miss one: confirmed
            with contextlib.suppress(psutil.Error):
                p = self.known[pid]
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    current[pid] = p
        gone = set(self.known) - set(current)
        if gone and self.reap_at is None:
            beats = {b.get("pid"): b for b in read_heartbeats(self.run_dir)}
            crashed = [pid for pid in gone if beats.get(pid, {}).get("phase") != "done"]
            if crashed:
                self.reap = set(self.known) - gone
                self.reap_at = now + REAP_PEERS_AFTER_S
        if self.reap_at is not None and now >= self.reap_at:
            for pid in self.reap:
                proc = self.known.get(pid) or current.get(pid)
                if proc is not None:
                    _send(proc, signal.SIGKILL)
            self.reap, self.reap_at = set(), None
        self.known = current
        self.status["pids"]["workers"] = sorted(current)

    def _watch_torchrun_stop(self, now: float) -> None:
        """Hold torchrun's SIGTERM→SIGKILL window to the profile's grace, whatever the torchrun.

        A torchrun without ``--shutdown-timeout`` (torch 2.11) waits its hard-coded 30 s before
        it SIGKILLs ranks that cannot stop; ranks stuck in a step would outlive the grace the
        profile asks for. Once torchrun says it was signalled, the ranks get ``grace_s``; then
        their trees are killed, and torchrun reports the signal and exits on its own.
        """
        if self.torchrun_stop_deadline is None:
            if torchrun_was_signalled(self._torchrun_log_news()):
                self.torchrun_stop_deadline = now + self.grace_s
            return
        if now > self.torchrun_stop_deadline:
            for worker in self._workers():
                with contextlib.suppress(psutil.Error):
                    for p in worker.children(recursive=True):
                        _send(p, signal.SIGKILL)
                _send(worker, signal.SIGKILL)
            if self.terminate_at is None:  # torchrun itself, should it not exit on its own
                self.terminate_at = now + KILL_AFTER_TERM_S

    def _torchrun_log_news(self) -> str:
        try:
            with open(self.run_dir / "logs" / "torchrun.log", "rb") as f:
                f.seek(self.torchrun_log_offset)
                data = f.read()
        except OSError:
            return ""
        # Up to the last whole line: a line torchrun is still writing is read next tick.
        data = data[: data.rfind(b"\n") + 1]
        self.torchrun_log_offset += len(data)
        return data.decode(errors="replace")

    def _kill_tree(self) -> None:
        for p in self._tree():
            _send(p, signal.SIGKILL)

    def kill_now(self) -> None:
        """A kill on request: status.json says so first, then the whole tree is SIGKILLed.

        torchrun goes first, so its agent never sees a rank die (no failure report, no
        restart); the ranks and their DataLoader workers follow in the same breath, hung or
        not. Whatever forks meanwhile dies with its parent (PDEATHSIG) or in :meth:`_sweep`.
        """
        state, reason = KILLS[self.kill_signal]
        self.killed = (state, reason)
        self.status.update(state=state, reason=reason, exit_code=runs.exit_code(state))
        self.write_status(force=True)
        tree = self._tree()
        first = [p for p in tree if self.proc is not None and p.pid == self.proc.pid]
        for p in first + [p for p in tree if p not in first]:
            _send(p, signal.SIGKILL)

    # -- status --------------------------------------------------------------------------
    def write_status(self, force: bool = False, last: bool = False) -> bool:
        """status.json as :attr:`status` says; False when a full disk kept it out (the next
        call tries again: status.json is late, never frozen, and the supervisor lives on).
        ``last``: the run's end, which may take the supervisor's reserve."""
        text = json.dumps(self.status, sort_keys=True)
        if not force and text == self._written:
            return True
        # Synced to disk when the state changes (and at the end); a tick that only moves the
        # progress is renamed into place without an fsync: five a second cost the run CPU.
        durable = force or last or self.status.get("state") != self._written_state
        if not write_status_on_full_disk(self.run_dir, self.status, last, durable):
            return False
        self._written, self._written_state = text, self.status.get("state")
        return True

    def fold_events(self) -> None:
        """The session's new events through THE fold (:mod:`.fold`); status.json keeps its
        fields, so ``ls`` shows what every other reader of the run shows."""
        for e in self.events.read():
            self.fold.apply(e)
            self._mirror("event", e)
        if self.tensorboard is not None:
            for sample in self.telemetry.read():
                self._mirror("sample", sample)
        self.status.update(self.fold.to_status())
        if self.killed is not None:  # the engine's last word (running) is not the end
            self.status["state"], self.status["reason"] = self.killed
        self.engine_checkpointed = self.fold.checkpointed

    def _mirror(self, what: str, *args: Any) -> None:
        """Feed TensorBoard; an error it was not made for turns it off for the session, in
        one line of supervisor.log: the run itself never depends on it."""
        if self.tensorboard is None:
            return
        try:
            getattr(self.tensorboard, what)(*args)
        except Exception as e:  # noqa: BLE001 (anything: the run goes on without it)
            _log_line(f"supervisor: TensorBoard off for this session: {_one_line(e)}")
            with contextlib.suppress(Exception):
                self.tensorboard.close()
            self.tensorboard = None

    # -- the run -------------------------------------------------------------------------
    def install_signals(self) -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self.on_graceful)
        signal.signal(signal.SIGUSR1, self.on_graceful)
        for sig in KILLS:
            signal.signal(sig, self.on_kill)
        held_signals.release()  # one that came while this process started is handled now

    def run(self) -> int:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.install_signals()
        for writer in RESERVES:  # before anything of the session fills the disk
            diskfull.make_reserve(self.run_dir, writer)
        self.write_status(force=True)
        try:
            with open(self.run_dir / "logs" / "torchrun.log", "ab") as log:
                self.proc = subprocess.Popen(
                    self.meta["torchrun"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_torchrun_preexec,
                    cwd=self.meta.get("cwd") or None,
                    env=timings.handed_down({"supervisor": self.up, "torchrun": time.time()}),
                )
        except (OSError, ValueError, TypeError, KeyError, subprocess.SubprocessError) as e:
            return self.fail(f"supervisor: cannot start torchrun: {_one_line(e)}")
        self.status["pids"]["torchrun"] = self.proc.pid
        self.recorder.start()  # after the fork: preexec_fn is not safe beside a running thread
        self.write_status()
        self.tensorboard = tensorboard_mirror(self.run_dir, self.profile_text, self.profile)
        self.follower = start_wandb_follower(self.run_dir, self.profile_text)
        if self.follower is not None:
            self.status["pids"]["wandb"] = self.follower.pid
        torchrun_exit = ExitWatch(self.proc.pid)  # a tick, or torchrun's exit if sooner
        while self.proc.poll() is None:
            torchrun_exit.sleep(TICK_S)
            if self.kill_signal is not None and self.killed is None:
                self.kill_now()
                continue
            self.fold_events()
            now = time.monotonic()
            self._watch_workers(now)
            self._watch_torchrun_stop(now)
            if self.graceful_since is not None and self.terminate_at is None:
                self._ask_workers()  # ranks that were still starting when the signal came
            if self.graceful_deadline is not None and now > self.graceful_deadline:
                self.on_terminate(signal.SIGTERM, None)
            if self.terminate_at is not None and now > self.terminate_at:
                self._kill_tree()
            self.write_status()
        code = self.proc.returncode
        torchrun_exit.close()
        self._sweep()
        self.fold_events()
        return self.finish(code)

    def _sweep(self) -> None:
        """torchrun is gone: nothing of the run may outlive it."""
        self._kill_tree()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)

    def fail(self, summary: str, traceback: str = "") -> int:
        """The supervisor itself failed: say so in status.json, in one line, and exit 1."""
        failed_status(self.status, summary, traceback)
        self.write_status(force=True, last=True)
        return 1

    def finish(self, code: int) -> int:
        """Record how the run ended; the run's exit code (:func:`runs.exit_code`) is returned,
        torchrun's own is kept as ``torchrun_exit``."""
        self.recorder.stop()  # its last sample and summary land before the status says ended
        self.fold_events()  # the last samples into TensorBoard too
        if self.tensorboard is not None:
            self._mirror("close")
        engine_state = self.fold.state
        self.status["torchrun_exit"] = code
        self.status["ended"] = time.time()
        self.status["pids"]["workers"] = []
        agent_signal = torchrun_signal(self.run_dir) if code > 0 and not self.killed else None
        if self.killed is not None:
            state, self.status["reason"] = self.killed
        elif code == 0 and engine_state in ("finished", "stopped"):
            state = engine_state
        elif engine_state == "finished" and (agent_signal or self.signal_stop or self.terminated):
            # The signal came after the ranks had finished (their end checkpoint written),
            # while the job step was ending: a signal after the end never changes it.
            state = "finished"
        elif engine_state == "stopped" and (agent_signal or self.signal_stop or self.terminated):
            # torchrun was signalled too (a scheduler signals every process of a job): it
            # forwarded the signal, the ranks stopped with their checkpoint, and torchrun
            # still exits 1 for the signal it got. The engine's word stands.
            state = "stopped"
        elif code == 0 and engine_state == "refused":
            # The ranks refused the user's input (engine/refusal.py): one line, exit 2.
            state = "refused"
            self.status["reason"] = self.status.get("reason") or "the ranks refused the input"
        elif code == 0 and engine_state == "failed":
            # The engine failed the run by policy (nan_policy = "stop") and the ranks exited
            # 0 so that torchrun would not restart them: the engine's reason is the failure.
            state = "failed"
            reason = self.status.get("reason") or "the engine failed the run"
            self.status["failure"] = {
                "source": "engine",
                "rank": None,
                "exit_code": 0,
                "summary": reason,
                "traceback": "",
            }
        elif self.terminated or agent_signal:
            state = "stopped"
            why = f" (torchrun got {_signame(agent_signal)})" if agent_signal else ""
            self.status["reason"] = "terminated before a checkpoint" + why
        else:
            state = "failed"
            self.status["failure"] = failure_summary(self.run_dir, code)
            self.status["reason"] = self.status["failure"]["summary"]
        checkpointed = state == "stopped" and engine_state == "stopped" and self.engine_checkpointed
        if self.killed is not None and (written := self.stop_checkpoint()) is not None:
            # The kill landed after the stop's checkpoint was complete: the run stopped on
            # request with its checkpoint (exit 0, DESIGN.md), the kill only cut its shutdown.
            state, checkpointed = "stopped", True
            self.status["step"] = written["step"]
            self.status["reason"] = (
                f"stop checkpoint @ step {written['step']} written, then killed on request"
            )
        self.status["state"] = state
        self.status["checkpointed_on_stop"] = checkpointed
        self.status["exit_code"] = runs.exit_code(state, checkpointed)
        if checkpointed and (job := self.requeue_job()) is not None:
            self.requeue(job)
        self._write_final()
        self._end_follower()
        return self.status["exit_code"]

    def requeue_job(self) -> slurm.Job | None:
        """The SLURM job to requeue, when the run stopped with its checkpoint on the signal
        ``cluster.requeue_signal`` names (SLURM's warning before the time limit), on the job's
        first node (one requeue per job); None otherwise: an end on request, a finished run."""
        wanted = slurm.requeue_signal(_cluster_setting(self.profile, "requeue_signal"))
        job = slurm.job()
        if wanted is None or job is None or job.node_id != 0 or self.first_signal != wanted:
            return None
        return job

    def requeue(self, job: slurm.Job) -> None:
        """The end is recorded as ``requeued`` before ``scontrol requeue`` runs (it ends this
        allocation's processes, this one included); what scontrol said is added after. A
        requeue that fails leaves the run ``stopped`` with its checkpoint, saying why."""
        step = self.status.get("step")
        said = f"{_signame(self.first_signal or 0)}: checkpoint @ step {step}"
        self.status.update(
            state="requeued",
            exit_code=runs.exit_code("requeued"),
            reason=f"{said}; SLURM job {job.job_id} requeued (--resume auto continues the run)",
            requeue={"job_id": job.job_id, "command": ["scontrol", "requeue", job.job_id]},
        )
        self._write_final()
        # scontrol's requeue ends the job's processes, the console too, often before it
        # answers: a moment for the console to read the requeue and say so in the job's output.
        time.sleep(REQUEUE_SAY_S)
        outcome = slurm.requeue(job.job_id)
        self.status["requeue"] = outcome
        if outcome.get("exit_code") != 0:
            self.status["state"] = "stopped"
            self.status["reason"] = (
                f"{said}; SLURM job {job.job_id} NOT requeued: {outcome.get('error')}"
            )
        _log_line(f"supervisor: scontrol requeue {job.job_id}: {outcome}")

    def _end_follower(self) -> None:
        """The W&B follower sees the recorded end, logs the last lines and finishes its run;
        given :data:`WANDB_GRACE_S` for that (an offline run takes a second or two), then
        ended. The run's end is already recorded: nothing here can change it."""
        f = self.follower
        if f is None:
            return
        try:
            f.wait(WANDB_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            pass
        victims = _children(f.pid)
        with contextlib.suppress(psutil.Error):
            victims.insert(0, psutil.Process(f.pid))
        for p in victims:
            _send(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            f.wait(5)

    def _write_final(self) -> None:
        """The run's end must land: a full disk gets :data:`FINAL_TRIES_S` to free room (the
        reserve is gone by then; a user deleting files, a quota raised)."""
        deadline = time.monotonic() + FINAL_TRIES_S
        while not self.write_status(force=True, last=True) and time.monotonic() < deadline:
            time.sleep(1.0)

    def stop_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint a graceful stop (a request or a signal) wrote in this session, as
        the disk has it: LATEST names it (so it is complete) and it was written after this
        supervisor started. The disk, not the events: the kill may land between the two."""
        ckpt = runs.latest_checkpoint(self.run_dir)
        meta = runs.read_json(ckpt / "meta.json") if ckpt is not None else None
        if not isinstance(meta, dict) or meta.get("reason") not in ("stop", "signal"):
            return None
        t, step = meta.get("t"), meta.get("step")
        if not isinstance(t, (int, float)) or t < self.status["started"]:
            return None  # an earlier session's
        return {"step": step if isinstance(step, int) else self.fold.step, "path": str(ckpt)}


def is_engine_cmdline(cmd: list[str]) -> bool:
    for i, arg in enumerate(cmd[:-1]):
        if arg == "-m" and cmd[i + 1] == "gpu_console.engine":
            return "torch.distributed.run" not in cmd
    return False


def _send(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)


def _table(profile: dict[str, Any], name: str) -> dict[str, Any]:
    table = profile.get(name)
    return table if isinstance(table, dict) else {}


def _cluster_setting(profile: dict[str, Any], key: str) -> str:
    """A ``[cluster]`` key of run.toml (its default where the table lacks it)."""
    from .profile import ClusterConfig

    value = _table(profile, "cluster").get(key)
    return value if isinstance(value, str) else getattr(ClusterConfig(), key)


def _grace_from(profile: dict[str, Any]) -> float:
    try:
        return float(_table(profile, "distributed")["shutdown_grace_s"])
    except (KeyError, ValueError, TypeError):
        return 30.0


def start_wandb_follower(run_dir: Path, profile_text: str) -> subprocess.Popen | None:
    """The W&B follower of this session (results/wandb_follower.py), when ``[logging] wandb``
    is set and the package is installed (the launch said so otherwise)."""
    import importlib.util

    from .results.wandb_follower import settings

    try:
        if not settings(profile_text) or importlib.util.find_spec("wandb") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        with open(run_dir / "logs" / "wandb.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "gpu_console.results.wandb_follower", str(run_dir)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_follower_preexec,
            )
    except (OSError, subprocess.SubprocessError) as e:
        _log_line(f"supervisor: W&B off: cannot start its follower: {_one_line(e)}")
        return None


def _follower_preexec() -> None:
    # The supervisor gone, the follower finishes its W&B run (SIGTERM: it drains, then ends).
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _subtree(pid: int) -> set[int]:
    return {pid, *(p.pid for p in _children(pid))}


def tensorboard_mirror(run_dir: Path, profile_text: str, profile: dict[str, Any]) -> Any:
    """This session's TensorBoard mirror, when ``[logging] tensorboard`` is on and the
    package is installed (the launch said so otherwise); None else."""
    from .results import tensorboard

    wanted = _table(profile, "logging").get("tensorboard", True)
    if wanted is not True or not tensorboard.available():
        return None
    try:
        return tensorboard.TensorBoardMirror(run_dir, profile_text)
    except Exception as e:  # noqa: BLE001 (a broken install: the run goes on without it)
        _log_line(f"supervisor: TensorBoard off: {_one_line(e)}")
        return None


def torchrun_was_signalled(log_text: str) -> bool:
    """torchrun's agent caught a signal and is shutting its ranks down (2.11 and 2.13 alike)."""
    return re.search(r"Received \S+ death signal, shutting down workers", log_text) is not None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def torchrun_signal(run_dir: Path) -> int | None:
    """The signal torchrun caught and forwarded to the ranks (it then exits 1), if any."""
    try:
        text = (run_dir / "logs" / "torchrun.log").read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"SignalException: Process \d+ got signal: (\d+)", text)
    return int(found[-1]) if found else None


def _last_attempt(run_dir: Path, rank: str = "*", name: str = "error.json") -> str:
    """The rank files of torchrun's last attempt (earlier ones were restarted over)."""
    attempts = glob.glob(str(run_dir / "logs" / "*" / "attempt_*"))
    numbers = []
    for a in attempts:
        with contextlib.suppress(ValueError):
            numbers.append(int(Path(a).name.split("_", 1)[1]))
    last = max(numbers, default=0)
    return str(run_dir / "logs" / "*" / f"attempt_{last}" / rank / name)


def failure_summary(run_dir: Path, code: int) -> dict[str, Any]:
    """Which rank failed first, its exit code and traceback, from torchelastic's files."""
    errors = []
    pattern = _last_attempt(run_dir)
    for path in glob.glob(pattern):
        try:
            data = json.loads(Path(path).read_text())
            msg = data["message"]
            local_rank = int(Path(path).parent.name)
            if isinstance(msg, str):
                msg = {"message": msg, "extraInfo": {}}
            errors.append(
                {
                    "rank": local_rank,
                    "message": msg.get("message", ""),
                    "traceback": msg.get("extraInfo", {}).get("py_callstack", ""),
                    "timestamp": int(msg.get("extraInfo", {}).get("timestamp", 0) or 0),
                    "error_file": path,
                    "mtime": os.path.getmtime(path),
                }
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    rank, rank_code = _failed_rank_from_log(run_dir)
    # Every error file is a peer's broken connection: the root cause is a rank that died
    # without one (killed, or exited without a Python exception), as torchrun saw it.
    only_collateral = errors and all(_collateral(e["message"]) for e in errors)
    if only_collateral and rank is not None and rank not in {e["rank"] for e in errors}:
        errors = []
    if errors:
        # A peer's death shows up on every other rank as a broken connection; the rank that
        # failed for its own reason is the root cause, then the earliest to write its file.
        first = min(errors, key=lambda e: (_collateral(e["message"]), e["mtime"], e["rank"]))
        return {
            "source": "rank",
            "rank": first["rank"],
            # The rank's own exit code, as torchrun reported it; else torchrun's.
            "exit_code": _exit_codes_from_log(run_dir).get(first["rank"], code),
            "summary": f"rank {first['rank']} failed: {first['message']}",
            "traceback": first["traceback"],
            "ranks": sorted({e["rank"] for e in errors}),
        }
    if rank is not None:
        summary = f"rank {rank} exited with code {rank_code}"
        if rank_code is not None and rank_code < 0:
            summary += f" (killed by {_signame(-rank_code)})"
        # No error file, yet it exited on its own: it died before torchelastic's @record (the
        # engine failed to import); its own stderr's traceback says why. A killed rank's
        # stderr says nothing about its death.
        traceback, why = rank_stderr_error(run_dir, rank) if (rank_code or 0) > 0 else ("", None)
        if why:
            summary += f": {why}"
        return {
            "source": "rank",
            "rank": rank,
            "exit_code": rank_code,
            "summary": summary,
            "traceback": traceback,
        }
    summary = f"torchrun exited with code {code}"
    if code < 0:
        summary = f"torchrun was killed by {_signame(-code)}"
    # torchrun failed before or outside the ranks: a flag it rejects, the rendezvous, a port.
    why = torchrun_error(run_dir) if code > 0 else None
    return {
        "source": "torchrun",
        "rank": None,
        "exit_code": code,
        "summary": why or summary,
        "traceback": "",
    }


# A rank's line as torchrun --tee copies it into torchrun.log: "[default0]:...".
_RANK_LINE = re.compile(r"^\[\w+?\d+\]:")
_ARGPARSE_ERROR = re.compile(r"^(?:[\w.-]+\.py|torchrun): error: (.+)$")


def torchrun_error(run_dir: Path) -> str | None:
    """torchrun's own error, in one line, from logs/torchrun.log (its stdout and stderr)."""
    try:
        text = (run_dir / "logs" / "torchrun.log").read_text(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if not _RANK_LINE.match(line)]
    for line in reversed(lines):
        m = _ARGPARSE_ERROR.match(line.strip())
        if m:
            return f"torchrun: error: {m.group(1).strip()}"
    exc = exception_line(lines)
    return f"torchrun: {exc}" if exc else None


def rank_stderr_error(run_dir: Path, rank: int) -> tuple[str, str | None]:
    """The traceback and the one-line exception a rank's stderr ended with, if any."""
    for path in sorted(glob.glob(_last_attempt(run_dir, str(rank), "stderr.log"))):
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        exc = exception_line(lines)
        if exc:
            start = max(i for i, line in enumerate(lines) if line.startswith("Traceback ("))
            return "\n".join(lines[start:]).strip(), exc
    return "", None


def exception_line(lines: list[str]) -> str | None:
    """The exception the last Python traceback in ``lines`` ended with: ``Type: message``."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line[0].isspace():
            # "torch.distributed.DistNetworkError: ..." → "DistNetworkError: ..."
            return re.sub(r"^(?:\w+\.)+(\w+(?::|$))", r"\1", line.strip())
    return None


COLLATERAL = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "Timed out",
    "timed out",
    # The shared-memory reduce (engine/shared_reduce.py) sees a dead peer from its pid.
    "ended while rank",
    "did not arrive within",
)


def _collateral(message: str) -> bool:
    return any(marker in message for marker in COLLATERAL)


def _failed_rank_from_log(run_dir: Path) -> tuple[int | None, int | None]:
    """torchrun's root-cause block names the rank and exit code of a rank killed outright."""
    try:
        text = (run_dir / "logs" / "torchrun.log").read_text(errors="replace")
    except OSError:
        return None, None
    # The "Root Cause (first observed failure)" block comes last; other failures precede it.
    _, marker, root = text.rpartition("Root Cause")
    text = root if marker else text
    rank = code = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("rank") and ":" in line and rank is None:
            with contextlib.suppress(ValueError):
                rank = int(line.split(":", 1)[1].split()[0])
        elif line.startswith("exitcode") and ":" in line and code is None:
            with contextlib.suppress(ValueError):
                code = int(line.split(":", 1)[1].split()[0])
    return rank, code


def _exit_codes_from_log(run_dir: Path) -> dict[int, int]:
    """Exit code by local rank, from torchrun's final failure report."""
    try:
        text = (run_dir / "logs" / "torchrun.log").read_text(errors="replace")
    except OSError:
        return {}
    _, marker, block = text.rpartition("Failures:")
    if not marker:
        return {}
    codes: dict[int, int] = {}
    local = None
    for line in block.splitlines():
        m = re.search(r"rank\s*:\s*\d+\s*\(local_rank:\s*(\d+)\)", line)
        if m:
            local = int(m.group(1))
            continue
        m = re.search(r"exitcode\s*:\s*(-?\d+)", line)
        if m and local is not None:
            codes.setdefault(local, int(m.group(1)))
            local = None
    return codes


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def main() -> None:
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--lock-fd"):
        print("usage: python -m gpu_console.supervisor RUN_DIR [--lock-fd FD]", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(args[0])
    hold_session_lock(run_dir, int(args[2]) if len(args) == 3 else None)
    supervisor = None
    try:
        supervisor = Supervisor(run_dir)
        code = supervisor.run()
    except Exception as e:
        code = record_crash(run_dir, supervisor, e)
    # The run's end is recorded and every child is gone: leave without the interpreter's
    # teardown (unloading what a session imported, tensorboard's protobufs among it, takes
    # a moment under load), so that the console which reported the end finds no process
    # of the run left, and the session lock is free for a resume at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def hold_session_lock(run_dir: Path, fd: int | None) -> None:
    """Hold the run's session lock (:mod:`.session_lock`) until this process exits.

    ``fd``: the lock the console took and passed down; kept from torchrun and the ranks
    (not inheritable), so that the lock is free exactly when this supervisor is gone. Started
    without one (by hand), the supervisor takes it if it can.
    """
    if fd is None:
        try:
            lock = session_lock.try_take(run_dir)
        except OSError:
            lock = None
        if lock is None:
            return
        fd = lock.fd
    os.set_inheritable(fd, False)
    session_lock.SessionLock(run_dir, fd).claim(os.getpid())  # never released: exit does


def record_crash(run_dir: Path, supervisor: Supervisor | None, e: BaseException) -> int:
    """The supervisor's own bug ends the run, but status.json still says why, in one line."""
    import traceback

    tb = traceback.format_exc()
    with contextlib.suppress(OSError):  # logs/supervisor.log, maybe on a full disk
        print(tb, file=sys.stderr, flush=True)
    if supervisor is not None:
        supervisor._kill_tree()
        status = supervisor.status
    else:
        status = {"pids": {"supervisor": os.getpid()}, "started": time.time()}
    with contextlib.suppress(Exception):
        status = failed_status(status, f"supervisor: crashed: {_one_line(e)}", tb)
        write_status_on_full_disk(run_dir, status, last=True)
    return 1


def write_status_on_full_disk(
    run_dir: Path, status: dict[str, Any], last: bool = False, durable: bool = True
) -> bool:
    """status.json written, or False when a full disk (ENOSPC, EDQUOT) kept it out; the
    reason then rides in ``status["disk_full"]`` (one line, with the free space) for the
    next write that lands. Another error raises.

    ``last``: the run's end, the one write that must land: the supervisor's reserve is
    freed for it. Only for it: a status.json late by a tick while running costs nothing, a
    final one lost leaves the run ``running`` forever."""
    for attempt in range(2):
        try:
            runs.write_status(run_dir, status, durable)
            return True
        except OSError as e:
            full = diskfull.classify(e, run_dir)
            if full is None:
                raise
            status["disk_full"] = f"status.json not written at {time.strftime('%H:%M:%S')}: {full}"
            _log_line(status["disk_full"])
            if not last or attempt or not diskfull.free_reserve(run_dir, "supervisor"):
                return False
    return False


def _log_line(text: str) -> None:
    with contextlib.suppress(OSError):  # logs/supervisor.log is on the same disk
        print(text, file=sys.stderr, flush=True)


def failed_status(status: dict[str, Any], summary: str, traceback: str = "") -> dict[str, Any]:
    """``status`` as the supervisor's own failure leaves it (the run is over, exit code 1)."""
    status.update(state="failed", reason=summary, exit_code=1, ended=time.time())
    status.setdefault("pids", {})["workers"] = []
    status["failure"] = {
        "source": "supervisor",
        "rank": None,
        "exit_code": 1,
        "summary": summary,
        "traceback": traceback,
    }
    return status


if __name__ == "__main__":
    main()
