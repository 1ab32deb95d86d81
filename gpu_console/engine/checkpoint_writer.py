"""Asynchronous checkpoints (``checkpoint.async_write``): training blocks only for a copy.

A checkpoint is taken in two parts. In the training thread, at the step boundary: wait for
the write in flight, if any (at most one: two copies of the state never sit in memory),
copy the state into host memory (a real copy on the CPU too, since training updates the
parameters in place; pinned buffers on CUDA, filled by asynchronous copies and one sync),
and gather every rank's own state (RNG, the task's) to rank 0 as today. Then a thread
writes it exactly as the synchronous path does (checkpoint.py: temporary directory, fsync,
rename, LATEST, BEST, keep_last), so LATEST moves only once the checkpoint is complete.

Agreement across ranks: every rank starts a thread; rank 0's writes and then broadcasts
the outcome on the write group (checkpoint.write_group), the others' receive it there, so
every rank ends its thread holding the same outcome, without a collective in the training
thread. The training thread collects it (:meth:`Writer.finished`) at the next step
boundary after the write ended, or waits for it (:meth:`Writer.wait`) before the next
checkpoint and before the run ends (stop, signal, nan, the end). A failed write (an
OSError: a full disk) is then reported where a synchronous one is (the loop's ``settle``:
an error event with ``checkpoint_failed`` from every node's first rank), and a stop's
checkpoint, waited for, says ``checkpointed = false`` as before. A full disk is an OSError
whatever torch raised (checkpoint._write classifies it). Any other exception in
rank 0's write is raised in rank 0's training thread when collected, ending the rank (the
other ranks are then ended by torchrun, as when a synchronous write raises).

The host copies are kept and refilled by the next checkpoint (allocating, and on CUDA
pinning, a few GiB each time would cost more than the copy): one copy of the state stays
in host memory between checkpoints. Events are written by the training thread only (the
Reporter is not thread-safe), so a checkpoint's event comes when its write has ended.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint

# A failing rank waits at most this long for the checkpoint being written (:meth:`land`).
LAND_S = 60.0


class Writer:
    def __init__(
        self,
        run_dir: Path,
        device: torch.device,
        is_main: bool,
        group: dist.ProcessGroup | None,
        keep_last: int,
        background: bool,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.device = device
        self.is_main = is_main
        self.group = group
        self.keep_last = keep_last
        self.background = background  # False: checkpoint.async_write = false
        self._thread: threading.Thread | None = None
        self._outcome: list[Any] = [None]
        self._buffers: list[torch.Tensor] = []  # the host copies, refilled in order

    def start(
        self,
        step: int,
        reason: str,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        best: dict[str, Any] | None,
        requested: float,
        waited_s: float = 0.0,
    ) -> dict[str, Any] | None:
        """Collective (every rank, same step). Call :meth:`wait` first: one write at a time.

        Synchronous: the outcome (checkpoint.save's). Background: None; the outcome comes from
        :meth:`finished` or :meth:`wait`. ``requested``: when the loop asked for it
        (perf_counter), so ``blocked_s`` includes ``waited_s``, the wait for the previous write.
        """
        assert self._thread is None, "a checkpoint write is still in flight"
        if not self.background:
            outcome = checkpoint.save(
                self.run_dir, step, reason, state, rank_state, self.keep_last, self.is_main,
                self.group, best,
            )  # fmt: skip
            return {**outcome, "step": step, "reason": reason}
        snap = self._snapshot(state) if self.is_main else None  # only rank 0 writes
        gathered: list[Any] | None = [None] * dist.get_world_size() if self.is_main else None
        dist.gather_object(rank_state, gathered, dst=0)
        blocked = {
            "waited_s": round(waited_s, 4),
            "blocked_s": round(time.perf_counter() - requested, 4),
        }
        self._outcome = [None]
        args = (step, reason, snap, gathered, best, requested, blocked, self._outcome)
        self._thread = threading.Thread(
            target=self._write, args=args, name="checkpoint-writer", daemon=True
        )
        self._thread.start()
        return None

    def finished(self) -> dict[str, Any] | None:
        """The outcome of a background write that has ended (once), else None. Not blocking."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def wait(self) -> dict[str, Any] | None:
        """Wait for the write in flight: its outcome (the same on every rank), or None."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome = self._outcome[0]
        self._outcome = [None]
        if isinstance(outcome, BaseException):  # rank 0's write raised: end this rank
            raise outcome
        return outcome

    def land(self, timeout_s: float = LAND_S) -> None:
        """This rank is failing: let the write in flight complete (its files, LATEST) before
        it exits, for at most ``timeout_s``; its outcome no longer matters. Every rank waits
        (torchrun ends the others once one exits, rank 0 included): rank 0's thread needs no
        peer until its files are in place, the others' end with its broadcast (or at once if
        it died), so the wait is the write's own, whatever the training threads do."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _write(self, step, reason, snap, gathered, best, requested, blocked, box) -> None:
        """The thread: rank 0 writes; every rank gets the outcome on the write group.

        An exception other than an OSError in rank 0's write is raised in its training thread
        by :meth:`wait` (no broadcast: torchrun then ends the other ranks, as when a
        synchronous write raises).
        """
        try:
            outcome: list[Any] = [None]
            if self.is_main:
                ckpts = self.run_dir / "checkpoints"
                writing = time.perf_counter()
                try:
                    event = checkpoint._write(
                        ckpts, step, reason, snap, gathered, self.keep_last, best
                    )
                    done = time.perf_counter()
                    event.update(blocked, write_s=round(done - writing, 4))
                    event["seconds"] = round(done - requested, 4)  # asked for → complete
                    outcome[0] = {"ok": True, "event": event}
                except OSError as e:  # a full disk among them, whatever torch raised
                    outcome[0] = checkpoint.failed_outcome(self.run_dir, e)
            dist.broadcast_object_list(outcome, src=0, group=self.group)
            box[0] = {**outcome[0], "step": step, "reason": reason}
        except BaseException as e:
            box[0] = e

    def _snapshot(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` in host memory that training cannot change under the write.

        Tensors go into the kept buffers (in the order met; a buffer that no longer fits is
        replaced); one tensor met twice (tied weights) is copied once, so the file keeps the
        sharing. Containers are rebuilt; anything else is deep-copied.
        """
        cuda = self.device.type == "cuda"
        memo: dict[int, torch.Tensor] = {}
        fresh: list[torch.Tensor] = []

        def host(t: torch.Tensor) -> torch.Tensor:
            key = id(t)
            if key in memo:
                return memo[key]
            t = t.detach()
            if t.layout != torch.strided:
                out = t.to("cpu", copy=True)
            else:
                i = len(fresh)
                old = self._buffers[i] if i < len(self._buffers) else None
                if old is None or old.shape != t.shape or old.dtype != t.dtype:
                    old = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda and t.is_cuda)
                old.copy_(t, non_blocking=cuda)
                fresh.append(old)
                out = old
            memo[key] = out
            return out

        def copy_of(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return host(obj)
            if isinstance(obj, dict):
                out = copy.copy(obj)  # keeps a state_dict's _metadata
                for k, v in obj.items():
                    out[k] = copy_of(v)
                return out
            if isinstance(obj, list):
                return [copy_of(v) for v in obj]
            if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
                return tuple(copy_of(v) for v in obj)
            return copy.deepcopy(obj)

        snap = copy_of(state)
        if cuda:
            torch.cuda.synchronize(self.device)  # the non-blocking copies have landed
        self._buffers = fresh
        return snap
