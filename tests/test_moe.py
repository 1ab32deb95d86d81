"""The built-in ``moe`` (issue 22): a mixture-of-experts language model. Its routing alone
against a token-by-token mixture (top-1 and top-2, capacity and none), the drops past
capacity, the balancing loss, the config's one-line refusals; then on 2 CPU ranks (the
harness, tests/harness.py): it trains, every step event carries each expert's share, and the
reported loss is the cross-entropy plus the weighted balancing loss. With
``task.expert_parallel`` (the engine's ``expert`` strategy): the replicated run's losses,
checkpoints of the whole model that ``export`` writes out, a resume on one rank; through real
torchrun, an exact resume after a Ctrl-C, and the launch's refusals of a world the experts do
not divide over."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import events_of, pinned_env, run_dirs, set_args
from harness import cut_and_resumed, run_engine

from gpu_console.profile import ProfileError, load_profile
from gpu_console.tasks.configs import MoEConfig
from gpu_console.tasks.moe import MoE, MoEGPT

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


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """SMALL on 2 ranks, the experts replicated (DDP), a checkpoint every 20 steps: the run
    the training test reads and the expert-parallel one compares with (read it, never change
    it). pinned_env: a module's fixture starts before no_gpu_machine pins the hardware."""
    tmp = tmp_path_factory.mktemp("moe")
    return run_engine(tmp, "moe", *SMALL, "checkpoint.every_steps=20", ranks=2,
                      runs_dir=tmp / "rep", env=pinned_env())  # fmt: skip


def test_it_trains_on_two_ranks_and_reports_each_experts_share(replicated):
    run = replicated
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


def moe_run(tmp_path, runs, *sets: str):
    return run_engine(tmp_path, "moe", *sets, ranks=2, runs_dir=runs)


def whole_state(run, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:08d}" / "state.pt", weights_only=True)


def test_expert_parallel_trains_the_replicated_model_and_checkpoints_it_whole(
    procs, tmp_path, replicated
):
    sets = (*SMALL, "checkpoint.every_steps=20")  # the replicated run's
    rep = replicated
    ep = moe_run(tmp_path, tmp_path / "ep", *sets, "task.expert_parallel=true")
    (start,) = events_of(ep, "start")
    assert start["strategy"] == "expert"
    assert start["expert_parallel"]["parameters"] == 2 * 4  # two blocks' w1, b1, w2, b2
    assert events_of(rep, "start")[0]["strategy"] == "ddp"
    # The dry run names the strategy the ranks used, from the ranks' own choice.
    dry = procs.cli("run", "moe", "--dry-run", "--no-step", "--json", "--devices", "cpu:2",
                    "--runs-dir", str(tmp_path / "dry"),
                    *set_args(*sets, "task.expert_parallel=true"))  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["strategy"] == "expert"
    assert plan["expert_parallel"] == {"parameters": start["expert_parallel"]["parameters"]}
    # Measured: step losses equal to 1.2e-7, grad norms to 4e-7 (the experts' products
    # batch differently); the checkpointed weights to 1e-4 after 40 Adam steps.
    for a, b in zip(events_of(rep, "step"), events_of(ep, "step"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for a, b in zip(events_of(rep, "eval"), events_of(ep, "eval"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    saved, replicated = whole_state(ep, 40), whole_state(rep, 40)
    assert saved["model"]["blocks.0.ff.experts.w1"].shape == (4, 32, 64)  # every expert
    for name, value in replicated["model"].items():
        torch.testing.assert_close(saved["model"][name], value, atol=1e-3, rtol=0)
    out = tmp_path / "weights.pt"
    exported = procs.cli("export", str(ep), "--out", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    cfg = load_profile("moe", [s for s in SMALL if s.startswith("task.")]).task
    MoEGPT(cfg).load_state_dict(torch.load(out, weights_only=True))  # plain torch


LONG = ("task.d_model=32", "task.n_heads=2", "task.num_experts=4", "task.seq_len=32",
        "data.batch_size=16", "train.max_steps=60", "train.warmup_steps=5",
        "train.log_every=1", "train.eval_every=30", "checkpoint.every_steps=30",
        "task.expert_parallel=true")  # fmt: skip


def test_expert_parallel_resumes_exactly_after_a_stop_and_on_one_rank(procs, tmp_path):
    whole = moe_run(tmp_path, tmp_path / "whole", *LONG)
    losses = {e["step"]: e["loss"] for e in events_of(whole, "step")}
    stop = 30  # an eval's step
    cut = cut_and_resumed(tmp_path, "moe", *LONG, cut_at=stop)
    resumed = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > stop}
    assert resumed == {s: loss for s, loss in losses.items() if s > stop}
    # The whole model on one rank: the checkpoint's experts need no slicing there.
    run_engine(tmp_path, None, "train.max_steps=70", resume=whole, runs_dir=tmp_path / "whole")
    assert events_of(whole, "start")[-1]["strategy"] == "single"
    after = [e for e in events_of(whole, "step") if e["step"] > 60]
    assert [e["step"] for e in after] == list(range(61, 71))
    assert all(math.isfinite(e["loss"]) and e["loss"] < losses[1] for e in after)


def test_a_world_the_experts_do_not_divide_over_is_refused_at_launch(procs, runs_dir):
    result = procs.cli("run", "moe", "--headless", "--devices", "cpu:2", "--runs-dir",
                       str(runs_dir), *set_args("task.expert_parallel=true",
                       "task.num_experts=3", "task.top_k=1"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu-console: --set: task.num_experts: 3 experts do not divide evenly over 2 ranks "
        "(task.expert_parallel) (got 3)"
    ], result.stderr
    result = procs.cli("run", "moe", "--headless", "--devices", "cpu:2", "--runs-dir",
                       str(runs_dir), *set_args("task.expert_parallel=true",
                       "distributed.strategy=fsdp"))  # fmt: skip
    assert result.returncode == 2
    assert "task.expert_parallel: not with distributed.strategy" in result.stderr
    assert not run_dirs(runs_dir)
