"""The trainer's parts, each alone and in-process (no torchrun): the cadence, the step
logger, the control handler, the engine's update step behind a strategy, the checkpointer's
settling. The whole trainer runs in real torchrun in test_engine.py and the others."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gpu_console.engine.cadence import Cadence
from gpu_console.engine.checkpointer import Checkpointer
from gpu_console.engine.control import Decision
from gpu_console.engine.control_handler import ControlHandler
from gpu_console.engine.exchange import Row
from gpu_console.engine.memory_watch import MemoryWatch
from gpu_console.engine.nonfinite import NonFiniteLoss
from gpu_console.engine.optim_set import Optimizers
from gpu_console.engine.step_log import Parts, StepLogger
from gpu_console.engine.strategy import Strategy
from gpu_console.engine.train_state import TrainState
from gpu_console.engine.update_step import EngineStep, for_task
from gpu_console.profile import CheckpointConfig, TrainConfig
from gpu_console.tasks.base import TaskOutput
from gpu_console.timings import Stopwatch

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

CPU = SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)


class Out:
    """A Reporter that keeps what it is told."""

    active = True

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def status(self, state: str, **fields) -> None:
        self.events.append(("status", {"state": state, **fields}))

    def log(self, level: str, message: str, **fields) -> None:
        self.events.append(("log", {"level": level, "message": message, **fields}))


class Beat:
    def set(self, step: int, phase: str, detail: str = "") -> None:
        self.step, self.phase = step, phase


def test_cadence_knows_the_log_eval_checkpoint_steps_and_the_boundaries():
    control = SimpleNamespace(due=lambda n: n == 7)
    train = TrainConfig(max_steps=25, log_every=10, eval_every=5)
    c = Cadence(train, CheckpointConfig(every_steps=4), control, evaluates=True)
    assert [n for n in range(1, 26) if c.logs(n)] == [10, 20, 25]
    assert [n for n in range(1, 26) if c.evaluates(n)] == [5, 10, 15, 20, 25]
    assert [n for n in range(1, 13) if c.boundary(n)] == [4, 5, 7, 8, 10, 12]
    assert not Cadence(train, CheckpointConfig(), control, evaluates=False).evaluates(5)


class Metrics:
    def add(self, output) -> None:
        pass

    def columns(self) -> list:
        return []

    def reduced(self, extras) -> dict:
        return {}

    def reset(self) -> None:
        pass


def logger_of(out: Out, train: TrainConfig, exchange=None) -> StepLogger:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opts = Optimizers.single(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    compiled = SimpleNamespace(check=lambda log: None, step_fields=lambda: {})
    mfu = SimpleNamespace(of=lambda rate: None)
    control = SimpleNamespace(proposal=lambda step: (0, 0, step + 1, 0))
    return StepLogger(Parts(out, CPU, train, opts, exchange, control, mfu, Stopwatch(),
                            Metrics(), compiled, Beat(), MemoryWatch(0.95, print)))  # fmt: skip


def row(loss: float, samples: int) -> Row:
    return Row(loss, loss * 2, samples, 0, 1, 2, 3, 0, 0, 0, 0, 0, 0)


def test_the_step_logger_writes_a_step_event_from_the_ranks_rows_and_starts_a_new_window():
    out = Out()
    rows = [row(0.5, 8)]
    exchange = SimpleNamespace(gather=lambda: rows, prepared=[])
    exchange.prepare = lambda floats, ints, extra: exchange.prepared.append(ints)
    log = logger_of(out, TrainConfig(max_steps=4, log_every=2), exchange)
    output = TaskOutput(torch.tensor(0.5), samples=8)
    for step in range(2):
        log.micro_batch(output, torch.tensor(0.5), fill_row=step == 1, step=step)
        log.step_done(torch.tensor(0.5), skipped=0)
    assert exchange.prepared[0][:2] == [16, 0]  # the window's samples and tokens, filled once
    update = SimpleNamespace(grad_norm=torch.tensor(1.5), grad_norms={})
    position = SimpleNamespace(epoch=0)
    assert log.log(2, position, update) == rows
    ((kind, fields),) = out.events
    assert kind == "step" and fields["step"] == 2 and fields["loss"] == 0.5
    assert fields["loss_avg"] == 0.5 and fields["grad_norm"] == 1.5
    assert fields["memory"] == [{"rank": 0, "allocated": 1, "reserved": 2, "peak": 3}]
    assert log.window.steps == 0 and log.window.samples == 0


def test_the_step_logger_stops_on_a_non_finite_loss_under_the_stop_policy():
    out = Out()
    log = logger_of(out, TrainConfig(max_steps=4, log_every=2, nan_policy="stop"))
    log.window.steps = 2
    with pytest.raises(NonFiniteLoss, match="loss is nan in steps 1-2"):
        log.event(2, SimpleNamespace(epoch=0), [row(math.nan, 8)], None)
    assert out.events == []


class Control:
    def __init__(self, decision: Decision) -> None:
        self.decision, self.warnings, self.stopped = decision, [], False

    def decide(self, step, proposals) -> Decision:
        return self.decision

    def stopping(self) -> None:
        self.stopped = True


def handler_of(decision: Decision, out: Out):
    profiler = SimpleNamespace(finished=[], requested=[])
    profiler.finish = lambda step, why: profiler.finished.append(why)
    profiler.request = lambda step, n, paused, ack: profiler.requested.append((n, paused))
    ckpt = SimpleNamespace(requested=lambda step: {"checkpoint": {"step": step}})
    logger = logger_of(out, TrainConfig(max_steps=10, log_every=5))
    control = Control(decision)
    h = ControlHandler(out, CPU, Beat(), control, None, profiler, ckpt, logger)
    return h, control, profiler, logger


def test_the_control_handler_pauses_resumes_and_acknowledges():
    out = Out()
    state = TrainState(step=5, batches=None)
    h, _, profiler, logger = handler_of(Decision("pause", "c1", False), out)
    assert h.obey(state, [row(0, 0)]) is None
    assert state.paused and profiler.finished == ["pause"]
    h, _, _, logger = handler_of(Decision("resume", "c2", False), out)
    logger.step_done(torch.tensor(0.5), skipped=2)  # before the pause, since the last log
    before = logger.window
    assert h.obey(state, [row(0, 0)]) is None
    assert not state.paused and logger.window is not before  # the window starts again...
    assert logger.window.steps == 0 and logger.window.skipped == 2  # ...its skips still due
    acks = [(f["id"], f["state"]) for k, f in out.events if k == "control"]
    assert acks == [("c1", "received"), ("c1", "done"), ("c2", "received"), ("c2", "done")]


def test_the_control_handler_answers_a_checkpoint_request_and_stops():
    out = Out()
    state = TrainState(step=3, batches=None)
    h, _, _, _ = handler_of(Decision("checkpoint", "c", False), out)
    assert h.obey(state, [row(0, 0)]) is None
    assert out.events[-1][1]["checkpoint"] == {"step": 3}
    h, control, profiler, _ = handler_of(Decision("stop", "s", False), out)
    assert h.obey(state, [row(0, 0)]) == "stop" and control.stopped
    h, _, profiler, _ = handler_of(Decision(None, None, True), out)
    assert h.obey(state, [row(0, 0)]) == "signal" and profiler.finished == ["signal"]


class Plain(Strategy):
    """One rank, no wrapper: the interface's smallest implementation."""

    def __init__(self, model: nn.Module) -> None:
        self.wrapped = SimpleNamespace(module=model, no_sync=contextlib.nullcontext)
        self.model = model
        self.synced: list[bool] = []

    @property
    def compute_model(self):
        return self.model

    def no_sync(self):
        self.synced.append(False)
        return contextlib.nullcontext()

    def clip(self, optimizers, max_norm: float):
        return optimizers.clip(max_norm)

    # The rest of the interface (Strategy is an ABC): never reached by these tests.
    def make_scaler(self, precision: str, device_type: str, init_scale: float):
        return None

    def wrap(self, model, task, precision, optimizers, warn):
        raise NotImplementedError

    def gradient_reduce(self, d, cfg, run_dir):
        raise NotImplementedError

    def save(self, job):
        raise NotImplementedError

    def start_fields(self):
        raise NotImplementedError


class Task:
    def compute(self, model, batch) -> TaskOutput:
        return TaskOutput(model(batch).sum(), samples=len(batch))


class Batches:
    def __init__(self, batch: torch.Tensor) -> None:
        self.batch, self.position = batch, SimpleNamespace(epoch=0, samples=0)

    def next(self) -> torch.Tensor:
        return self.batch


def engine_step(policy: str, accum: int = 1, **train_keys):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opts = Optimizers.single(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    train = TrainConfig(max_steps=4, grad_accum=accum, nan_policy=policy, **train_keys)
    step = for_task(Task(), opts, train, CPU, None, None, Beat())
    strategy = Plain(model)
    step.bind(strategy, contextlib.nullcontext())
    return step, model, strategy


def test_the_engine_step_accumulates_with_sync_off_until_the_last_micro_batch():
    step, model, strategy = engine_step("stop", accum=3)
    assert isinstance(step, EngineStep) and step.owner == "engine"
    before = model.weight.detach().clone()
    logger = SimpleNamespace(micro_batch=lambda *a: None)
    update = step.run(0, Batches(torch.ones(4, 2)), logger, logging=True)
    assert strategy.synced == [False, False]  # two of three micro-batches without sync
    assert not update.stop and update.skipped == 0
    assert float(update.grad_norm) == pytest.approx(4 * math.sqrt(3))
    assert not torch.equal(model.weight, before)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_the_engine_step_skips_or_stops_on_a_non_finite_gradient(policy):
    step, model, _ = engine_step(policy)
    before = model.weight.detach().clone()
    logger = SimpleNamespace(micro_batch=lambda *a: None)
    update = step.run(0, Batches(torch.tensor([[math.inf, 1.0]])), logger, logging=False)
    assert (update.skipped, update.stop) == ((1, False) if policy == "skip" else (0, True))
    assert torch.equal(model.weight, before)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_the_engine_step_counts_skipped_updates_in_a_row():
    step, _, _ = engine_step("skip", nan_skip_limit=2)
    logger = SimpleNamespace(micro_batch=lambda *a: None)
    bad, good = Batches(torch.tensor([[math.inf, 1.0]])), Batches(torch.ones(1, 2))
    for n, batches in enumerate([bad, good, bad]):
        step.run(n, batches, logger, logging=False)
    assert not step.streak.tripped  # a finite update between broke the streak
    step.run(3, bad, logger, logging=False)
    assert step.streak.tripped and "steps 3-4" in step.streak.message(4)


def test_the_checkpointer_settles_an_outcome_into_an_event_or_an_error():
    ckpt = Checkpointer.__new__(Checkpointer)  # settle() needs no writer nor process group
    ckpt.out, ckpt.d = Out(), CPU
    ckpt.newest = SimpleNamespace(event=None)
    assert ckpt.settle(None)
    assert ckpt.settle({"ok": True, "event": {"step": 4, "reason": "interval"}})
    assert ckpt.newest.event == {"step": 4, "reason": "interval"}
    failed = {"ok": False, "step": 6, "reason": "interval", "error": "disk full", "latest": None}
    assert not ckpt.settle(failed)
    kind, fields = ckpt.out.events[-1]
    assert kind == "log" and fields["level"] == "error" and "step 6" in fields["message"]
    assert fields["checkpoint_failed"]["error"] == "disk full"


def test_a_cpu_rank_reads_its_own_resident_set_after_a_fork():
    """The RSS is read from a kept-open /proc/self/statm; a forked child (a data worker) must
    not read its parent's through the inherited descriptor."""
    import os
    import resource

    from gpu_console.engine.metrics import memory_sample

    def fresh() -> int:  # this process's own resident set, from a file opened now
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    memory_sample(torch.device("cpu"))  # the parent's descriptor is open before the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: 512 MiB more, touched, then its reading and its own
        try:
            block = bytearray(512 * 2**20)
            block[::4096] = b"x" * len(block[::4096])
            os.write(w, f"{memory_sample(torch.device('cpu'))[0]} {fresh()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    child, child_own = (int(x) for x in os.read(r, 128).split())
    os.waitpid(pid, 0)
    os.close(r)
    # A child's resident set is not its parent's plus what it added: the parent's file-backed
    # pages (torch's libraries) are not mapped in the child until it touches them. So the
    # test compares the child's reading with the child's own, read from a file it opened.
    assert abs(child - child_own) < 64 * 2**20, (child, child_own)
    assert abs(fresh() - child_own) > 128 * 2**20  # the parent's is far from it
