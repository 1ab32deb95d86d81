"""One rank trains without the DDP wrapper (engine/strategy_single.py), to DDP's bits.

In-process, on a one-rank gloo group: the same model, data and optimizer through DDP and
through the single-device strategy's wrapper give bit-identical parameters, with gradient
accumulation (no_sync) and clipping; the checkpointed state has DDP's keys.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gpu_console.engine import strategy
from gpu_console.engine.strategy_single import OneDevice, SingleStrategy
from gpu_console.profile import DistributedConfig

pytestmark = [pytest.mark.torch_floor, pytest.mark.quick]


def _train(wrapped: nn.Module, bare: nn.Module, steps: int = 6, accum: int = 2) -> None:
    opt = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for micro in range(accum):
            x = torch.randn(8, 5, generator=data)
            y = torch.randn(8, 1, generator=data)
            ctx = wrapped.no_sync() if micro < accum - 1 else torch.enable_grad()
            with ctx:
                loss = nn.functional.mse_loss(wrapped(x), y) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))


def test_one_rank_trains_to_ddps_bits_without_ddp(one_rank_group):
    ddp_bare, one_bare = _model(), _model()
    ddp = nn.parallel.DistributedDataParallel(ddp_bare)
    one = OneDevice(one_bare)
    _train(ddp, ddp_bare)
    _train(one, one_bare)
    for a, b in zip(ddp_bare.parameters(), one_bare.parameters(), strict=True):
        assert torch.equal(a, b)
    assert list(one.state_dict()) == list(ddp.state_dict())  # "module." keys, as DDP's
    assert one.module is one_bare


def test_ddp_on_one_rank_is_the_single_strategy_and_two_ranks_stay_ddp():
    cfg = DistributedConfig()
    one = strategy.for_profile(cfg, SimpleNamespace(world_size=1))
    two = strategy.for_profile(cfg, SimpleNamespace(world_size=2))
    assert isinstance(one, SingleStrategy) and one.name == "single"
    assert type(two).__name__ == "DdpStrategy" and two.name == "ddp"
    one.wrap(_model(), None, "fp32", None, None)
    assert one.compute_model is one.wrapped.module  # compute gets the bare model
    assert one.start_fields() == {"ddp": None, "fsdp": None}
    assert one.gradient_reduce(None, cfg, None) == (None, "one rank: no gradients to reduce")
