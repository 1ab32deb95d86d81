"""The start event: what was built, how, and where the start-up time went, in one event."""

from __future__ import annotations

import os

import torch

from . import determinism


def write(s, b) -> None:
    """``s``: the build's Setup, ``b``: what it Built."""
    p, d, out, facts = s.p, s.d, s.out, b.facts
    s.watch.mark("ddp")  # the start-up stage's name in the events (the strategy's wrap)
    out.start(
        world_size=d.world_size,
        device_type=d.device.type,
        backend=d.backend,
        precision=facts.prec,
        task=p.task_kind,
        params=sum(q.numel() for q in b.model.parameters()),
        max_steps=p.train.max_steps,
        start_step=b.state.step,
        restart=s.restart,
        max_restarts=p.distributed.max_restarts,
        resumed_from=str(facts.resume) if facts.resume else None,
        changes=s.changes if facts.resume else [],  # against the run resumed, from launch
        # Several machines: this node's place (torchrun's group rank) and where rank 0 is,
        # which writes the checkpoints and reads commands alongside each node's first rank.
        node=int(os.environ.get("GROUP_RANK", 0)),
        nodes=d.world_size // max(d.local_world_size, 1),
        rank_0=facts.rank_0,
        batch_size=p.data.batch_size,  # per rank per micro-batch
        auto_batch=facts.batch_search,  # how data.batch_size = "auto" was chosen, else None
        global_batch=p.data.batch_size * p.train.grad_accum * d.world_size,
        # The profile's lr where its optimizer runs; a task's own optimizers carry their lr
        # in ``optimizers`` (the profile's would be a number nothing uses).
        lr=facts.lr if b.opts.source == "profile" else None,
        optimizer=b.opts.summary(),
        optimizers=b.opts.describe(),  # what was built: classes, groups, schedules
        train_step=b.update.owner,  # who runs backward and step
        weight_decay=b.opts.decay.fields() if b.opts.decay else None,
        strategy=b.strategy.name,  # ddp, fsdp, or single (ddp asked for, one rank)
        **b.strategy.start_fields(),  # ddp: its settings read back; fsdp: what was sharded
        reduce=facts.reduce,  # how gradients are summed
        threads=torch.get_num_threads(),
        deterministic=determinism.in_effect(p.train.deterministic),
        versions={"torch": torch.__version__, "cuda": torch.version.cuda},
        **b.mfu.start_fields(),
        **b.compiled.start_fields(),
        activation_checkpointing=facts.held or p.train.activation_checkpointing,
        **s.watch.start_fields(),  # where the start-up time went (timings.py)
        memory_snapshot_on_oom=s.oom_snapshot,  # on, off, or why it has no effect
        **b.timeouts.start_fields(),  # start-up's until the first step, then the collectives'
        env=p.distributed.env,  # distributed.env: what each rank set before torch started
    )
    if s.oom_snapshot not in ("on", "off"):
        out.log("warning", f"hardware.memory_snapshot_on_oom = true: {s.oom_snapshot}")
