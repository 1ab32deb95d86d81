"""``cvrp``: the attention model for the capacitated vehicle routing problem, trained with
REINFORCE and a greedy rollout baseline (Kool, van Hoof & Welling, "Attention, Learn to Solve
Routing Problems!", ICLR 2019).

An instance is a depot and ``num_customers`` customers, uniform in the unit square, with
demands 1..9 and one vehicle of ``capacity`` that goes back to the depot to reload. The
policy builds a tour node by node: an encoder embeds the nodes once (``gat``: the paper's
graph attention with batch norm; ``gt``: a pre-norm graph transformer whose attention is
biased by the distance between nodes), or again at every step (``dgt``: the graph
transformer's embeddings refreshed by a layer that sees the partial tour and the remaining
load). The decoder attends from the context (the graph, the current node, the load) to the
nodes a vehicle may still visit, and points at the next one.

Training is REINFORCE. The baseline, per instance, is the tour that a frozen copy of the
policy drives greedily (the rollout baseline); during the first epoch, before any copy is
worth its rollout, it is a moving average of the sampled lengths. At each epoch's end the
current policy and the copy drive greedily over ``baseline_instances`` fixed instances; the
copy is replaced when the policy is better with a one-sided paired t-test p below
``baseline_alpha`` (a log event says which way it went, and a new set of instances is drawn
for the next test). The loss the console shows is the mean sampled tour length; its gradient
is REINFORCE's.

Training instances are made on the rank's device from the run's step and the batch's sample
indices, so every rank draws its own and a resume draws them again. The eval drives greedily
over ``eval_instances`` fixed instances (or ``eval_file``'s, cvrp_files.py): its loss is the
mean greedy tour length. Beside it: the shortest of the greedy tour and ``eval_sampled_tours``
sampled ones (``sampled``; at the schedule's last step ``end_sampled_tours`` where set, as a
paper samples at test time), optionally a beam search's (``beam``), and the references on the
same instances, each computed once per instance and kept: the nearest-neighbour heuristic
(``nn``), Clarke-Wright savings (``cw``, cvrp_solvers.py) and optionally PyVRP (``pyvrp``,
kept on disk too); ``on_eval_end`` adds the gaps in percent (docs/tasks.md).

Written against the public task contract (tasks/base.py), as a user's task would be.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32, unwrap
from .configs import CVRP_CAPACITY, CVRPConfig
from .cvrp_solvers import (
    check_tour,
    clarke_wright,
    clarke_wright_lengths,
    pyvrp_tour,
    routes_of,
    tour_length,
)

if TYPE_CHECKING:
    from ..engine.context import TaskContext

DEMAND_MAX = 9


def capacity_of(c: CVRPConfig) -> int:
    return c.capacity or CVRP_CAPACITY[c.num_customers]


def instances(
    n: int, customers: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` instances: coordinates (n, 1 + customers, 2), node 0 the depot, and integer
    demands (n, 1 + customers) as floats, the depot's 0."""
    coords = torch.rand(n, customers + 1, 2, generator=generator, device=device)
    demand = torch.randint(
        1, DEMAND_MAX + 1, (n, customers + 1), generator=generator, device=device
    ).float()
    demand[:, 0] = 0
    return coords, demand


def seeded(seed: int, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (2**63))
    return generator


class Routes:
    """The partial tours of a batch: where each vehicle is, what load it has left (in whole
    demand units, so exact), which customers are served, how far it has driven."""

    def __init__(self, coords: torch.Tensor, demand: torch.Tensor, capacity: float):
        batch, nodes, _ = coords.shape
        self.coords, self.demand, self.capacity = coords, demand, capacity
        self.rows = torch.arange(batch, device=coords.device)
        self.at = torch.zeros(batch, dtype=torch.long, device=coords.device)
        self.load = torch.full((batch,), capacity, dtype=demand.dtype, device=coords.device)
        self.served = torch.zeros(batch, nodes, dtype=torch.bool, device=coords.device)
        self.length = torch.zeros(batch, dtype=coords.dtype, device=coords.device)
        self.path: list[torch.Tensor] = []  # each move's node, per instance

    def all_served(self) -> torch.Tensor:
        return self.served[:, 1:].all(1)

    def done(self) -> torch.Tensor:
        return self.all_served() & (self.at == 0)

    def barred(self) -> torch.Tensor:
        """(batch, nodes) True where the next move may not go: a served customer, one whose
        demand exceeds the load, and the depot right after the depot while work is left."""
        barred = self.served | (self.demand > self.load[:, None])
        barred[:, 0] = (self.at == 0) & ~self.all_served()
        return barred

    def move(self, to: torch.Tensor) -> None:
        here, there = self.coords[self.rows, self.at], self.coords[self.rows, to]
        self.length = self.length + (there - here).norm(dim=-1)
        self.served[self.rows, to] = True
        self.load = torch.where(to == 0, self.capacity, self.load - self.demand[self.rows, to])
        self.at = to
        self.path.append(to)

    def state(self) -> torch.Tensor:
        """(batch, nodes, 4) what ``dgt`` re-embeds from: served, out of reach at this load,
        where the vehicle is, the load left."""
        here = F.one_hot(self.at, self.served.shape[1]).bool()
        load = (self.load / self.capacity)[:, None].expand_as(self.demand)
        flags = [self.served, self.demand > self.load[:, None], here]
        return torch.stack([f.to(self.coords.dtype) for f in flags] + [load], -1)


def nearest_neighbour(coords: torch.Tensor, demand: torch.Tensor, capacity: float) -> torch.Tensor:
    """Tour lengths of the nearest-neighbour heuristic: the nearest customer the load still
    serves, else back to the depot."""
    return nearest_neighbour_routes(coords, demand, capacity).length


def nearest_neighbour_routes(coords: torch.Tensor, demand: torch.Tensor, capacity: float) -> Routes:
    routes = Routes(coords, demand, capacity)
    for _ in range(2 * coords.shape[1]):
        if bool(routes.done().all()):
            break
        barred = routes.barred()
        here = coords[routes.rows, routes.at]
        dist = (coords - here[:, None]).norm(dim=-1).masked_fill(barred, math.inf)
        customer_left = (~barred[:, 1:]).any(1)
        dist[:, 0] = torch.where(customer_left, math.inf, dist[:, 0])
        routes.move(dist.argmin(1))
    return routes


def one_sided_p(diff: torch.Tensor) -> float:
    """The p-value of the paired t-test that the mean of ``diff`` is below 0, as scipy's
    ``ttest_rel(a, b, alternative="less")`` gives it for ``diff = a - b``."""
    n = diff.numel()
    sd = float(diff.double().std())
    if sd == 0.0:
        return 0.0 if float(diff.mean()) < 0 else 1.0
    return student_t_cdf(float(diff.double().mean()) / (sd / math.sqrt(n)), n - 1)


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))  # P(T ≤ -|t|)
    return tail if t < 0 else 1.0 - tail


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction
    (modified Lentz). Written here: scipy would be a dependency for one function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point
        return 1.0 - incomplete_beta(b, a, 1.0 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(log_front + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return front * result


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, n, d) → (batch, heads, n, d / heads)."""
    b, n, d = t.shape
    return t.view(b, n, heads, d // heads).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention over the nodes, with an optional additive bias per head."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = (split_heads(t, self.heads) for t in self.qkv(h).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def feed_forward(d: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))


class GATLayer(nn.Module):
    """The paper's encoder layer: attention and feed-forward, each with a skip connection
    followed by batch norm."""

    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.attn, self.ff = Attention(d, heads), feed_forward(d, hidden)
        self.norm1, self.norm2 = nn.BatchNorm1d(d), nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
        h = self.norm1((h + self.attn(h)).flatten(0, 1)).view_as(h)
        return self.norm2((h + self.ff(h)).flatten(0, 1)).view_as(h)


class GTLayer(nn.Module):
    """A pre-norm transformer layer over the complete graph whose attention logits are
    lowered by each head's learned multiple of the distance between two nodes."""

    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.attn, self.ff = Attention(d, heads), feed_forward(d, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.reach = nn.Parameter(torch.ones(heads))

    def forward(self, h: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
        bias = -self.reach[:, None, None] * dist[:, None].to(h.dtype)
        h = h + self.attn(self.norm1(h), bias)
        return h + self.ff(self.norm2(h))


class CVRPModel(nn.Module):
    """The policy: ``forward(coords, demand, greedy)`` → (tour lengths, log-probability of
    each tour), one per instance."""

    def __init__(self, c: CVRPConfig):
        super().__init__()
        d = c.embed_dim
        self.heads, self.clip = c.n_heads, c.tanh_clip
        self.capacity = float(capacity_of(c))
        layer = GATLayer if c.encoder == "gat" else GTLayer
        self.depot_in = nn.Linear(2, d)
        self.node_in = nn.Linear(3, d)
        self.encoder = nn.ModuleList(layer(d, c.n_heads, c.ff_dim) for _ in range(c.n_layers))
        dynamic = c.encoder == "dgt"
        self.state_in = nn.Linear(4, d) if dynamic else None
        self.refresh = GTLayer(d, c.n_heads, c.ff_dim) if dynamic else None
        self.context = nn.Linear(2 * d + 1, d, bias=False)
        self.keys = nn.Linear(d, 3 * d, bias=False)  # the glimpse's keys, values; the pointer's
        self.glimpse_out = nn.Linear(d, d, bias=False)

    def encode(
        self, coords: torch.Tensor, demand: torch.Tensor, dist: torch.Tensor
    ) -> torch.Tensor:
        customers = torch.cat([coords[:, 1:], (demand[:, 1:] / self.capacity)[..., None]], -1)
        h = torch.cat([self.depot_in(coords[:, :1]), self.node_in(customers)], 1)
        for layer in self.encoder:
            h = layer(h, dist)
        return h

    def fixed(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the decoder reads of the embeddings at every step: the graph's mean, the
        glimpse's keys and values per head and the pointer's keys. Once per tour, except
        ``dgt``'s."""
        glimpse_k, glimpse_v, pointer_k = self.keys(h).chunk(3, -1)
        per_head = (split_heads(t, self.heads).contiguous() for t in (glimpse_k, glimpse_v))
        return (h, h.mean(1), *per_head, pointer_k)

    def point(
        self, fixed: tuple[torch.Tensor, ...], routes: Routes, dist: torch.Tensor
    ) -> torch.Tensor:
        """Log-probabilities (batch, nodes) of the next node; barred nodes get none."""
        if self.refresh is not None:
            assert self.state_in is not None  # made with refresh (encoder = "dgt")
            h = fixed[0] + self.state_in(routes.state())
            fixed = self.fixed(self.refresh(h, dist))
        h, graph, glimpse_k, glimpse_v, pointer_k = fixed
        b, _, d = h.shape
        load = (routes.load / self.capacity)[:, None].to(h.dtype)
        query = self.context(torch.cat([graph, h[routes.rows, routes.at], load], -1))
        barred = routes.barred()
        # One query per instance: broadcast products beat batched matrix products (and the
        # fused attention kernel) at these shapes on a CPU.
        q = query.view(b, self.heads, 1, d // self.heads)
        scores = (q * glimpse_k).sum(-1) / math.sqrt(d // self.heads)  # (batch, heads, nodes)
        weights = torch.softmax(scores.masked_fill(barred[:, None], -math.inf), -1)
        glimpse = self.glimpse_out((weights[..., None] * glimpse_v).sum(-2).reshape(b, d))
        logits = at_least_fp32((pointer_k * glimpse[:, None]).sum(-1) / math.sqrt(d))
        logits = self.clip * torch.tanh(logits)
        return F.log_softmax(logits.masked_fill(barred, -math.inf), -1)

    def forward(
        self, coords: torch.Tensor, demand: torch.Tensor, greedy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routes, log_p = self.drive(coords, demand, greedy)
        return routes.length, log_p

    def drive(
        self,
        coords: torch.Tensor,
        demand: torch.Tensor,
        greedy: bool = False,
        samples: int = 1,
        generator: torch.Generator | None = None,
    ) -> tuple[Routes, torch.Tensor]:
        """The tours (sampled, or each move the likeliest) and each one's log-probability.
        ``samples`` > 1: that many tours of each instance, the instance's rows next to each
        other (row ``i * samples + k``), from one encoding of it; ``generator``: the
        sampling's random stream (else torch's global one)."""
        dist = torch.cdist(coords, coords)  # once per tour: the encoder's and dgt's bias
        fixed = self.fixed(self.encode(coords, demand, dist))
        if samples > 1:
            fixed = tuple(t.repeat_interleave(samples, 0) for t in fixed)
            coords, demand, dist = (t.repeat_interleave(samples, 0) for t in (coords, demand, dist))
        routes = Routes(coords, demand, self.capacity)
        dtype = torch.promote_types(torch.float32, coords.dtype)  # fp64 stays fp64
        log_p = torch.zeros(len(coords), dtype=dtype, device=coords.device)
        for _ in range(2 * coords.shape[1]):  # a customer and a return each: at most 2N moves
            done = routes.done()
            if bool(done.all()):
                break
            step_log_p = self.point(fixed, routes, dist)
            to = step_log_p.argmax(-1) if greedy else sample(step_log_p, generator)
            taken = step_log_p.gather(1, to[:, None])[:, 0]
            log_p = log_p + torch.where(done, 0.0, taken)
            routes.move(to)
        return routes, log_p


def instance_set_id(coords: torch.Tensor, demand: torch.Tensor, capacity: float) -> str:
    """A digest of a set of instances: the name of its PyVRP cache."""
    digest = hashlib.sha256()
    for t in (coords, demand):
        digest.update(str((t.dtype, tuple(t.shape))).encode())
        digest.update(t.contiguous().cpu().numpy().tobytes())
    digest.update(repr(float(capacity)).encode())
    return digest.hexdigest()[:16]


def pyvrp_cache() -> Path:
    """Where PyVRP's eval solutions are kept: ``$XDG_CACHE_HOME/gpu-console/cvrp-pyvrp``
    (``~/.cache/gpu-console/cvrp-pyvrp``, beside the compile cache); under it one directory
    per instance set and time limit, one JSON file (length, routes) per instance."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "gpu-console" / "cvrp-pyvrp"


@torch.no_grad()
def beam_search(
    model: CVRPModel, coords: torch.Tensor, demand: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per instance, the shortest of the ``width`` likeliest tours a beam search keeps:
    (lengths (batch,), moves (batch, moves)). The instance is encoded once; each step every
    kept partial tour is extended by every move the policy allows, and the ``width`` with the
    highest log-probability go on. Width 1 is the greedy tour."""
    batch, nodes, _ = coords.shape
    dist = torch.cdist(coords, coords)
    fixed = model.fixed(model.encode(coords, demand, dist))
    fixed = tuple(t.repeat_interleave(width, 0) for t in fixed)
    coords, demand, dist = (t.repeat_interleave(width, 0) for t in (coords, demand, dist))
    routes = Routes(coords, demand, model.capacity)
    dtype = torch.promote_types(torch.float32, coords.dtype)
    score = torch.full((batch, width), -math.inf, dtype=dtype, device=coords.device)
    score[:, 0] = 0.0  # one beam to start from; the others fill at the first step
    first_row = (torch.arange(batch, device=coords.device) * width)[:, None]
    for _ in range(2 * nodes):
        if bool(routes.done().all()):
            break
        log_p = model.point(fixed, routes, dist).to(dtype)  # a finished tour: 0 to the depot
        grown = (score[:, :, None] + log_p.view(batch, width, nodes)).view(batch, -1)
        score, pick = grown.topk(width, dim=1)
        beam, to = pick // nodes, pick % nodes
        to = torch.where(torch.isfinite(score), to, 0)  # a beam with no move left stays put
        rows = (first_row + beam).view(-1)
        routes.at, routes.load = routes.at[rows], routes.load[rows]
        routes.served, routes.length = routes.served[rows], routes.length[rows]
        routes.path = [step[rows] for step in routes.path]
        routes.move(to.view(-1))
    finished = (routes.done() & torch.isfinite(score).view(-1)).view(batch, width)
    lengths = routes.length.view(batch, width).masked_fill(~finished, math.inf)
    best, which = lengths.min(1)
    path = torch.stack(routes.path, 1).view(batch, width, -1)
    return best, path[torch.arange(batch, device=coords.device), which]


def dtype_of(model: nn.Module) -> torch.dtype:
    """The policy's dtype (fp64 under train.precision = "fp64"): what its instances take."""
    return next(unwrap(model).parameters()).dtype


def sample(log_p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.multinomial(log_p.exp(), 1, generator=generator)[:, 0]


@torch.no_grad()
def best_of_samples(
    model: CVRPModel,
    coords: torch.Tensor,
    demand: torch.Tensor,
    samples: int,
    generator: torch.Generator,
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per instance, the shortest of ``samples`` sampled tours: (lengths (batch,), moves
    (batch, moves), the depot 0 padding a tour that ended early). Driven in chunks of at most
    ``max_rows`` tours (at least one sample of each instance per chunk), each chunk encoding
    the instances once."""
    batch = len(coords)
    per_chunk = max(1, min(samples, max_rows // max(batch, 1)))
    best = torch.full((batch,), math.inf, dtype=coords.dtype, device=coords.device)
    best_path = torch.zeros(batch, 0, dtype=torch.long, device=coords.device)
    done = 0
    while done < samples:
        k = min(per_chunk, samples - done)
        routes, _ = model.drive(coords, demand, samples=k, generator=generator)
        lengths = routes.length.view(batch, k)
        path = torch.stack(routes.path, 1).view(batch, k, -1)
        shortest, which = lengths.min(1)
        chosen = path[torch.arange(batch, device=coords.device), which]
        width = max(best_path.shape[1], chosen.shape[1])
        best_path, chosen = (F.pad(t, (0, width - t.shape[1])) for t in (best_path, chosen))
        better = shortest < best
        best = torch.where(better, shortest, best)
        best_path = torch.where(better[:, None], chosen, best_path)
        done += k
    return best, best_path


class CVRPTask:
    Config = CVRPConfig
    ctx: TaskContext  # the engine's, assigned before build_model (tasks/base.py)

    def __init__(self, config: CVRPConfig):
        self.cfg = config
        self.capacity = float(capacity_of(config))
        self.baseline: CVRPModel | None = None  # the frozen copy that drives the rollouts
        self.ema: torch.Tensor | None = None
        self.epochs_done = 0
        self.replacements = 0
        self.cw_cache: dict[int, float] = {}  # eval instance → its Clarke-Wright length
        self.pyvrp_cache: dict[int, float] = {}  # eval instance → its PyVRP length
        self.eval_set = ""  # the eval instances' digest (instance_set_id)

    def build_model(self) -> nn.Module:
        model = CVRPModel(self.cfg)
        self.baseline = copy.deepcopy(model).requires_grad_(False).eval()
        return model

    def build_datasets(self):
        c = self.cfg
        train = TensorSet(torch.arange(c.epoch_instances))  # indices: instances are made later
        if not c.eval_instances:
            return train, None
        if c.eval_file:  # in the launch directory, where the ranks run (cvrp_files.py)
            from .cvrp_files import load

            coords, demand = (torch.from_numpy(a).float() for a in load(c.eval_file, self.capacity))
        else:
            coords, demand = instances(
                c.eval_instances, c.num_customers, seeded(c.data_seed, "cpu")
            )
        self.eval_set = instance_set_id(coords, demand, self.capacity)
        # Each instance's index rides along: its reference lengths are cached by it.
        return train, TensorSet(coords, demand, torch.arange(len(coords)))

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        if len(batch) == 3:  # the eval's fixed instances and their indices
            return self.evaluate(model, *batch)
        (indices,) = batch
        coords, demand = self.training_instances(indices, model)
        length, log_p = model(coords, demand)
        with torch.no_grad():
            baseline = self.baseline_of(coords, demand, length, model)
        reinforce = ((length - baseline).detach() * log_p).mean()
        # The value shown is the mean tour length; the gradient is REINFORCE's.
        loss = reinforce - reinforce.detach() + length.mean().detach()
        return TaskOutput(loss=loss, samples=len(indices), metrics={"baseline": baseline.mean()})

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, coords: torch.Tensor, demand: torch.Tensor, index: torch.Tensor
    ) -> TaskOutput:
        """The eval batch's mean tour lengths: greedy (the loss, and ``greedy``), the shortest
        of the greedy tour and ``eval_sampled_tours`` sampled ones (``sampled``), nearest neighbour
        (``nn``) and Clarke-Wright savings (``cw``)."""
        cw = self.clarke_wright_of(coords, demand, index)
        coords, demand = coords.to(dtype_of(model)), demand.to(dtype_of(model))
        policy = unwrap(model)
        assert isinstance(policy, CVRPModel)
        greedy = policy.drive(coords, demand, greedy=True)[0]
        length = greedy.length
        self.write_tours(coords, demand, index, greedy)
        metrics = {
            "greedy": length.mean(),
            "nn": nearest_neighbour(coords, demand, self.capacity).mean(),
            "cw": cw.mean(),
        }
        if self.cfg.pyvrp_seconds:
            metrics["pyvrp"] = self.pyvrp_of(coords, demand, index).mean()
        if self.cfg.eval_beam_width:
            beam, _ = beam_search(policy, coords, demand, self.cfg.eval_beam_width)
            metrics["beam"] = beam.mean()
        if samples := self.sampled_tours():
            sampled, _ = best_of_samples(
                policy, coords, demand, samples,
                self.eval_generator(index, coords.device), self.cfg.eval_tours_at_once,
            )  # fmt: skip
            metrics["sampled"] = torch.minimum(sampled, length).mean()
        return TaskOutput(loss=length.mean(), samples=len(coords), metrics=metrics)

    def sampled_tours(self) -> int:
        """Tours sampled per instance by the eval now: ``end_sampled_tours`` at the schedule's
        last step where set (its end eval), else ``eval_sampled_tours``."""
        c, ctx = self.cfg, self.ctx
        end = ctx.profile.train.max_steps
        if c.end_sampled_tours and end and ctx.step >= end:
            return c.end_sampled_tours
        return c.eval_sampled_tours

    def write_tours(
        self, coords: torch.Tensor, demand: torch.Tensor, index: torch.Tensor, greedy: Routes
    ) -> None:
        """The first ``eval_tours_drawn`` eval instances' tours, the model's greedy one and
        Clarke-Wright's, each in ``task/tours/step-N/instance-K.json`` (written by the rank
        that evaluated it): what ``gpu-console report`` draws."""
        drawn = [i for i, k in enumerate(index.tolist()) if k < self.cfg.eval_tours_drawn]
        if not drawn:
            return
        where = self.ctx.task_dir / "tours" / f"step-{self.ctx.step:08d}"
        where.mkdir(parents=True, exist_ok=True)
        moves = torch.stack(greedy.path, 1).cpu() if greedy.path else None
        for i in drawn:
            xy = coords[i].double().cpu().numpy()
            d = demand[i].double().cpu().numpy()
            model_tour = routes_of(moves[i].tolist()) if moves is not None else []
            cw_tour = clarke_wright(xy, d, self.capacity)
            record = {
                "instance": int(index[i]),
                "step": self.ctx.step,
                "coords": xy.tolist(),
                "demand": d.tolist(),
                "capacity": self.capacity,
                "tours": {
                    "greedy": {"routes": model_tour, "length": tour_length(xy, model_tour)},
                    "cw": {"routes": cw_tour, "length": tour_length(xy, cw_tour)},
                },
            }
            path = where / f"instance-{int(index[i]):04d}.json"
            part = path.with_name(f".{path.name}.{os.getpid()}")
            part.write_text(json.dumps(record))
            os.replace(part, path)

    def eval_generator(self, index: torch.Tensor, device: torch.device) -> torch.Generator:
        """The sampled eval's random stream for a batch: a function of the data seed and the
        batch's first instance, so every eval of a run, and of its resume, samples the same
        tours with the same policy."""
        return seeded((self.cfg.data_seed * 1_000_003 + 7) * 1_000_033 + int(index[0]), device)

    def clarke_wright_of(
        self, coords: torch.Tensor, demand: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """The savings heuristic's tour length of each eval instance, computed at the first
        eval that meets it (on the CPU, in float64) and kept for the run's later ones."""
        missing = [i for i, k in enumerate(index.tolist()) if k not in self.cw_cache]
        if missing:
            rows = torch.tensor(missing)
            found = clarke_wright_lengths(
                coords[rows].double().cpu().numpy(), demand[rows].double().cpu().numpy(),
                self.capacity,
            )  # fmt: skip
            for i, value in zip(missing, found.tolist(), strict=True):
                self.cw_cache[int(index[i])] = value
        lengths = [self.cw_cache[k] for k in index.tolist()]
        return torch.tensor(lengths, dtype=torch.float64, device=coords.device)

    def pyvrp_of(
        self, coords: torch.Tensor, demand: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """PyVRP's tour length of each eval instance (``pyvrp_seconds`` each), kept in memory
        for the run and on disk for every run on the same instances (:func:`pyvrp_cache`)."""
        seconds = self.cfg.pyvrp_seconds
        where = pyvrp_cache() / f"{self.eval_set}-{seconds:g}s"
        for i, k in enumerate(index.tolist()):
            if k in self.pyvrp_cache:
                continue
            saved = where / f"{k}.json"
            try:
                self.pyvrp_cache[k] = float(json.loads(saved.read_text())["length"])
                continue
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not solved yet (or a torn file): solve it
            xy, d = coords[i].double().cpu().numpy(), demand[i].double().cpu().numpy()
            tour = pyvrp_tour(xy, d, self.capacity, seconds)
            check_tour(d, self.capacity, tour)
            self.pyvrp_cache[k] = tour_length(xy, tour)
            where.mkdir(parents=True, exist_ok=True)
            part = saved.with_name(f".{saved.name}.{os.getpid()}")
            part.write_text(json.dumps({"length": self.pyvrp_cache[k], "tour": tour}))
            os.replace(part, saved)  # whole or absent, whichever rank writes it
        lengths = [self.pyvrp_cache[k] for k in index.tolist()]
        return torch.tensor(lengths, dtype=torch.float64, device=coords.device)

    def training_instances(self, indices: torch.Tensor, model: nn.Module):
        """The batch's instances, a function of the data seed, the step and the batch's first
        sample index (so of the rank and the micro-batch too)."""
        ctx = self.ctx
        seed = (self.cfg.data_seed * 1_000_003 + ctx.step) * 1_000_033 + int(indices[0])
        coords, demand = instances(
            len(indices), self.cfg.num_customers, seeded(seed, indices.device), indices.device
        )
        return coords.to(dtype_of(model)), demand.to(dtype_of(model))

    def baseline_of(self, coords, demand, length, model) -> torch.Tensor:
        """Per instance: the frozen copy's greedy tour after the first epoch; before it, the
        moving average of the sampled lengths (this rank's)."""
        if self.epochs_done:
            return self.rollout(self.baseline_on(model), coords, demand)
        mean = length.detach().mean()
        beta = self.cfg.ema_beta
        self.ema = mean if self.ema is None else beta * self.ema.to(mean) + (1 - beta) * mean
        return self.ema.expand_as(length)

    def baseline_on(self, model: nn.Module) -> CVRPModel:
        """The frozen copy, on the policy's device and in its dtype."""
        param = next(unwrap(model).parameters())
        assert self.baseline is not None  # build_model made it
        return self.baseline.to(device=param.device, dtype=param.dtype)

    @staticmethod
    @torch.no_grad()
    def rollout(policy: nn.Module, coords: torch.Tensor, demand: torch.Tensor) -> torch.Tensor:
        was_training = policy.training
        policy.eval()
        try:
            return policy(coords, demand, greedy=True)[0]
        finally:
            policy.train(was_training)

    def on_epoch_end(self, model: nn.Module, ctx) -> None:
        """The paired t-test of the policy against the frozen copy; the copy is replaced when
        the policy is significantly better. Rank 0 decides, for every rank."""
        policy, baseline = unwrap(model), self.baseline_on(model)
        c = self.cfg
        seed = c.data_seed + 7919 * (self.replacements + 1)
        coords, demand = instances(
            c.baseline_instances, c.num_customers, seeded(seed, ctx.device), ctx.device
        )
        coords, demand = coords.to(dtype_of(policy)), demand.to(dtype_of(policy))
        ours, theirs = self.rollout(policy, coords, demand), self.rollout(baseline, coords, demand)
        p = one_sided_p(ours - theirs)
        verdict = torch.tensor(
            [float(ours.mean() < theirs.mean() and p < c.baseline_alpha)], device=ctx.device
        )
        if ctx.world_size > 1:
            torch.distributed.broadcast(verdict, src=0)
        first = self.epochs_done == 0
        self.epochs_done += 1
        said = (
            f"greedy {float(ours.mean()):.3f} vs the baseline's {float(theirs.mean()):.3f} "
            f"on {c.baseline_instances} instances, p = {p:.3g}"
        )
        if bool(verdict.item()):
            baseline.load_state_dict(policy.state_dict())
            self.replacements += 1
            message = f"rollout baseline replaced after epoch {ctx.epoch}: {said}"
        else:
            message = f"rollout baseline kept after epoch {ctx.epoch}: {said}"
        if first:
            message += " (the moving average ends; rollouts begin)"
        if ctx.rank == 0:
            ctx.log(message)

    def on_eval_end(self, model: nn.Module, metrics, ctx) -> dict[str, float]:
        """The gaps in percent, each a ratio of mean lengths: the greedy tour's to nearest
        neighbour's (``gap_pct``), and each tour's to Clarke-Wright's (``*_gap_cw_pct``;
        negative: shorter than the savings heuristic's)."""
        gaps = {"gap_pct": 100.0 * (metrics["loss"] / metrics["nn"] - 1.0)}
        samples = self.sampled_tours()
        if "sampled" in metrics and samples != self.cfg.eval_sampled_tours and ctx.rank == 0:
            ctx.log(
                f"the eval at step {ctx.step}, the schedule's end: sampled is the best of "
                f"{samples} tours per instance (task.end_sampled_tours), not "
                f"{self.cfg.eval_sampled_tours}"
            )
        for name in ("greedy", "sampled", "beam", "nn"):
            if name in metrics:
                gaps[f"{name}_gap_cw_pct"] = 100.0 * (metrics[name] / metrics["cw"] - 1.0)
        if "pyvrp" in metrics:
            for name in ("greedy", "sampled", "beam", "cw"):
                if name in metrics:
                    gap = 100.0 * (metrics[name] / metrics["pyvrp"] - 1.0)
                    gaps[f"{name}_gap_pyvrp_pct"] = gap
        return gaps

    def state_dict(self) -> dict:
        assert self.baseline is not None  # build_model made it
        state = {
            "epochs_done": self.epochs_done,
            "replacements": self.replacements,
            "baseline": {
                k: v.detach().cpu().clone() for k, v in self.baseline.state_dict().items()
            },
        }
        if self.ema is not None:
            state["ema"] = self.ema.detach().cpu().clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epochs_done = int(state["epochs_done"])
        self.replacements = int(state["replacements"])
        assert self.baseline is not None  # build_model made it
        self.baseline.load_state_dict(state["baseline"])
        self.ema = state.get("ema")
