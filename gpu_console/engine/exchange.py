"""What ranks tell each other at a log or control step, carried by the gradients' all-reduce.

Every rank fills its own row of a ``[world_size, WIDTH]`` float32 table (zeros elsewhere);
summing the tables over ranks is then an all-gather. On the steps that need it (each log
step, each control check) the table rides at the end of the gradient all-reduce that DDP
makes anyway, through a communication hook, so logging and control cost no collective of
their own. That matters on CPU: a gloo collective costs about 1.5 ms of CPU here however
small it is, a quickstart step about 5 ms, and a separate collective every ten steps was
the engine's main overhead against a plain loop (benchmarks/overhead.py).

Every other step the hook does what DDP's built-in all-reduce does (scale by 1/world_size
while the gradients are in the bucket, then sum), so gradients are bit for bit those of
plain DDP at two ranks. CPU ranks on one machine sum through shared memory instead
(shared_reduce.py): the same bits at two ranks, and the same bits on every rank at any
number. Over gloo (CPU ranks on several machines) three ranks or more sum in rank order too
(:func:`ordered_sum`), the shared-memory sum's bits: gloo's ring all-reduce adds each element
in an order set by its place in the bucket and the bucket's length, and DDP lays its buckets
out anew after each session's first step (parameter order, then the order the gradients
arrived), so a resumed session's first update would differ from the uninterrupted run's in
the last bits, and the run from there on (issue 43). Where no bucket can carry the table
(no float32 gradients, or DDP never calls the hook), :meth:`Exchange.gather` makes one
collective of its own instead.

Integers (sample counts, memory bytes, step numbers) travel as two float32 halves, each
exact, so nothing is rounded on the way. After them, a run may add extra float columns (the
task's train-time metrics, train_metrics.py): the same number on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_SPLIT = 2**22  # low half < 2**22 and high half < 2**24 stay exact in float32: 2**46 in all

# The row: floats first, then integers as (high, low) pairs.
FLOATS = ("last_loss", "loss_sum")
INTS = (
    "samples",
    "tokens",
    "allocated",
    "reserved",
    "peak",
    "alloc_retries",
    "device_used",
    "device_total",
    "cmd",
    "signalled",
    "next_check",
    "cmd_arg",
)
CONTROL = 4  # the last INTS: a control proposal (cmd, signalled, next_check, cmd_arg)
WIDTH = len(FLOATS) + 2 * len(INTS)


@dataclass
class Row:
    """One rank's numbers, as read back from the gathered table."""

    last_loss: float
    loss_sum: float
    samples: int
    tokens: int
    allocated: int
    reserved: int
    peak: int
    alloc_retries: int  # the CUDA caching allocator's retries so far (0 on CPU)
    device_used: int  # the GPU's memory in use by every process (0 on CPU)
    device_total: int  # the GPU's memory (0 on CPU)
    cmd: int  # control code proposed by a control reader (0: none)
    signalled: int  # 1 if a stop signal reached this rank
    next_check: int  # the step a control reader proposes for the next check (0: none)
    cmd_arg: int = 0  # the command's argument (profile: its steps), 0 without one
    extra: list[float] = field(default_factory=list)  # the run's extra columns (metrics)


def encode_ints(values: list[int]) -> list[float]:
    out: list[float] = []
    for v in values:
        v = max(0, int(v))
        out += [float(v // _SPLIT), float(v % _SPLIT)]
    return out


def decode(table: torch.Tensor) -> list[Row]:
    rows = []
    for r in table.tolist():
        floats = r[: len(FLOATS)]
        pairs = r[len(FLOATS) : WIDTH]
        ints = [int(pairs[i]) * _SPLIT + int(pairs[i + 1]) for i in range(0, len(pairs), 2)]
        # extra by assignment: mypy cannot tell the unpacked columns stop short of it
        row = Row(*floats, *ints)
        row.extra = r[WIDTH:]
        rows.append(row)
    return rows


class Exchange:
    """The DDP communication hook and the table it may carry."""

    def __init__(
        self, rank: int, world_size: int, device: torch.device, shared=None, dtype=torch.float32
    ):
        self.rank, self.world_size, self.device = rank, world_size, device
        # float64 under train.precision = "fp64": its losses are carried without rounding
        # (and the table rides the float64 gradient buckets as it rides float32 ones).
        self.dtype = dtype
        self.shared = shared  # a SharedReduce for CPU ranks on one machine, else None (gloo)
        self._pending: torch.Tensor | None = None  # this step's table, before the all-reduce
        self._result: torch.Tensor | None = None  # the summed table, after it
        self.carried = 0  # tables that rode with the gradients' all-reduce
        self.separate = 0  # tables that needed a collective of their own
        self.extra = 0  # extra columns, set by the last prepare (the same on every rank)

    # -- the hook ----------------------------------------------------------------------------

    def hook(self, _state, bucket):  # unannotated: DDP rejects the string annotations here
        buf = bucket.buffer()
        # DDP's built-in hook divides as it copies gradients into the bucket (x * (1/n)):
        # the same multiplication here keeps gradients bit-identical to plain DDP.
        buf.mul_(1.0 / self.world_size)
        table = self._pending
        if table is None or buf.dtype != self.dtype:
            return self._all_reduce(buf)
        self._pending = None
        n = buf.numel()

        def split(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()
            self._result = out[n:].view(self.world_size, -1)
            return out[:n]

        self.carried += 1
        return self._all_reduce(torch.cat([buf, table.flatten()])).then(split)

    def _all_reduce(self, t: torch.Tensor) -> torch.futures.Future:
        """A future of the sum over ranks of ``t``: through shared memory when the ranks
        share one (float32 only, the same choice on every rank), else gloo or NCCL. One
        rank's sum is its own table: no collective (on CPU a gloo call with itself cost more
        than half of a log step's time, issue 26)."""
        if self.world_size == 1:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(t)
            return fut
        if self.shared is not None and t.dtype == torch.float32:
            fut = torch.futures.Future()
            fut.set_result(self.shared.all_reduce(t))
            return fut
        if self.world_size > 2 and t.device.type == "cpu":
            # Two ranks' a + b is b + a: gloo's own all-reduce is exact there, in one call.
            fut = torch.futures.Future()
            fut.set_result(ordered_sum(t, self.world_size))
            return fut
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    # -- a step's exchange -------------------------------------------------------------------

    def prepare(
        self,
        floats: Sequence[torch.Tensor | float],
        ints: list[int],
        extra: Sequence[torch.Tensor | float] = (),
    ) -> None:
        """Before the backward of a step that exchanges: this rank's row goes into the table.

        ``floats`` and ``extra`` are 0-dim tensors on the device (no host sync; on CPU
        ``extra`` may hold plain numbers too); ``ints`` plain ints. ``extra`` must have the
        same length on every rank.
        """
        self.extra = len(extra)
        if self.device.type == "cpu":
            # A CPU tensor's value is a host read, not a sync: the row in one tensor from
            # host numbers, not a stack, cast and copy per part (the same values; issue 26).
            values = [*map(float, floats), *encode_ints(ints), *map(float, extra)]
            row = torch.tensor(values, dtype=self.dtype)
        else:
            row = self._device_row(floats, ints, extra)
        table = torch.zeros(
            self.world_size, WIDTH + self.extra, dtype=self.dtype, device=self.device
        )
        table[self.rank] = row
        self._pending, self._result = table, None

    def _device_row(self, floats, ints, extra) -> torch.Tensor:
        """The row on a GPU, built there: reading a value to the host would sync."""
        ints_t = torch.tensor(encode_ints(ints), dtype=self.dtype)
        if self.device.type == "cuda":  # a pageable copy would sync the host before backward
            ints_t = ints_t.pin_memory().to(self.device, non_blocking=True)
        parts = [
            torch.stack([f.detach().reshape(()).to(self.dtype) for f in floats]),
            ints_t.to(self.device),
        ]
        if extra:
            parts.append(torch.stack([f.detach().reshape(()).to(self.dtype) for f in extra]))
        return torch.cat(parts)

    def gather(self) -> list[Row]:
        """After the backward: every rank's row, from the gradients' all-reduce when the table
        rode with it, else from a collective of its own (the same on every rank: whether a
        bucket could carry it depends on the model, which every rank shares)."""
        if self._result is None:
            table, self._pending = self._pending, None
            if table is None:
                raise RuntimeError("Exchange.gather() without prepare()")
            self._result = self._all_reduce(table).wait()
            self.separate += 1
        rows, self._result = decode(self._result), None
        return rows

    def counts(self) -> dict[str, int]:
        return {"carried": self.carried, "separate": self.separate}

    def control_only(self, proposal: tuple[int, int, int, int]) -> list[Row]:
        """A control check outside a log step (paused, or between sparse log steps): one
        collective of its own, carrying only the control proposal (the rest zeros)."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        ints = [0] * (len(INTS) - CONTROL) + list(proposal)
        self.prepare([zero] * len(FLOATS), ints, [zero] * self.extra)
        return self.gather()


def ordered_sum(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Collective: the sum over ranks of ``t``, every element added in rank order
    (``((x0 + x1) + x2) + …``), in a new tensor: the same bits wherever the element sits in
    ``t`` and however long ``t`` is, and the bits of the shared-memory sum (shared_reduce.py).

    Rank r adds every rank's r-th slice (an all-to-all), then every rank gathers the sums:
    what a ring all-reduce moves, 2 (n - 1) / n of ``t`` in and out of each rank.
    """
    flat = t.reshape(-1)
    n = flat.numel()
    per = -(-n // world_size)
    send = (
        flat if n == per * world_size else torch.cat([flat, flat.new_zeros(per * world_size - n)])
    )
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send)
    parts = got.view(world_size, per)
    mine = parts[0].clone()
    for j in range(1, world_size):
        mine.add_(parts[j])
    out = torch.empty_like(send)
    dist.all_gather_into_tensor(out, mine)
    return out[:n].view_as(t)
