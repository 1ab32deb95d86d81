"""The built-in ``cvrp`` (issue 22): the attention model for vehicle routing with a greedy
rollout baseline. Its pieces alone (tours, the heuristic, the t-test), then on 2 CPU ranks
(the harness, tests/harness.py): the loss falls, each epoch's baseline test is logged, the
eval holds the heuristic's length and the gap, ``export`` loads into its model class with
plain torch, and each encoder trains; through real torchrun, a Ctrl-C and a resume continue
bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import events_of, set_args
from harness import cut_and_resumed, run_engine
from headless_text import headless_text

from gpu_console.profile import load_profile
from gpu_console.tasks.cvrp import (
    CVRPModel,
    Routes,
    instances,
    nearest_neighbour,
    nearest_neighbour_routes,
    one_sided_p,
    seeded,
    student_t_cdf,
)


def replay(coords, demand, capacity, path) -> torch.Tensor:
    """Each tour's length from its moves, checking it: every customer once, the load never
    below zero, and home at the end."""
    lengths = []
    for i in range(len(coords)):
        at, load, seen, length = 0, capacity, [], 0.0
        for to in (int(step[i]) for step in path):
            length += float((coords[i, to] - coords[i, at]).norm())
            load = capacity if to == 0 else load - float(demand[i, to])
            assert load >= 0, f"instance {i} overloaded at customer {to}"
            if to:
                seen.append(to)
            at = to
        assert sorted(seen) == list(range(1, coords.shape[1])), f"instance {i}: {seen}"
        assert at == 0, f"instance {i} ends away from the depot"
        lengths.append(length)
    return torch.tensor(lengths)


def test_the_heuristic_goes_to_the_nearest_customer_the_load_still_serves():
    coords = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]])
    demand = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    assert nearest_neighbour(coords, demand, 9.0).tolist() == [6.0]  # out and back once
    # A load of two: home after the second customer, then out to the third and back.
    assert nearest_neighbour(coords, demand, 2.0).tolist() == [1 + 1 + 2 + 3 + 3]


def test_sampled_greedy_and_heuristic_tours_serve_each_customer_once_within_capacity():
    cfg = load_profile("cvrp20", ["task.embed_dim=16", "task.n_heads=2", "task.ff_dim=32"]).task
    coords, demand = instances(16, 20, seeded(3, "cpu"))
    assert demand[:, 1:].min() >= 1 and demand.max() <= 9 and (demand[:, 0] == 0).all()
    torch.manual_seed(0)
    model = CVRPModel(cfg).eval()
    with torch.no_grad():
        driven = [model.drive(coords, demand, greedy)[0] for greedy in (False, True)]
    driven.append(nearest_neighbour_routes(coords, demand, 30.0))
    random_moves = Routes(coords, demand, 30.0)  # any allowed move, as barred() allows
    while not random_moves.done().all():
        random_moves.move(torch.multinomial((~random_moves.barred()).float(), 1)[:, 0])
    for routes in [*driven, random_moves]:
        replayed = replay(coords, demand, 30.0, routes.path)
        assert torch.allclose(replayed, routes.length, atol=1e-4)
    assert driven[1].length.mean() != driven[0].length.mean()  # greedy is not the sample


def test_a_tours_log_probability_is_how_often_the_policy_samples_it():
    """4,000 samples of one 3-customer instance: each tour comes up about as often as its
    log-probability says, and a seeded sample and the greedy tour repeat."""
    cfg = load_profile("cvrp20", ["task.embed_dim=16", "task.n_heads=2", "task.ff_dim=32",
                                  "task.tanh_clip=2.0"]).task  # fmt: skip
    coords, demand = instances(1, 3, seeded(4, "cpu"))
    coords, demand = coords.expand(4000, -1, -1), demand.expand(4000, -1)
    torch.manual_seed(1)
    model = CVRPModel(cfg).eval()
    with torch.no_grad():
        torch.manual_seed(5)
        routes, log_p = model.drive(coords, demand)
        torch.manual_seed(5)
        again, _ = model(coords, demand)
        greedy = [model(coords[:1], demand[:1], greedy=True) for _ in range(2)]
    assert torch.equal(routes.length, again), "a seeded sample repeats"
    assert torch.equal(greedy[0][0], greedy[1][0])
    tours = [tuple(int(step[i]) for step in routes.path) for i in range(4000)]
    for tour in sorted(set(tours), key=tours.count, reverse=True)[:3]:
        p = math.exp(float(log_p[tours.index(tour)]))
        sigma = math.sqrt(p * (1 - p) / 4000)
        assert abs(tours.count(tour) / 4000 - p) < 4 * sigma + 1e-3, (tour, p)


@pytest.mark.parametrize(("t", "df", "expected"), [
    (-1.0, 1, 0.25),  # Cauchy: exactly a quarter
    (-1.0, 2, 0.5 - 1 / (2 * math.sqrt(3))),  # closed form for two degrees of freedom
    (1.5, 10, 0.917746),  # tables
    (0.0, 7, 0.5),
])  # fmt: skip
def test_students_t_distribution(t, df, expected):
    assert student_t_cdf(t, df) == pytest.approx(expected, abs=1e-6)


def test_the_one_sided_paired_t_test():
    better = torch.tensor([-0.3, -0.1, -0.4, -0.2, 0.05, -0.25])
    p = one_sided_p(better)
    assert 0.01 < p < 0.025  # t = -3.10, 5 degrees of freedom: between the tables' 2.571 and 3.365
    assert one_sided_p(-better) == pytest.approx(1 - p)
    assert one_sided_p(torch.zeros(5)) == 1.0 and one_sided_p(torch.full((5,), -1.0)) == 0.0
    many = torch.randn(4000, generator=torch.Generator().manual_seed(0)) - 0.03
    t = float(many.mean()) / float(many.std() / math.sqrt(4000))
    assert one_sided_p(many) == pytest.approx(0.5 * math.erfc(-t / math.sqrt(2)), abs=1e-3)


# A small policy on 10 customers: 32 instances per rank, an epoch of 10 steps (so the baseline
# is tested at steps 10, 20, 30 and 40), 40 steps.
def small_sets(*extra: str) -> list[str]:
    return [
        "task.num_customers=10",
        "task.embed_dim=32",
        "task.n_heads=4",
        "task.ff_dim=64",
        "task.n_layers=2",
        "task.epoch_instances=640",
        "task.eval_instances=64",
        "task.baseline_instances=64",
        "data.batch_size=32",
        "train.max_steps=40",
        "train.eval_every=20",
        "train.log_every=1",
        "checkpoint.every_steps=20",
        *extra,
    ]


def small(*extra: str) -> list[str]:
    """The command line of :func:`small_sets`."""
    return ["--devices", "cpu:2", *set_args(*small_sets(*extra))]


def test_cvrp_learns_tests_its_baseline_resumes_exactly_and_exports(procs, tmp_path):
    whole_dir = tmp_path / "whole"
    run = run_engine(tmp_path, "cvrp20", *small_sets(), ranks=2, runs_dir=whole_dir)
    losses = {e["step"]: e["loss"] for e in events_of(run, "step")}
    first, last = [losses[s] for s in range(1, 6)], [losses[s] for s in range(36, 41)]
    assert sum(last) < 0.9 * sum(first), (first, last)  # mean sampled tour length falls

    tests = [e["message"] for e in events_of(run, "log") if "rollout baseline" in e["message"]]
    assert len(tests) == 4, tests  # one per epoch's end
    assert "(the moving average ends; rollouts begin)" in tests[0]
    assert "rollout baseline replaced after epoch 0" in tests[0]  # better than a random policy
    assert "rollout baseline replaced after epoch 0" in headless_text(run)
    step_metrics = [e["metrics"]["baseline"] for e in events_of(run, "step")]
    assert all(math.isfinite(b) and b > 0 for b in step_metrics)

    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [20, 40]
    for e in evals:
        assert e["gap_pct"] == pytest.approx(100 * (e["loss"] / e["nn"] - 1))
    assert evals[0]["nn"] == evals[1]["nn"]  # the same fixed instances

    stop = 20  # an epoch's end and an eval's step
    cut = cut_and_resumed(tmp_path, "cvrp20", *small_sets(), cut_at=stop)
    resumed = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > stop}
    assert resumed == {s: loss for s, loss in losses.items() if s > stop}
    assert [e["loss"] for e in events_of(cut, "eval")][-1] == evals[-1]["loss"]

    out = tmp_path / "weights.pt"
    exported = procs.cli("export", str(run), "--out", str(out), "--runs-dir", str(whole_dir))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    cfg = load_profile("cvrp20", [s for s in small_sets() if s.startswith("task.")]).task
    model = CVRPModel(cfg)
    model.load_state_dict(torch.load(out, weights_only=True))  # plain torch, nothing else


@pytest.mark.parametrize("encoder", ["gt", "dgt"])
def test_the_graph_transformer_encoders_train(tmp_path, encoder):
    sets = small_sets(f"task.encoder={encoder}", "train.max_steps=12", "train.eval_every=12")
    run = run_engine(tmp_path, "cvrp20", *sets, ranks=2)
    losses = [e["loss"] for e in events_of(run, "step")]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert any("rollout baseline" in e["message"] for e in events_of(run, "log"))


def test_fsdp_is_refused_at_launch_in_one_line(procs, tmp_path):
    """Under fsdp, replacing the rollout baseline copied sharded parameters into the plain
    frozen copy and failed the run at its first replacement (seen at step 10): refused."""
    runs = tmp_path / "runs"
    args = small("distributed.strategy=fsdp")
    result = procs.cli("run", "cvrp20", "--headless", *args, "--runs-dir", str(runs))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu-console: --set: distributed.strategy: the cvrp task's rollout baseline is a whole "
        "copy of the policy, replaced at an epoch's end: not with a sharded policy; use ddp "
        "(got 'fsdp')"
    ], result.stderr
    assert not runs.exists() or not any(runs.iterdir())
