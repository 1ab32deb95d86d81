"""A task that records what the engine tells it: its context, every hook call, its state.

Used by tests/test_task_hooks.py as ``tests.hooks_task:HooksTask`` (run from the repo root).
It writes what it saw into ``ctx.task_dir`` as JSON, one file per rank and session (named by
the session's start step); the tests read them. Its loss is scaled by a carried value (an
average of its past losses, per rank) that only ``state_dict``/``load_state_dict`` carry
across a resume: a resume that lost it would train differently.
"""

from __future__ import annotations

import json
import os
import time

import torch

from gpu_console.tasks.base import TaskOutput
from gpu_console.tasks.mlp import MLPTask


class HooksTask(MLPTask):
    def __init__(self, config):
        super().__init__(config)
        self.carry = torch.zeros(())
        self.micro_steps = 0
        self.seen = {"steps": [], "epochs": [], "evals": [], "end": [], "eval_starts": []}

    def _write(self, what: str, doc) -> None:
        ctx = self.ctx
        path = ctx.task_dir / f"{what}-{ctx.rank}-{ctx.start_step}.json"
        path.write_text(json.dumps(doc))

    def build_model(self):
        ctx = self.ctx
        p = ctx.profile
        self._write(
            "ctx",
            {
                "rank": ctx.rank,
                "world_size": ctx.world_size,
                "local_rank": ctx.local_rank,
                "device": str(ctx.device),
                "run_dir": str(ctx.run_dir),
                "task_dir": str(ctx.task_dir),
                "task_dir_exists": ctx.task_dir.is_dir(),
                "batch_size": p.data.batch_size,
                "grad_accum": p.train.grad_accum,
                "max_steps": p.train.max_steps,
                "hidden_dim": p.task.hidden_dim,
                "resumed": ctx.resumed,
                "start_step": ctx.start_step,
                "step": ctx.step,
            },
        )
        return super().build_model()

    def compute(self, model, batch):
        out = super().compute(model, batch)
        if not model.training:
            return out
        time.sleep(float(os.environ.get("PACE_S", "0")))
        self.micro_steps += 1
        loss = out.loss * (1 + self.carry)
        self.carry = 0.9 * self.carry + 0.1 * out.loss.detach()
        return TaskOutput(loss=loss, samples=out.samples, metrics=out.metrics)

    def on_step_end(self, model, output, ctx):
        assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.seen["steps"].append([ctx.step, ctx.epoch, float(output.loss), ctx.batch_in_epoch])
        self.seen["optimizers"] = {n: type(o).__name__ for n, o in ctx.optimizers.items()}

    def on_eval_start(self, model, ctx):
        self.seen["eval_starts"].append([ctx.step, len(self.seen["evals"])])

    def on_epoch_end(self, model, ctx):
        self.seen["epochs"].append([ctx.epoch, ctx.step])

    def on_eval_end(self, model, metrics, ctx):
        self.seen["evals"].append([ctx.step, metrics])
        ctx.log(f"eval hook at step {ctx.step}: loss {metrics['loss']:.6f}")

    def on_train_end(self, model, ctx, reason):
        self.seen["end"].append([reason, ctx.step])
        (ctx.task_dir / f"sample-{ctx.rank}.txt").write_text(f"{reason} at {ctx.step}\n")
        self._write("hooks", self.seen)

    def state_dict(self):
        return {"carry": self.carry, "micro_steps": self.micro_steps, "rank": self.ctx.rank}

    def load_state_dict(self, state):
        assert state["rank"] == self.ctx.rank, state
        self.carry = state["carry"]
        self.micro_steps = state["micro_steps"]
        self.seen["restored"] = {"micro_steps": self.micro_steps, "carry": float(self.carry)}
