"""Reference solutions for the ``cvrp`` task's eval: the Clarke-Wright savings heuristic,
written here (numpy and plain Python, always available), PyVRP's solver where the optional
``cvrp`` extra is installed, and the tools to check a tour.

Clarke & Wright (1964), the parallel savings version: every customer starts on a route of its
own (depot, customer, depot); the saving of serving ``i`` and ``j`` on one route is
``d(0, i) + d(0, j) - d(i, j)``; in decreasing order of saving, the routes ending at ``i``
and at ``j`` are joined end to end when ``i`` and ``j`` are both ends of different routes,
the joined load fits the capacity and the saving is positive. Every route it returns serves
each customer once and never carries more than the capacity (a customer's own route holds
its demand: demands never exceed the capacity, which the task checks).

A tour is a list of routes, each a list of customers (1..n, the depot 0 left out); its length
goes from the depot through each route and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Tour = list[list[int]]


def distances(coords: np.ndarray) -> np.ndarray:
    """(nodes, nodes) Euclidean distances, in float64."""
    xy = np.asarray(coords, dtype=np.float64)
    return np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1))


def clarke_wright(coords: np.ndarray, demand: np.ndarray, capacity: float) -> Tour:
    """The savings heuristic's routes for one instance: ``coords`` (nodes, 2) with node 0 the
    depot, ``demand`` (nodes,) with the depot's 0. Ties between savings go to the lower pair
    ``(i, j)``, so the answer is a function of the instance alone."""
    dist = distances(coords)
    demand = np.asarray(demand, dtype=np.float64)
    n = len(dist) - 1
    if n <= 0:
        return []
    if float(demand[1:].max()) > capacity:
        raise ValueError(f"a demand of {demand[1:].max():g} exceeds the capacity {capacity:g}")
    i, j = np.triu_indices(n, k=1)
    i, j = i + 1, j + 1
    saving = dist[0, i] + dist[0, j] - dist[i, j]
    order = np.lexsort((j, i, -saving))  # the largest saving first; ties by (i, j)
    routes: dict[int, list[int]] = {c: [c] for c in range(1, n + 1)}  # by a route's id
    route_of = list(range(n + 1))  # each customer's route id (its first customer's, at first)
    load = {c: float(demand[c]) for c in range(1, n + 1)}
    for k in order:
        if saving[k] <= 0:
            break
        a, b = int(i[k]), int(j[k])
        ra, rb = route_of[a], route_of[b]
        if ra == rb or load[ra] + load[rb] > capacity:
            continue
        first, second = routes[ra], routes[rb]
        if first[-1] != a:  # a must end its route, b begin its own
            if first[0] != a:
                continue  # a is inside its route
            first = first[::-1]
        if second[0] != b:
            if second[-1] != b:
                continue
            second = second[::-1]
        routes[ra] = first + second
        load[ra] += load.pop(rb)
        del routes[rb]
        for c in second:
            route_of[c] = ra
    return [routes[r] for r in sorted(routes)]


def tour_length(coords: np.ndarray, tour: Sequence[Sequence[int]]) -> float:
    """The length of ``tour``: each route from the depot and back."""
    dist = distances(coords)
    total = 0.0
    for route in tour:
        stops = [0, *route, 0]
        total += float(sum(dist[a, b] for a, b in zip(stops, stops[1:], strict=False)))
    return total


def check_tour(demand: np.ndarray, capacity: float, tour: Sequence[Sequence[int]]) -> None:
    """Raise ValueError unless ``tour`` serves every customer exactly once and no route
    carries more than ``capacity``."""
    demand = np.asarray(demand, dtype=np.float64)
    n = len(demand) - 1
    served = sorted(c for route in tour for c in route)
    if served != list(range(1, n + 1)):
        raise ValueError(f"the tour serves {served}, not each of 1..{n} once")
    for route in tour:
        carried = float(sum(demand[c] for c in route))
        if carried > capacity + 1e-9:
            raise ValueError(f"route {route} carries {carried:g} > capacity {capacity:g}")


def routes_of(path: Sequence[int]) -> Tour:
    """A vehicle's moves (node after node, 0 the depot, as the model's tours record them)
    cut into routes at the depot."""
    tour: Tour = [[]]
    for node in path:
        if node == 0:
            if tour[-1]:
                tour.append([])
        else:
            tour[-1].append(int(node))
    return [route for route in tour if route]


def clarke_wright_lengths(coords: np.ndarray, demand: np.ndarray, capacity: float) -> np.ndarray:
    """The savings heuristic's tour length for each instance of a batch: ``coords``
    (batch, nodes, 2), ``demand`` (batch, nodes)."""
    coords = np.asarray(coords, dtype=np.float64)
    demand = np.asarray(demand, dtype=np.float64)
    pairs = zip(coords, demand, strict=True)
    return np.array([tour_length(xy, clarke_wright(xy, d, capacity)) for xy, d in pairs])


# PyVRP's integer distances: each distance times this, rounded (a micro-unit of the unit
# square). The tour's length is measured again from its routes, in float64.
PYVRP_SCALE = 1_000_000


def pyvrp_tour(
    coords: np.ndarray, demand: np.ndarray, capacity: float, seconds: float, seed: int = 0
) -> Tour:
    """PyVRP's (hybrid genetic search) best routes for one instance within ``seconds`` of
    wall time (an optional extra: ``pip install "gpu-console[cvrp]"``). Demands and the
    capacity go in as integers after multiplying by 1,000 (the generated ones are whole
    already); ValueError when it finds no feasible solution."""
    from pyvrp import Model
    from pyvrp.stop import MaxRuntime

    dist = distances(coords)
    n = len(dist) - 1
    model = Model()
    where = [model.add_location(x=float(x), y=float(y)) for x, y in np.asarray(coords)]
    model.add_vehicle_type(num_available=max(n, 1), capacity=round(1000 * capacity))
    model.add_depot(where[0])
    for place, q in zip(where[1:], np.asarray(demand)[1:], strict=True):
        model.add_client(place, delivery=round(1000 * float(q)))
    scaled = np.rint(dist * PYVRP_SCALE).astype(np.int64)
    for i, frm in enumerate(where):
        for j, to in enumerate(where):
            model.add_edge(frm, to, distance=int(scaled[i, j]))
    result = model.solve(stop=MaxRuntime(seconds), seed=seed, display=False)
    if not result.is_feasible():
        raise ValueError("PyVRP found no feasible solution in its time")
    tour = [[a.idx + 1 for a in route if a.is_client()] for route in result.best.routes()]
    return [route for route in tour if route]
