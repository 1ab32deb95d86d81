"""``unwrap``: the bare model under DDP's and torch.compile's wrappers, in either order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_console.tasks.base import unwrap

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def test_unwrap_strips_ddp_and_compile_in_either_order(one_rank_group):
    bare = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = nn.parallel.DistributedDataParallel(bare)
    compiled = torch.compile(bare)
    assert unwrap(ddp) is bare
    assert unwrap(compiled) is bare
    assert unwrap(nn.parallel.DistributedDataParallel(compiled)) is bare  # compile, then DDP
    assert unwrap(torch.compile(ddp)) is bare  # DDP, then compile
    assert unwrap(bare) is bare
    assert unwrap(ddp)[0] is bare[0]  # attributes and submodules through it


def test_a_models_own_module_attribute_is_not_unwrapped():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder = Holder()
    assert unwrap(holder) is holder
