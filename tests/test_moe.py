"""The built-in ``moe`` (issue 22): a mixture-of-experts language model. Its routing alone
against a token-by-token mixture (top-1 and top-2, capacity and none), the drops past
capacity, the balancing loss, the config's one-line refusals; then through real torchrun on
2 CPU ranks: it trains, every step event carries each expert's share, and the reported loss
is the cross-entropy plus the weighted balancing loss."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import events_of, only_run, run_dirs, set_args

from gpu_console.profile import ProfileError, load_profile
from gpu_console.tasks.configs import MoEConfig
from gpu_console.tasks.moe import MoE

D = 16


def naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighted by the renormalised
    router probabilities: what the batched dispatch must equal when nothing is dropped."""
    flat = x.reshape(-1, x.shape[-1])
    probs = moe.router(flat).softmax(-1)
    weight, expert = probs.topk(moe.k, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for i in range(len(flat)):
        for j in range(moe.k):
            out[i] += weight[i, j] * moe.experts.one(int(expert[i, j]), flat[i : i + 1])[0]
    return out.view(x.shape)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.0, 100.0])
def test_routing_with_room_for_every_token_is_the_tokens_own_mixture(top_k, capacity_factor):
    torch.manual_seed(0)
    cfg = MoEConfig(d_model=D, num_experts=4, top_k=top_k, capacity_factor=capacity_factor)
    moe = MoE(D, cfg)
    x = torch.randn(3, 8, D)
    out = moe(x)
    torch.testing.assert_close(out, naive(moe, x), rtol=1e-5, atol=1e-6)
    aux, load, dropped = moe.stats
    assert float(dropped) == 0.0
    assert math.isclose(float(load.sum()), 1.0, rel_tol=1e-6)
    out.sum().backward()  # every expert and the router get a gradient
    assert all(p.grad is not None for p in moe.parameters())


def test_assignments_past_an_experts_capacity_are_dropped_in_token_order():
    torch.manual_seed(0)
    moe = MoE(D, MoEConfig(d_model=D, num_experts=4, top_k=1, capacity_factor=1.0))
    with torch.no_grad():  # every token's first choice is expert 2
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    x = torch.rand(1, 32, D) + 0.1  # positive: expert 2 scores highest for every token
    with torch.no_grad():
        out = moe(x)[0]
        probs = moe.router(x[0]).softmax(-1).mean(0)
    aux, load, dropped = moe.stats
    capacity = math.ceil(1.0 * 32 / 4)  # 8: an even share
    assert load.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert float(dropped) == pytest.approx(1 - capacity / 32)
    expected = moe.experts.one(2, x[0, :capacity])  # weight 1: top-1 renormalised
    torch.testing.assert_close(out[:capacity], expected, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(out[capacity:]) == 0  # the rest keep only their residual
    # Switch's balancing loss: all of the load and most of the probability on one expert.
    assert float(aux) == pytest.approx(4 * float(probs[2]), rel=1e-5) and float(aux) > 2


def test_a_uniform_router_gives_a_balancing_loss_of_one():
    moe = MoE(D, MoEConfig(d_model=D, num_experts=8, top_k=2))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe(torch.randn(2, 16, D))
    aux, load, _ = moe.stats
    assert float(aux) == pytest.approx(1.0, rel=1e-6)  # E · Σ fᵢ · (1/E) = Σ fᵢ = 1


def test_config_problems_are_one_line_each():
    with pytest.raises(ProfileError, match=r"task.top_k: at most task.num_experts=4 \(got 5\)"):
        load_profile("moe", ["task.num_experts=4", "task.top_k=5"])
    with pytest.raises(ProfileError, match=r"task.capacity_factor: 0 \(no limit\) or at least"):
        load_profile("moe", ["task.capacity_factor=0.3"])
    with pytest.raises(ProfileError, match="task.n_heads: must divide task.d_model=30"):
        load_profile("moe", ["task.d_model=30"])


def test_a_bad_key_fails_the_launch_in_one_line_before_any_run_exists(procs, runs_dir):
    result = procs.cli("run", "moe", "--headless", "--devices", "cpu:2", "--runs-dir",
                       str(runs_dir), *set_args("task.top_k=9"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu-console: --set: task.top_k: at most task.num_experts=8 (got 9)"
    ], result.stderr
    assert not run_dirs(runs_dir)


SMALL = ("task.d_model=32", "task.n_heads=2", "task.num_experts=4", "task.seq_len=32",
         "data.batch_size=16", "train.max_steps=40", "train.warmup_steps=5",
         "train.log_every=5", "train.eval_every=20", "checkpoint.every_steps=0")  # fmt: skip


def test_it_trains_on_two_ranks_and_reports_each_experts_share(procs, runs_dir):
    result = procs.cli("run", "moe", "--headless", "--devices", "cpu:2", "--runs-dir",
                       str(runs_dir), *set_args(*SMALL))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    steps = events_of(run, "step")
    assert [s["step"] for s in steps] == list(range(5, 41, 5))
    for s in steps:
        m = s["metrics"]
        shares = [m[f"expert_load/{i}"] for i in range(4)]
        assert all(0 <= x <= 1 for x in shares) and math.isclose(sum(shares), 1, abs_tol=1e-5)
        assert 0 <= m["dropped"] < 1 and m["aux_loss"] > 0
        # The loss the engine reports is the cross-entropy plus the weighted balancing loss,
        # each averaged over the same window and ranks.
        assert s["loss_avg"] == pytest.approx(m["ce"] + 0.01 * m["aux_loss"], rel=1e-5)
    assert steps[-1]["metrics"]["ce"] < steps[0]["metrics"]["ce"] - 0.5
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [20, 40]
    for e in evals:  # the eval's loss is the cross-entropy alone
        assert e["ppl"] == pytest.approx(math.exp(e["loss"]), rel=1e-6)
        assert not any(k.startswith("expert_load") for k in e)
