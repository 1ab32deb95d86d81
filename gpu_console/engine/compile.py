"""``train.compile``: the model compiled with ``torch.compile``, in place, inside DDP.

How, and why so:

- In place (``nn.Module.compile()``), before DDP wraps the model: the model object, its
  parameter names and ``state_dict`` keys stay the same (no ``_orig_mod.`` prefix), so a
  compiled run's checkpoint resumes into an uncompiled run and back, and ``export`` is
  unchanged. It is PyTorch's recommended shape for DDP: the compiled module runs inside
  DDP's forward, where Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on
  here) splits the graph at DDP's bucket boundaries so the gradients' all-reduce overlaps
  the backward as in eager mode.
- What runs compiled: the model's forward and backward in training, whoever calls the model
  (the engine's step, or a task's own ``train_step``: its model is the compiled one). The
  task's loss in ``compute`` outside the model stays eager. The eval runs eager (a
  ``no_grad`` forward is another graph, and its last batch another shape: compiling it
  would cost compile time and recompiles for little).
- Compilation happens in the first step: the run says ``compiling`` (with when it began)
  until that step completes, so a long first step is never a stall.
- Recompilations: Dynamo's count of graphs compiled, taken after the first step; any growth
  later (the inputs' shapes or types change: a ragged last batch, a new sequence length) is
  a warning in the log and a ``recompiles`` count in step events.
- The compiled kernels are cached on disk (``TORCHINDUCTOR_CACHE_DIR``, set by the launcher:
  launch.py), so a restart or a ``--resume`` compiles from the cache, much faster.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import torch_private


def mode_of(setting: bool | str) -> str | None:
    """``train.compile`` as a torch.compile mode; None: not compiled."""
    if setting is False:
        return None
    return "default" if setting is True else str(setting)


def _graphs() -> int | None:
    return torch_private.unique_graphs()


class Compiled:
    """The compile phase of one run: the mode, when it began and ended, recompiles."""

    def __init__(self, mode: str | None):
        self.mode = mode
        self.began: float | None = None
        self.seconds: float | None = None  # the first step, compile included
        self.graphs: int | None = None  # after the first step
        self.recompiles = 0
        self._warned = 0

    @property
    def on(self) -> bool:
        return self.mode is not None

    def apply(self, model: nn.Module) -> None:
        if not self.on:
            return
        torch_private.compile_for_ddp()
        model.compile(mode=self.mode)

    def begin(self, status: Callable[..., None]) -> None:
        """Before the first step: the run says ``compiling`` until it completes."""
        if not self.on:
            status("running")
            return
        self.began = time.time()
        status("compiling", reason=f"torch.compile mode {self.mode}", since=self.began)

    def first_step_done(self, status: Callable[..., None], log: Callable[[str, str], None]) -> None:
        if not self.on or self.seconds is not None:
            return
        self.seconds = time.time() - (self.began or time.time())
        self.graphs = _graphs()
        graphs = f": {self.graphs} graph(s)" if self.graphs is not None else ""
        log("info", f"compiled ({self.mode}) in {self.seconds:.1f} s{graphs}")
        status("running", reason="compiled", compiled_s=round(self.seconds, 3))

    def check(self, log: Callable[[str, str], None]) -> None:
        """At a log step: recompiles since the first step, warned about as they grow."""
        if not self.on:  # nothing compiled: Dynamo's counters are not read
            return
        now = _graphs()
        if self.graphs is None or now is None:  # this torch does not count graphs
            return
        self.recompiles = max(0, now - self.graphs)
        if self.recompiles > self._warned:
            self._warned = self.recompiles
            log(
                "warning",
                f"torch.compile recompiled {self.recompiles} time(s) since the first step: "
                "the model's input shapes or types change (a ragged last batch, varying "
                "lengths); each recompile stalls a step",
            )

    def eager(self) -> contextlib.AbstractContextManager:
        """The eval runs eager (see the module's docstring)."""
        if not self.on:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("force_eager")

    def start_fields(self) -> dict[str, Any]:
        return {"compile": self.mode or False}

    def step_fields(self) -> dict[str, Any]:
        if not self.on:
            return {}
        fields: dict[str, Any] = {"recompiles": self.recompiles}
        if self.seconds is not None:
            fields["compile_s"] = round(self.seconds, 3)
        return fields
