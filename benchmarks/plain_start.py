"""The quickstart's training as a plain script: the baseline ``startup.py`` times.

    python benchmarks/plain_start.py --steps N --out FILE              # one process
    python -m torch.distributed.run --nproc-per-node 2 --standalone \\
        benchmarks/plain_start.py --steps N --out FILE                 # DDP over gloo

What a user's own script would do, with the engine's model, data and optimizer (the
``quickstart`` profile's MLP and synthetic clusters, fused AdamW, warmup + cosine schedule,
gradient clipping, batches of 64 per process), and nothing else: no events, no eval, no
checkpoints. Under torchrun (``WORLD_SIZE`` set) it joins a gloo process group and wraps the
model in DDP, as a ported script would.

It stamps the same stages as the engine's start event (``gpu_console/timings.py``), where they
exist in a plain script: ``imports`` (torch and the task imported), ``process_group`` (under
torchrun), ``built`` (model, optimizer, data), ``ddp`` (under torchrun), ``first_step`` (the first
optimizer step done), ``end`` (the last step done). Rank 0 writes them to ``--out`` as unix times,
with the loss of the last step.
"""

import time

STARTED = time.time()  # noqa: E402 - before the imports: their cost is a stage

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from gpu_console.engine.optim_build import adamw_kwargs, resolve_impl  # noqa: E402
from gpu_console.tasks.base import batch_collate  # noqa: E402
from gpu_console.tasks.configs import MLPConfig  # noqa: E402
from gpu_console.tasks.mlp import MLPTask  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", required=True, help="where rank 0 writes its stage times (JSON)")
    a = ap.parse_args()
    marks = {"started": STARTED, "imports": time.time()}
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        marks["process_group"] = time.time()
    rank = dist.get_rank() if distributed else 0

    task = MLPTask(MLPConfig(hidden_dim=256, num_layers=3))  # the quickstart's task keys
    torch.manual_seed(0)
    model = task.build_model()
    impl = adamw_kwargs(resolve_impl("auto", "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, **impl)
    warmup = min(20, a.steps // 10)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, a.steps - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    train_set, _ = task.build_datasets()
    # Alone too, so that one process draws what one rank under torchrun draws.
    world = dist.get_world_size() if distributed else 1
    sampler = DistributedSampler(train_set, world, rank, seed=0, drop_last=True)
    loader = DataLoader(
        train_set,
        batch_size=64,
        sampler=sampler,
        drop_last=True,
        collate_fn=batch_collate,
        generator=torch.Generator().manual_seed(0),
    )
    marks["built"] = time.time()
    if distributed:
        model = DDP(model)
        marks["ddp"] = time.time()

    step, epoch = 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = task.compute(model, batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == 1:
                marks["first_step"] = time.time()
            if step == a.steps:
                break
        epoch += 1
    marks["end"] = time.time()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"marks": marks, "loss": float(loss)}, f)
    if distributed:
        dist.destroy_process_group()
        # As plain_ddp.py: about one run in ten aborted in a C++ static destructor at the
        # interpreter's teardown after a gloo group (torch 2.13), failing the benchmark.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
