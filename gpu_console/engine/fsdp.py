"""``distributed.strategy = "fsdp"``: FSDP2 (``fully_shard``) in place of DDP.

Each of the model's repeated blocks is sharded on its own, then the root (what is left:
embeddings, head), so a rank holds 1/world of every parameter, gradient and optimizer state
and gathers one block's parameters at a time for its forward and backward. The blocks come
from the task's optional ``blocks(model)`` hook (the built-in transformer has it); without
it only the root is sharded (one all-gather of the whole model per forward), which the start
event says.

Mixed precision is FSDP's own (``MixedPrecisionPolicy``), not autocast: parameters are
gathered in the compute dtype (bf16 or fp16), gradients reduced in fp32, and the optimizer
steps the fp32 shards. Autocast on top would cast the same weights again, so the loop runs
without it under FSDP. fp16 on a GPU keeps a GradScaler: the sharded one, which agrees on an
overflow over all ranks (each sees only its shard of the gradients).

The optimizers are built before sharding (as under DDP, from the bare model) and handed the
sharded parameters by name afterwards: ``fully_shard`` replaces every parameter with a
DTensor one under the same name, and a fresh optimizer holds no state yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from . import torch_private
from .precision import DTYPES

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class FsdpSetupError(ValueError):
    """What the task's ``blocks()`` hook returned, when it cannot be sharded."""


def blocks_of(task, model: nn.Module) -> list[nn.Module]:
    """The task's ``blocks(model)``: its repeated blocks, the unit of sharding; none: []."""
    hook = getattr(task, "blocks", None)
    if hook is None:
        return []
    found = list(hook(model))
    inside = {id(m) for m in model.modules()}
    for b in found:
        if not isinstance(b, nn.Module) or id(b) not in inside or b is model:
            raise FsdpSetupError(
                f"the task's blocks(model) must return submodules of the model (got {b!r:.80})"
            )
    return found


def policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("fp32", "fp64"):  # the parameters' own dtype: no mixed precision
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


class Sharded:
    """The sharded model, as the trainer holds a wrapped one (DDP's under the DDP strategy):
    called, switched train/eval, its gradient sync held back on all but a step's last
    micro-batch."""

    same_forwards = True  # each forward all-gathers: every rank must run as many (evaluate.py)

    def __init__(self, module: nn.Module, blocks: int, reshard: bool, offload: bool, prec: str):
        self.module = module
        self.blocks = blocks
        self.reshard_after_forward = reshard
        self.cpu_offload = offload  # as applied (not on CPU ranks)
        self.precision = prec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A non-final micro-batch: gradients accumulate unreduced (FSDP2's no_sync)."""
        module = cast("FSDPModule", self.module)  # fully_shard made its class one
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def settings(self) -> dict[str, Any]:
        """The start event's ``fsdp``: what was sharded and how."""
        return {
            "sharded_blocks": self.blocks,
            "units": self.blocks + 1,
            "root_only": self.blocks == 0,
            "reshard_after_forward": self.reshard_after_forward,
            "cpu_offload": self.cpu_offload,
            "param_dtype": self.precision,
            "reduce_dtype": "fp32",
        }


def shard(model: nn.Module, task, cfg, precision: str, optimizers, warn) -> Sharded:
    """``fully_shard`` each block, then the root; the optimizers then hold the shards."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    names = {id(q): name for name, q in model.named_parameters()}
    blocks = blocks_of(task, model)
    offload = cfg.fsdp_cpu_offload
    if offload and next(model.parameters()).device.type == "cpu":
        # FSDP's offload copies to an accelerator for compute: CPU ranks have none, and
        # their shards are in host memory already.
        warn("distributed.fsdp_cpu_offload: CPU ranks keep their shards on the CPU anyway: ignored")
        offload = False
    kwargs = {
        "reshard_after_forward": cfg.fsdp_reshard_after_forward,
        "mp_policy": policy(precision),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP takes the first module to run forward for its root. A task's own train_step may
    # call blocks directly (a GAN's generator, then its discriminator): the root is made the
    # root now, before any of them runs.
    torch_private.fsdp_make_root(model)
    now = dict(model.named_parameters())
    for entry in optimizers.entries:
        _repoint(entry, names, now)
    return Sharded(model, len(blocks), cfg.fsdp_reshard_after_forward, offload, precision)


def _repoint(entry, names: dict[int, str], now: dict[str, nn.Parameter]) -> None:
    """The optimizer's groups (and the entry's list) name the sharded parameters."""
    for group in entry.optimizer.param_groups:
        group["params"] = [now[names[id(q)]] for q in group["params"]]
    entry.params = [now[names[id(q)]] for q in entry.params]


def make_scaler(precision: str, device_type: str, init_scale: float = 65536.0):
    """fp16 on a GPU: the sharded GradScaler (an overflow on one rank's shard is every
    rank's), from ``train.loss_scale_init``; bf16 and fp32 need none."""
    if precision == "fp16" and device_type == "cuda":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cuda", init_scale=init_scale)
    return None


def total_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip sharded gradients to ``max_norm`` over all ranks; their global norm (a plain
    tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor

    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):  # a partial norm per rank: its reduction is the global one
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def clip(optimizers, max_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:meth:`Optimizers.clip` over sharded gradients."""
    norms = {e.name: total_norm(e.params, max_norm) for e in optimizers.entries}
    if len(norms) == 1:
        return next(iter(norms.values())), norms
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]))
    return total, norms


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
