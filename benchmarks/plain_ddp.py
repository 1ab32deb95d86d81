"""A minimal hand-written DDP training loop: the baseline the engine is measured against.

    python -m torch.distributed.run --nproc-per-node 2 --standalone benchmarks/plain_ddp.py \
        [--steps N] [--pin] [--optimizer-impl IMPL] [--out FILE]
        [--kind mlp|transformer] [--device cpu|cuda] [--precision fp32|bf16] [--tf32]
        [--cudnn-benchmark]

The model and the data are the engine's own (``gpu_console.tasks.mlp``, or with ``--kind
transformer`` ``gpu_console.tasks.transformer``), built the same way
(same seeds, batch size, AdamW, gradient clipping, warmup + cosine schedule, DataLoader
with the task's batched collate and no workers; ``benchmarks/overhead.py`` passes the
profile's values and its DDP constructor arguments), so the only difference from
``gpu-console run quickstart`` is the engine itself: its events, control checks, loss and
memory logging, signal handling. Nothing is logged while timing.

``--pin`` places each rank the way the engine's ``distributed.cpu_affinity`` does: this
rank's share of the cores and as many threads. Without it, ranks run wherever the kernel
puts them with torchrun's default of one thread (OMP_NUM_THREADS=1). ``--optimizer-impl``
picks AdamW's implementation as the engine's ``train.optimizer_impl`` does; without it,
PyTorch chooses (on CPU: a Python loop over the parameters).

``--device cuda`` (``benchmarks/gpu_overhead.py``): rank i on GPU i of those visible, NCCL,
pinned batches copied without blocking, ``--precision bf16`` under autocast, ``--tf32`` as
the engine's ``hardware.tf32``, ``--cudnn-benchmark`` as its ``hardware.cudnn_benchmark``;
the clock reads after a ``torch.cuda.synchronize()``.

Rank 0 times the steady state itself (``perf_counter`` from the end of step
``--warmup-steps`` to the end of the last step) and prints one JSON line (and writes it to
``--out``): ``{"steps_per_s": ..., ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from gpu_console.engine.optim_build import adamw_kwargs
from gpu_console.tasks.base import batch_collate
from gpu_console.tasks.configs import MLPConfig, TransformerConfig
from gpu_console.tasks.mlp import MLPTask
from gpu_console.tasks.transformer import TransformerTask

TASKS = {"mlp": (MLPTask, MLPConfig), "transformer": (TransformerTask, TransformerConfig)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup-steps", type=int, default=None, help="untimed (default 10%%)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--lr-warmup", type=int, default=20, help="lr warmup steps")
    ap.add_argument("--clip", type=float, default=1.0, help="0 = no clipping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=0, help="shuffling seed")
    ap.add_argument("--kind", choices=sorted(TASKS), default="mlp", help="the built-in task")
    ap.add_argument("--task", default="{}", help="the task's config fields as JSON")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--tf32", action="store_true", help="TF32 matmuls and convolutions (CUDA)")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="cuDNN autotuning (CUDA)")
    ap.add_argument("--ddp", default="{}", help="DistributedDataParallel keyword args as JSON")
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own cores")
    ap.add_argument(
        "--optimizer-impl",
        choices=("default", "fused", "foreach", "for-loop"),
        default="default",
        help="AdamW implementation (default: PyTorch's own choice, a Python loop on CPU)",
    )
    ap.add_argument("--out", default=None, help="also write the result JSON here")
    ap.add_argument(
        "--window", type=int, default=10, help="steps per timed window (the engine's log_every)"
    )
    return ap.parse_args()


def pin(local_rank: int, local_world: int) -> list[int] | None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_world:
        return None
    per = len(cores) // local_world
    mine = cores[local_rank * per : (local_rank + 1) * per]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine


def main() -> None:
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    cores = pin(local_rank, local_world) if a.pin else None
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.tf32
        torch.backends.cudnn.benchmark = a.cudnn_benchmark
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()

    task_cls, config_cls = TASKS[a.kind]
    task = task_cls(config_cls(**json.loads(a.task)))
    torch.manual_seed(a.seed)
    ids = [local_rank] if cuda else None
    model = task.build_model().to(device)
    if dist.get_world_size() > 1:  # one rank is a plain model, as a one-GPU script has it
        model = DDP(model, device_ids=ids, **json.loads(a.ddp))
    train_set, _ = task.build_datasets()
    sampler = DistributedSampler(train_set, shuffle=True, seed=a.data_seed, drop_last=True)
    loader = DataLoader(
        train_set,
        batch_size=a.batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=batch_collate,
        num_workers=0,
        pin_memory=cuda,
        generator=torch.Generator().manual_seed(a.data_seed),
    )
    impl = {} if a.optimizer_impl == "default" else adamw_kwargs(a.optimizer_impl)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, **impl)

    def factor(s: int) -> float:
        if s < a.lr_warmup:
            return (s + 1) / a.lr_warmup
        progress = min(1.0, (s - a.lr_warmup) / max(1, a.steps - a.lr_warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    max_norm = a.clip if a.clip > 0 else math.inf
    warm = a.warmup_steps if a.warmup_steps is not None else max(1, a.steps // 10)
    autocast = (
        torch.autocast(a.device, dtype=torch.bfloat16)
        if a.precision == "bf16"
        else contextlib.nullcontext()
    )

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    step, epoch, t0 = 0, 0, time.perf_counter()
    marks: list[float] = []
    wall_marks: list[tuple[int, float]] = []
    while step < a.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if cuda:
                batch = [b.to(device, non_blocking=True) for b in batch]
            with autocast:
                loss = task.compute(model, batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == warm:
                t0 = clock()
            if step >= warm and step % a.window == 0:
                marks.append(time.perf_counter())  # a window's end: the engine's log step
                wall_marks.append((step, time.time()))  # as the engine's events stamp it
            if step == a.steps:
                break
        epoch += 1
    elapsed = clock() - t0

    final = loss.detach().float().clone()
    dist.all_reduce(final)
    if rank == 0:
        result = {
            "steps": a.steps,
            "measured_steps": a.steps - warm,
            "seconds": elapsed,
            "steps_per_s": (a.steps - warm) / elapsed,
            "window_ms": [
                (t1 - t0_) * 1000 / a.window for t0_, t1 in zip(marks, marks[1:], strict=False)
            ],
            "final_loss": final.item() / dist.get_world_size(),
            "step_t": wall_marks,
            "threads": torch.get_num_threads(),
            "cores": cores,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "optimizer_impl": a.optimizer_impl,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "precision": a.precision,
        }
        line = json.dumps(result)
        print(line, flush=True)
        if a.out:
            with open(a.out, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: after a clean destroy_process_group, one run
    # in about ten here still aborted a rank in a C++ static destructor ("terminate called
    # without an active exception"), failing the benchmark after its result was written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
