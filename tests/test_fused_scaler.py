"""FSDP under fp16 steps its optimizers through torch's sharded GradScaler, which cannot step a
fused kernel (its found-inf flag has shape [1], the kernels' step counts shape []): the first
step of such a run failed on an H200. The engine then picks foreach for ``auto`` and refuses a
fused optimizer by name before the first step. The scaler runs here on CPU, where torch's
failure is the same, in a gloo group of one (the sharded scaler all-reduces its flag). The
test asserts torch's own error too: when a torch release fixes the sharded scaler, it fails
and says the rule (devices.fused_steps_ok) may go."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from gpu_console.devices import fused_steps_ok
from gpu_console.engine.optim_set import Optimizers, OptimizerSetupError
from gpu_console.profile import load_profile

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Task:
    def __init__(self, optimizer=None):
        self.optimizer = optimizer

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def one_step(opts: Optimizers, model) -> None:
    """The engine's order under fp16: scale, backward, unscale (for clipping), step, update."""
    scaler = ShardedGradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).square().sum()).backward()
    opts.unscale(scaler)
    opts.clip(1.0)
    opts.step(scaler)


def test_the_rule_refuses_only_fsdp_under_fp16_on_a_gpu():
    assert not fused_steps_ok("fsdp", "fp16", "cuda")
    assert fused_steps_ok("fsdp", "bf16", "cuda")
    assert fused_steps_ok("ddp", "fp16", "cuda")


def test_auto_picks_foreach_where_the_sharded_scaler_steps(group):
    p = load_profile("transformer", [])
    assert p.train.optimizer_impl == "auto"
    torch.manual_seed(0)
    model = Task().build_model()
    opts = Optimizers.build(Task(), model, p, 1, "cpu", None, fused_ok=False)
    assert not opts.first.defaults.get("fused") and opts.first.defaults["foreach"]
    before = [q.detach().clone() for q in model.parameters()]
    one_step(opts, model)
    assert all(not torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    # Where fused is allowed, auto picks it, and torch's sharded scaler cannot step it: the
    # failure the rule avoids.
    fused = Optimizers.build(Task(), model, p, 1, "cpu", None, fused_ok=True)
    assert fused.first.defaults.get("fused")
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        one_step(fused, model)


def test_a_fused_optimizer_by_name_is_refused_with_why():
    p = load_profile("transformer", ["train.optimizer_impl=fused"])
    model = Task().build_model()
    with pytest.raises(OptimizerSetupError, match=r"^train.optimizer_impl: the fused optimizer"):
        Optimizers.build(Task(), model, p, 1, "cuda", None, fused_ok=False)

    class Own(Task):
        def configure_optimizers(self, model, ctx):
            return {"actor": torch.optim.Adam(model.parameters(), fused=True)}

    with pytest.raises(OptimizerSetupError, match="optimizer 'actor' is fused.*foreach=True"):
        Optimizers.build(Own(), model, p, 1, "cpu", None, fused_ok=False)
    assert Optimizers.build(Own(), model, p, 1, "cpu", None, fused_ok=True).source == "task"
