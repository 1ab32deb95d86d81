"""The built-in ``cvrp`` (issue 22): the attention model for vehicle routing with a greedy
rollout baseline. Its pieces alone (tours, the heuristic, the t-test), then on 2 CPU ranks
(the harness, tests/harness.py): the loss falls, each epoch's baseline test is logged, the
eval holds the heuristic's length and the gap, ``export`` loads into its model class with
plain torch, and each encoder trains; through real torchrun, a Ctrl-C and a resume continue
bit for bit."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from conftest import REPO, events_of, set_args, without_packages
from harness import cut_and_resumed, run_engine
from headless_text import headless_text

from gpu_console.profile import load_profile
from gpu_console.tasks.cvrp import (
    CVRPModel,
    Routes,
    beam_search,
    best_of_samples,
    instances,
    nearest_neighbour,
    nearest_neighbour_routes,
    one_sided_p,
    seeded,
    student_t_cdf,
)
from gpu_console.tasks.cvrp_solvers import (
    check_tour,
    clarke_wright,
    clarke_wright_lengths,
    distances,
    routes_of,
    tour_length,
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


def test_clarke_wright_on_a_hand_checked_line():
    """Customers at 1, 2 and 3 on a line from the depot, demand 1 each. Savings: s(2,3) = 4,
    s(1,2) = s(1,3) = 2. A capacity of 9 joins them all (out and back: 6); a capacity of 2
    joins 2 and 3 first, and 1 then fits nowhere: 2 + 6 = 8."""
    coords = np.array([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    demand = np.array([0.0, 1.0, 1.0, 1.0])
    roomy = clarke_wright(coords, demand, 9.0)
    assert len(roomy) == 1 and tour_length(coords, roomy) == pytest.approx(6.0)
    tight = clarke_wright(coords, demand, 2.0)
    assert sorted(map(sorted, tight)) == [[1], [2, 3]]
    assert tour_length(coords, tight) == pytest.approx(8.0)


def brute_force(coords: np.ndarray, demand: np.ndarray, capacity: float) -> float:
    """The optimum: every order of the customers, each cut into routes at the best places
    (the order's shortest split, by dynamic programming)."""
    dist = distances(coords)
    n = len(coords) - 1
    best = math.inf
    for order in itertools.permutations(range(1, n + 1)):
        cost = [0.0] + [math.inf] * n  # cost[k]: the first k customers of the order served
        for start in range(n):
            load, inner = 0.0, 0.0
            for end in range(start, n):
                load += demand[order[end]]
                if load > capacity:
                    break
                if end > start:
                    inner += dist[order[end - 1], order[end]]
                route = dist[0, order[start]] + inner + dist[order[end], 0]
                cost[end + 1] = min(cost[end + 1], cost[start] + route)
        best = min(best, cost[n])
    return best


def test_clarke_wright_is_feasible_and_near_the_brute_force_optimum():
    """40 instances of 6 customers at capacities from tight (the largest demand, 9) to roomy:
    every Clarke-Wright tour serves each customer once within capacity, never beats the
    optimum, and stays within 25 % of it (the savings heuristic's usual few per cent)."""
    coords, demand = instances(40, 6, seeded(11, "cpu"))
    ratios = []
    for i, (xy, d) in enumerate(zip(coords.double().numpy(), demand.numpy(), strict=True)):
        capacity = [9.0, 12.0, 20.0, 60.0][i % 4]
        tour = clarke_wright(xy, d, capacity)
        check_tour(d, capacity, tour)
        optimum = brute_force(xy, d, capacity)
        assert tour_length(xy, tour) >= optimum - 1e-9
        ratios.append(tour_length(xy, tour) / optimum)
    assert max(ratios) < 1.25, ratios
    assert sum(ratios) / len(ratios) < 1.08, ratios


def test_clarke_wright_tours_of_the_eval_instances_are_feasible():
    coords, demand = instances(200, 20, seeded(1234, "cpu"))
    for capacity in (9.0, 30.0):  # the largest demand alone, and cvrp20's
        lengths = clarke_wright_lengths(coords.numpy(), demand.numpy(), capacity)
        for xy, d, length in zip(coords.double().numpy(), demand.numpy(), lengths, strict=True):
            tour = clarke_wright(xy, d, capacity)
            check_tour(d, capacity, tour)
            assert tour_length(xy, tour) == pytest.approx(length)
    with pytest.raises(ValueError, match="serves"):
        check_tour(np.array([0.0, 1.0, 1.0]), 9.0, [[1], [1]])
    with pytest.raises(ValueError, match="carries"):
        check_tour(np.array([0.0, 5.0, 5.0]), 9.0, [[1, 2]])


def test_the_best_of_sampled_tours_is_feasible_the_shortest_drawn_and_seeded():
    cfg = load_profile("cvrp20", ["task.embed_dim=16", "task.n_heads=2", "task.ff_dim=32"]).task
    coords, demand = instances(12, 20, seeded(3, "cpu"))
    torch.manual_seed(0)
    model = CVRPModel(cfg).eval()
    with torch.no_grad():
        drawn, _ = model.drive(coords, demand, samples=8, generator=seeded(5, "cpu"))
    every = drawn.length.view(12, 8)
    best, path = best_of_samples(model, coords, demand, 8, seeded(5, "cpu"), max_rows=10_000)
    assert torch.equal(best, every.min(1).values)  # one chunk: the same draws, their minimum
    again, _ = best_of_samples(model, coords, demand, 8, seeded(5, "cpu"), max_rows=10_000)
    assert torch.equal(again, best)
    # In chunks of 2 samples (24 rows): other draws, each tour still feasible and as long as
    # its moves.
    chunked, moves = best_of_samples(model, coords, demand, 8, seeded(5, "cpu"), max_rows=24)
    for lengths, steps in ((best, path), (chunked, moves)):
        replayed = replay(coords, demand, 30.0, list(steps.T))
        assert torch.allclose(replayed, lengths, atol=1e-4)
        for i in range(12):
            check_tour(demand[i].numpy(), 30.0, routes_of(steps[i].tolist()))


def test_beam_search_tours_are_feasible_and_width_one_is_greedy():
    cfg = load_profile("cvrp20", ["task.embed_dim=16", "task.n_heads=2", "task.ff_dim=32"]).task
    coords, demand = instances(12, 20, seeded(6, "cpu"))
    torch.manual_seed(0)
    model = CVRPModel(cfg).eval()
    with torch.no_grad():
        greedy = model.drive(coords, demand, greedy=True)[0]
    one, _ = beam_search(model, coords, demand, 1)
    assert torch.allclose(one, greedy.length)
    for width in (3, 8):
        lengths, moves = beam_search(model, coords, demand, width)
        assert torch.isfinite(lengths).all()
        replayed = replay(coords, demand, 30.0, list(moves.T))
        assert torch.allclose(replayed, lengths, atol=1e-4)
    tiny_coords, tiny_demand = instances(2, 2, seeded(1, "cpu"))  # fewer moves than beams
    lengths, moves = beam_search(model, tiny_coords, tiny_demand, 8)
    assert torch.allclose(replay(tiny_coords, tiny_demand, 30.0, list(moves.T)), lengths)


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
    coords, demand = instances(64, 10, seeded(1234, "cpu"))  # the eval's, as build_datasets
    cw = float(clarke_wright_lengths(coords.numpy(), demand.numpy(), 20.0).mean())
    for e in evals:
        assert e["gap_pct"] == pytest.approx(100 * (e["loss"] / e["nn"] - 1))
        assert e["greedy"] == pytest.approx(e["loss"])
        assert e["cw"] == pytest.approx(cw)
        assert e["sampled"] <= e["greedy"]  # the shortest of 16 samples and the greedy tour
        for name in ("greedy", "sampled", "nn"):
            assert e[f"{name}_gap_cw_pct"] == pytest.approx(100 * (e[name] / e["cw"] - 1))
    assert evals[0]["nn"] == evals[1]["nn"]  # the same fixed instances
    assert evals[-1]["sampled"] < evals[0]["sampled"]
    drawn_tours_are_written_feasible_and_drawn(run, coords, demand)

    stop = 20  # an epoch's end and an eval's step
    cut = cut_and_resumed(tmp_path, "cvrp20", *small_sets(), cut_at=stop)
    resumed = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > stop}
    assert resumed == {s: loss for s, loss in losses.items() if s > stop}
    figures = [{k: v for k, v in e.items() if k != "t"} for e in (events_of(cut, "eval")[-1],
                                                                  evals[-1])]  # fmt: skip
    assert figures[0] == figures[1]  # greedy, sampled, cw, every gap: the same eval

    out = tmp_path / "weights.pt"
    exported = procs.cli("export", str(run), "--out", str(out), "--runs-dir", str(whole_dir))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    cfg = load_profile("cvrp20", [s for s in small_sets() if s.startswith("task.")]).task
    model = CVRPModel(cfg)
    model.load_state_dict(torch.load(out, weights_only=True))  # plain torch, nothing else


def drawn_tours_are_written_feasible_and_drawn(run, coords, demand) -> None:
    """Each eval wrote the first 4 instances' greedy and Clarke-Wright tours (the two ranks
    two each), every one feasible and as long as it says; the report draws the latest."""
    steps = sorted(p.name for p in (run / "task" / "tours").iterdir())
    assert steps == ["step-00000020", "step-00000040"]
    files = sorted((run / "task" / "tours" / steps[-1]).glob("*.json"))
    assert [p.name for p in files] == [f"instance-{k:04d}.json" for k in range(4)]
    for k, path in enumerate(files):
        record = json.loads(path.read_text())
        xy, d = coords[k].double().numpy(), demand[k].numpy()
        assert np.array_equal(np.array(record["coords"]), xy)
        for kind in ("greedy", "cw"):
            tour = record["tours"][kind]
            check_tour(d, 20.0, tour["routes"])
            assert tour["length"] == pytest.approx(tour_length(xy, tour["routes"]))
        assert record["tours"]["cw"]["routes"] == clarke_wright(xy, d, 20.0)
    plt = pytest.importorskip("matplotlib.pyplot")
    from gpu_console.results import report
    from gpu_console.results.plots import figures

    series, telemetry = report.load_series(run)
    made = {name: (caption, fig) for name, caption, fig in
            figures(plt, [report.RunData(run, series, telemetry, {}, "")])}  # fmt: skip
    caption, fig = made["tours"]
    assert caption.startswith("Tours of eval instances at step 40")
    axes = fig.get_axes()
    assert len(axes) == 8
    assert "the model's greedy tour" in axes[0].get_title()
    assert "Clarke-Wright savings" in axes[1].get_title()
    cw = json.loads(files[0].read_text())["tours"]["cw"]
    assert len(axes[1].get_lines()) == len(cw["routes"]) + 1  # a line per route, the depot
    for f in made.values():
        plt.close(f[1])


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


# -- eval instances from files (task.eval_file) ------------------------------------------------


def test_the_built_in_eval_set_round_trips_through_vrplib_files(tmp_path):
    pytest.importorskip("vrplib")
    from gpu_console.tasks.cvrp_files import load, main

    sets = ["task.eval_instances=5", "task.num_customers=10"]
    assert main(["write-eval", "cvrp20", str(tmp_path / "vrp"), *sets]) == 0
    assert sorted(p.name for p in (tmp_path / "vrp").iterdir())[0] == "eval-0000.vrp"
    coords, demand = instances(5, 10, seeded(1234, "cpu"))
    read = load(str(tmp_path / "vrp"), 20.0)
    assert np.array_equal(read[0], coords.double().numpy())  # float32's values, exactly
    assert np.array_equal(read[1], demand.double().numpy())
    one = load(str(tmp_path / "vrp" / "eval-0003.vrp"), 20.0)
    assert np.array_equal(one[0], read[0][3:4]) and np.array_equal(one[1], read[1][3:4])
    # The same instances at another capacity: demands out of the model's.
    assert np.array_equal(load(str(tmp_path / "vrp"), 40.0)[1], 2 * read[1])


def test_a_vrplib_instance_is_put_in_the_unit_square_and_out_of_the_tasks_capacity(tmp_path):
    """A hand-written instance in VRPLIB's usual integer grid, the depot listed second and a
    capacity of 100: the depot becomes node 0, the coordinates shift to 0 and shrink by the
    larger extent (x: 40), the demands scale to the task's capacity of 30."""
    pytest.importorskip("vrplib")
    from gpu_console.tasks.cvrp_files import load

    (tmp_path / "hand.vrp").write_text(
        "NAME: hand\nTYPE: CVRP\nDIMENSION: 3\nEDGE_WEIGHT_TYPE: EUC_2D\nCAPACITY: 100\n"
        "NODE_COORD_SECTION\n1 50 20\n2 10 10\n3 30 30\n"
        "DEMAND_SECTION\n1 50\n2 0\n3 20\nDEPOT_SECTION\n2\n-1\nEOF\n"
    )
    coords, demand = load(str(tmp_path / "hand.vrp"), 30.0)
    assert coords.tolist() == [[[0.0, 0.0], [1.0, 0.25], [0.5, 0.5]]]
    assert demand.tolist() == [[0.0, 15.0, 6.0]]


def test_saved_arrays_are_read_from_npz_and_pt_files(tmp_path):
    from gpu_console.tasks.cvrp_files import load

    coords, demand = instances(3, 6, seeded(2, "cpu"))
    np.savez(tmp_path / "set.npz", coords=coords.numpy(), demand=demand.numpy(), capacity=15)
    torch.save({"coords": coords, "demand": demand}, tmp_path / "set.pt")
    from_npz, from_pt = load(str(tmp_path / "set.npz"), 30.0), load(str(tmp_path / "set.pt"), 30.0)
    assert np.array_equal(from_npz[0], coords.double().numpy())
    assert np.array_equal(from_npz[1], 2 * demand.double().numpy())  # out of 15, now of 30
    assert np.array_equal(from_pt[0], from_npz[0])
    assert np.array_equal(from_pt[1], demand.double().numpy())  # task.capacity's own


def test_the_eval_runs_on_a_file_of_instances(tmp_path):
    """The built-in instances written as VRPLIB files and evaluated from them: the eval's
    Clarke-Wright figure is the one of those instances."""
    pytest.importorskip("vrplib")
    from gpu_console.tasks.cvrp_files import write_eval

    write_eval("cvrp20", str(tmp_path / "vrp"), ["task.num_customers=10", "task.eval_instances=6"])
    sets = small_sets(f"task.eval_file={tmp_path / 'vrp'}", "train.max_steps=2",
                      "train.eval_every=2", "task.eval_sampled_tours=4")  # fmt: skip
    run = run_engine(tmp_path, "cvrp20", *sets, ranks=1)
    (e,) = events_of(run, "eval")
    coords, demand = instances(6, 10, seeded(1234, "cpu"))
    cw = clarke_wright_lengths(coords.numpy(), demand.numpy(), 20.0)
    assert e["cw"] == pytest.approx(float(cw.mean()))
    assert e["sampled"] <= e["greedy"]


def test_the_end_eval_samples_end_sampled_tours_and_the_others_eval_sampled_tours(tmp_path):
    """``task.end_sampled_tours`` changes the schedule's last eval alone: with 2 tours at
    every eval and 48 at the end, the end eval is exactly a run's that samples 48 at every
    eval (the eval's sampling draws from its own stream, so training is the same), and the
    eval before it exactly a run's that samples 2; the log says so once."""
    sets = small_sets("train.max_steps=4", "train.eval_every=2", "checkpoint.every_steps=0")
    for name in ("both", "few", "many"):
        (tmp_path / name).mkdir()
    both = run_engine(tmp_path / "both", "cvrp20", *sets, "task.eval_sampled_tours=2",
                      "task.end_sampled_tours=48")  # fmt: skip
    few = run_engine(tmp_path / "few", "cvrp20", *sets, "task.eval_sampled_tours=2")
    many = run_engine(tmp_path / "many", "cvrp20", *sets, "task.eval_sampled_tours=48")
    evals = {name: events_of(run, "eval") for name, run in
             (("both", both), ("few", few), ("many", many))}  # fmt: skip
    assert [e["step"] for e in evals["both"]] == [2, 4]

    def measured(e):
        return {k: v for k, v in e.items() if k not in ("t", "seconds")}

    assert measured(evals["both"][0]) == measured(evals["few"][0])
    assert measured(evals["both"][1]) == measured(evals["many"][1])
    assert evals["many"][1]["sampled"] < evals["few"][1]["sampled"]  # 48 tours beat 2 here
    said = [e["message"] for e in events_of(both, "log") if "end_sampled_tours" in e["message"]]
    assert said == [
        "the eval at step 4, the schedule's end: sampled is the best of 48 tours per "
        "instance (task.end_sampled_tours), not 2"
    ]
    assert not [e for e in events_of(many, "log") if "end_sampled_tours" in e["message"]]


def test_the_example_schedules_are_the_papers_and_the_cpu_hours():
    """examples/cvrp/: the paper's schedule as it reports it, and the documented CPU hour:
    the built-in cvrp20's model and optimizer, trained longer, its end eval sampling as the
    paper tests."""
    paper = load_profile(str(REPO / "examples" / "cvrp" / "cvrp20_paper.toml"))
    t = paper.task
    assert (t.num_customers, t.encoder, t.embed_dim, t.n_heads, t.n_layers, t.ff_dim) == (
        20, "gat", 128, 8, 3, 512)  # fmt: skip
    assert (paper.data.batch_size, paper.train.lr, paper.train.schedule) == (512, 1e-4, "constant")
    assert paper.train.max_steps * paper.data.batch_size == 100 * t.epoch_instances == 128_000_000
    assert (t.baseline_instances, t.eval_instances, t.eval_sampled_tours) == (10_000, 10_000, 1280)
    hour = load_profile(str(REPO / "examples" / "cvrp" / "cvrp20_cpu_hour.toml"))
    built_in = load_profile("cvrp20")
    model_keys = ("num_customers", "encoder", "embed_dim", "n_heads", "n_layers", "ff_dim",
                  "epoch_instances", "eval_instances", "data_seed")  # fmt: skip
    assert [getattr(hour.task, k) for k in model_keys] == [
        getattr(built_in.task, k) for k in model_keys
    ]
    assert hour.data == built_in.data and hour.train.lr == built_in.train.lr
    assert hour.train.max_steps == 14 * built_in.train.max_steps
    assert hour.task.end_sampled_tours == 1280 and hour.hardware.devices == "cpu:2"


def cvrp_profile(tmp_path, eval_file: str) -> str:
    """A cvrp profile file naming ``eval_file``."""
    path = tmp_path / "routing.toml"
    path.write_text(
        '[profile]\nname = "routing"\n[task]\nkind = "cvrp"\nnum_customers = 10\n'
        f"eval_file = {eval_file!r}\n[train]\nmax_steps = 2\n"
    )
    return str(path)


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("none.vrp", None, "no such file or directory"),
        ("garbage.vrp", "NAME: x\nCAPACITY: 5\nNODE_COORD_SECTION\n1 a b\nDEMAND_SECTION\n1 0\n"
         "DEPOT_SECTION\n1\n-1\nEOF\n", "must be numbers"),
        ("nodemand.vrp", "NAME: x\nTYPE: CVRP\nDIMENSION: 2\nCAPACITY: 5\n"
         "NODE_COORD_SECTION\n1 0 0\n2 1 1\nDEPOT_SECTION\n1\n-1\nEOF\n", "no DEMAND_SECTION"),
        ("set.txt", "hello", "expected a .vrp file"),
        ("broken.pt", "not a torch file", "is not a torch file of tensors"),
        ("broken.npz", "not a zip", "is not a numpy .npz file"),
    ],
)  # fmt: skip
def test_a_bad_eval_file_is_refused_at_launch_in_one_line(procs, tmp_path, name, content, says):
    pytest.importorskip("vrplib")
    if content is not None:
        (tmp_path / name).write_text(content)
    profile = cvrp_profile(tmp_path, str(tmp_path / name))
    runs = tmp_path / "runs"
    result = procs.cli("run", profile, "--headless", "--devices", "cpu", "--runs-dir", str(runs))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"gpu-console: {profile}: task.eval_file: "), line
    assert says in line and "Traceback" not in result.stdout + result.stderr, line
    assert not runs.exists() or not any(runs.iterdir())


def test_vrplib_files_without_the_vrplib_package_are_refused_in_one_line(procs, tmp_path):
    (tmp_path / "one.vrp").write_text("NAME: x\nEOF\n")
    profile = cvrp_profile(tmp_path, str(tmp_path / "one.vrp"))
    runs = tmp_path / "runs"
    result = procs.cli("run", profile, "--headless", "--devices", "cpu", "--runs-dir", str(runs),
                       env=without_packages(tmp_path, "vrplib"))  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"gpu-console: {profile}: task.eval_file: reading VRPLIB files needs the vrplib "
        f'package: pip install "gpu-console[cvrp]" (got {str(tmp_path / "one.vrp")!r})'
    ], result.stderr
    assert not runs.exists() or not any(runs.iterdir())


# -- PyVRP's reference (task.pyvrp_seconds) ----------------------------------------------------


def test_pyvrp_tours_are_feasible_and_no_longer_than_clarke_wrights():
    pytest.importorskip("pyvrp")
    from gpu_console.tasks.cvrp_solvers import pyvrp_tour

    coords, demand = instances(4, 12, seeded(8, "cpu"))
    for xy, d in zip(coords.double().numpy(), demand.numpy(), strict=True):
        tour = pyvrp_tour(xy, d, 20.0, 0.05)
        check_tour(d, 20.0, tour)
        assert tour_length(xy, tour) <= tour_length(xy, clarke_wright(xy, d, 20.0)) + 1e-9


def test_the_eval_holds_pyvrps_lengths_cached_on_disk(tmp_path, monkeypatch):
    """The eval's ``pyvrp`` is PyVRP's mean length, kept per instance under the cache
    directory; a second run on the same instances reads it from there (a length changed in
    the cache shows in its eval)."""
    pytest.importorskip("pyvrp")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sets = small_sets("task.eval_instances=6", "task.pyvrp_seconds=0.05", "train.max_steps=2",
                      "train.eval_every=2", "task.eval_sampled_tours=4",
                      "task.eval_beam_width=3")  # fmt: skip
    (e,) = events_of(
        run_engine(tmp_path, "cvrp20", *sets, ranks=1, runs_dir=tmp_path / "one"), "eval"
    )
    (cached,) = (tmp_path / "cache" / "gpu-console" / "cvrp-pyvrp").iterdir()
    assert cached.name.endswith("-0.05s")
    files = sorted(cached.glob("*.json"), key=lambda p: int(p.stem))
    assert [p.stem for p in files] == [str(i) for i in range(6)]
    lengths = [json.loads(p.read_text())["length"] for p in files]
    assert e["pyvrp"] == pytest.approx(sum(lengths) / 6)
    assert e["pyvrp"] <= e["cw"]
    for name in ("greedy", "sampled", "beam", "cw"):
        assert e[f"{name}_gap_pyvrp_pct"] == pytest.approx(100 * (e[name] / e["pyvrp"] - 1))
    files[0].write_text(json.dumps({"length": lengths[0] + 6.0}))
    (again,) = events_of(
        run_engine(tmp_path, "cvrp20", *sets, ranks=1, runs_dir=tmp_path / "two"), "eval"
    )
    assert again["pyvrp"] == pytest.approx(e["pyvrp"] + 1.0)  # 6.0 over 6 instances


def test_pyvrp_seconds_without_the_pyvrp_package_is_refused_in_one_line(procs, tmp_path):
    runs = tmp_path / "runs"
    args = ["--devices", "cpu", "--set", "task.pyvrp_seconds=0.1", "--runs-dir", str(runs)]
    result = procs.cli("run", "cvrp20", "--headless", *args,
                       env=without_packages(tmp_path, "pyvrp"))  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert (
        line.startswith("gpu-console: ") and "task.pyvrp_seconds: needs the pyvrp package" in line
    )
    assert 'pip install "gpu-console[cvrp]"' in line, line
    assert not runs.exists() or not any(runs.iterdir())
