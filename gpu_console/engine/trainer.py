"""A rank's training, top to bottom: build, resume, then per step: update, log, evaluate,
checkpoint, control; then the end.

Each concern is a part with a small interface, in its own module; :meth:`Trainer.run` only
calls them, in order. It never asks which parallel strategy runs (strategy.py) nor who
makes the updates (update_step.py). Rank 0 alone writes events (on several nodes: the first
rank of each node, into its node's run directory).
"""

from __future__ import annotations

from .build import Built, Setup, build
from .cadence import end_step
from .control_handler import DiskFullStop
from .evaluate import at_start as eval_at_start
from .exchange import Row
from .failure_checkpoint import naming
from .nonfinite import NonFiniteLoss
from .start_event import write as write_start_event
from .update_step import Update


class Trainer:
    def __init__(self, setup: Setup) -> None:
        self.s = setup
        self.b: Built | None = None

    def run(self) -> None:
        s, p, out = self.s, self.s.p, self.s.out
        out.status("starting")
        # Build and resume: the model, its strategy, the update step, the data, the loop's
        # parts; a checkpoint loaded where the strategy loads one (build.py).
        b = self.b = build(s)
        state, guard = b.state, b.rescue.guard
        write_start_event(s, b)
        b.compiled.begin(out.status)  # "compiling" until the first step completes
        if b.eval_loaders and eval_at_start(
            p.train.eval_at_start, state.step, state.evaluated_at, s.changes
        ):
            with naming("eval"):  # the loaded (or initial) state: nothing new to keep
                b.evaluator.run(state)  # train.eval_at_start: step 0, or a resume that turns it on

        end = end_step(p.train)
        b.epochs.begin()
        while state.step < end and not b.early_stop.stopping:
            b.checkpointer.settle_finished()  # a background write that ended: its event
            rows: list[Row] | None
            if state.paused:
                rows = b.control.paused(state.step)
            else:
                # Update: every micro-batch's forward and backward, then the update. A log
                # step's numbers ride with its gradients' reduction: every rank knows the
                # log steps beforehand, so a resumed run carries them at the same steps.
                logging = b.cadence.logs(state.step + 1)
                update = b.update.run(state.step, state.batches, b.logger, logging)
                if update.stop:  # nan_policy = "stop": the last finite state saved, then fail
                    b.nan.stop(state.step, update.last_loss, update.grad_norm)
                state.step += 1
                s.watch.step_done()
                b.compiled.first_step_done(out.status, out.log)
                b.timeouts.first_step_done(out.log)  # start-up's timeout gives way
                b.logger.step_done(update.last_loss, update.skipped)
                # Verdicts gated on the device, read where the host syncs anyway (nonfinite.py).
                settled = b.update.settle(b.cadence.boundary(state.step), state.step)
                b.logger.add_skipped(settled.skipped)
                if settled.trip is not None:  # stop: back to the last finite step, then stop
                    b.nan.rewind(state, settled.trip)
                # The update is complete: a failure from here to the checkpoint keeps its
                # state in a checkpoint (reason "failure") before the run fails, naming it.
                with guard("the task's hooks"):
                    b.hooks.step_end(state.step, state.batches, b.model, update.output)
                b.epochs.step_end(state.step, state.batches)
                with guard("the profiler"):
                    b.profiler.step_end(state.step)  # a capture moves on, or ends and is written
                # Log, evaluate, checkpoint. A write in flight settles before the log of a
                # step that saves (or ends) and would wait for it anyway: its event comes
                # before this step's.
                if state.step >= end or b.cadence.checkpoints(state.step, False):
                    b.checkpointer.settle_before_log()
                with guard("logging"):
                    rows = self.log(update) if logging else None
                with guard("eval"):
                    improved = b.cadence.evaluates(state.step) and b.evaluator.run(state)
                if why := b.cadence.checkpoints(state.step, improved, b.early_stop.stopping):
                    b.checkpointer.save(why, wait=False)
                # Control: at a log step its proposals came with the rows; else a check of
                # its own where one is due.
                rows = rows if rows is not None else b.control.check(state.step)
                if rows is None:
                    continue
            if (reason := b.control.obey(state, rows)) is not None:
                return self.stop(reason)
        self.end()

    def log(self, update: Update) -> list[Row]:
        """A log step: every rank's numbers, the step event; a non-finite loss under
        ``nan_policy = "stop"`` keeps the weights if they are still finite, then fails; too
        many skipped updates in a row (``nan_skip_limit``) fail the run."""
        b = self.b
        assert b is not None  # run() built it before its first step
        try:
            rows = b.logger.log(b.state.step, b.state.batches.position, update)
        except NonFiniteLoss as e:
            b.nan.fail(b.state.step, e)
            raise
        b.nan.check_streak(b.state.step, b.update.streak)  # judged here: the event has the count
        return rows

    def land_write(self) -> None:
        """A crash: a background checkpoint write in flight (an interval's, one step back)
        still completes, so LATEST names it (checkpoint_writer.py)."""
        if self.b is not None:
            self.b.checkpointer.writer.land()

    def release(self) -> None:
        """The run's process-wide hooks removed (the optimizer step watch, step_watch.py):
        a process that runs another run after this one (the harness) starts clean."""
        if self.b is not None:
            self.b.opts.watch.remove()

    def stop(self, reason: str) -> None:
        """A stop command or a scheduler signal: every rank at the same step."""
        b, s = self.b, self.s
        assert b is not None  # run() built it before its first step
        exchanges = b.exchange.counts()
        s.out.status("stopping", reason=reason)
        saved = b.checkpointer.save(reason if s.p.checkpoint.on_stop else None)
        b.hooks.train_end(b.model, "signal" if reason == "signal" else "stopped")
        # ``checkpointed`` is false only when a checkpoint was due and could not be written:
        # the supervisor then records the stop as interrupted (exit 130), not a clean stop.
        s.out.status("stopped", reason=reason, step=b.state.step, checkpointed=saved,
                     exchanges=exchanges)  # fmt: skip

    def end(self) -> None:
        """``max_steps`` reached, or early stopping's patience ran out: what the last step's
        boundaries did not do already."""
        b, s = self.b, self.s
        assert b is not None  # run() built it before its first step
        step = b.state.step
        early = b.early_stop.stopping and step < end_step(s.p.train)
        reason = b.early_stop.reason() if early else "max_steps reached"
        b.profiler.finish(step, "end")
        improved = False
        if b.eval_loaders and not b.cadence.evaluates(step) and b.state.evaluated_at != step:
            with b.rescue.guard("eval"):
                improved = b.evaluator.run(b.state)
        if s.p.checkpoint.at_end:
            if not b.checkpointer.save("end") and not b.checkpointer.kept:
                # Nothing of the run is kept (a full disk from its start): it has not finished.
                # With an earlier checkpoint it has, its LATEST named in the error event (a
                # full disk stops no run: docs/failures.md). Every rank has the same outcome.
                raise DiskFullStop(f"no checkpoint of the run was kept: {b.checkpointer.failure}")
        elif improved:
            b.checkpointer.save("best")
        b.checkpointer.save(None)  # a write still in flight ends before the run does
        b.hooks.train_end(b.model, "finished")
        s.out.status("finished", reason=reason, step=step, exchanges=b.exchange.counts())
