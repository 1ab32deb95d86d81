"""``moe``: a causal byte-level language model whose feed-forward layers are mixtures of experts.

The ``lm`` task's model and data (a text's bytes, Python's help topics by default), with each
block's feed-forward replaced by ``num_experts`` experts and a router:

- **Top-k routing.** A linear router scores the experts per token; softmax in float32; each
  token goes to its ``top_k`` best, weighted by their probabilities renormalised over the k.
- **Capacity.** An expert takes at most ``capacity_factor × tokens × top_k ÷ num_experts``
  tokens of a batch (GShard, Switch Transformer). Assignments queue in priority order, every
  token's first choice before any second choice, then by position; an assignment past its
  expert's capacity is dropped (the token keeps its residual; with top-2 its other expert
  may still take it). The experts then run as one batched matrix product over fixed-size
  buffers: no host synchronisation. ``capacity_factor = 0``: no limit, each expert runs on
  exactly its tokens (one host read of the counts per layer).
- **Load balancing.** Switch Transformer's auxiliary loss, ``num_experts · Σᵢ fᵢ·Pᵢ`` (fᵢ
  the share of assignments routed to expert i, Pᵢ its mean router probability; 1 when
  balanced), averaged over the layers and added to the loss times ``aux_loss_coef``.

Train metrics at each log step: ``ce`` (the language-model loss alone), ``aux_loss``,
``dropped`` (the share of assignments past capacity) and ``expert_load/<i>``, each expert's
share of the assignments averaged over the layers (1/num_experts each when balanced); the
console's run screen draws the last as bars. The eval loss is the cross-entropy alone, with
its perplexity.

Where the experts live: by default every rank holds every expert and DDP averages them as
any parameter. ``expert_parallel = true`` on several ranks spreads them: each rank builds its
``num_experts ÷ ranks`` (with the values the whole model would give them), the router stays
replicated, and each kept assignment's token row travels with ``all_to_all`` to its expert's
rank and back (a differentiable exchange: gradients travel the reverse way). The task names
those parameters in ``expert_parameters``; the engine's ``expert`` strategy keeps them out
of DDP and saves them whole (engine/strategy_expert.py). Routing, capacity and drops are
decided on each rank exactly as in the replicated model, so both train the same model: the
losses equal to float tolerance until a routing decision flips on the last bits in which the
experts' batched products differ, then a statistically equivalent run (docs/performance.md).

Written against the public task contract (tasks/base.py), as a user's task would be.
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32
from .configs import MoEConfig
from .lm import VOCAB, cut, windows
from .text_data import read_text
from .transformer import Block


class Experts(nn.Module):
    """Two-layer feed-forward networks, their weights stacked expert-first: experts
    ``[first, first + held)`` of ``n``, initialised as the whole ``n`` are (one rank holding
    them all or each its share: the same values)."""

    def __init__(self, n: int, d: int, ff: int, first: int = 0, held: int | None = None):
        super().__init__()
        w1, w2 = torch.empty(n, d, ff), torch.empty(n, ff, d)
        for w in (w1, w2):  # nn.Linear's initialisation, per expert
            bound = 1 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)
        mine = slice(first, first + (n if held is None else held))
        self.w1, self.w2 = nn.Parameter(w1[mine].clone()), nn.Parameter(w2[mine].clone())
        self.b1 = nn.Parameter(torch.zeros(n, ff)[mine].clone())
        self.b2 = nn.Parameter(torch.zeros(n, d)[mine].clone())

    def no_weight_decay(self) -> set[str]:
        """The stacked biases are two-dimensional, but biases all the same."""
        return {"b1", "b2"}

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """(experts, rows, d) → (experts, rows, d): every expert on its own rows."""
        return torch.baddbmm(
            self.b2[:, None], F.gelu(torch.baddbmm(self.b1[:, None], x, self.w1)), self.w2
        )

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """(rows, d) → (rows, d) through expert ``e`` (of those held)."""
        return F.gelu(x @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]


class Routing(Protocol):
    """The router's keys a :class:`MoE` reads (``moe``'s and ``moe_mnist``'s configs)."""

    num_experts: int
    top_k: int
    capacity_factor: float
    ff_mult: int
    expert_parallel: bool


class Spread:
    """Expert parallelism: the ranks' group for the exchanges, this rank, how many."""

    def __init__(self) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        # A group of its own: the exchanges never interleave with DDP's all-reduces.
        self.group = dist.new_group()


class Exchange(torch.autograd.Function):
    """``all_to_all`` of rows: ``got_rows`` from and ``sent_rows`` to each rank; the
    gradient travels back the same way with the sizes swapped."""

    @staticmethod
    def forward(ctx, rows, got_rows, sent_rows, group):
        ctx.sizes, ctx.group = (got_rows, sent_rows), group
        out = rows.new_empty((sum(got_rows), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), got_rows, sent_rows, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        got_rows, sent_rows = ctx.sizes
        out = grad.new_empty((sum(sent_rows), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), sent_rows, got_rows, group=ctx.group)
        return out, None, None, None


class MoE(nn.Module):
    """A router and its experts: the feed-forward of one block. After each forward,
    :attr:`stats` holds that batch's auxiliary loss, each expert's share of the assignments
    and the share dropped past capacity (tensors; the model gathers them), and
    :attr:`routed` each token's ``top_k`` experts (tokens × top_k, before capacity)."""

    def __init__(self, d: int, c: Routing, spread: Spread | None = None):
        super().__init__()
        self.k, self.capacity_factor = c.top_k, c.capacity_factor
        self.router = nn.Linear(d, c.num_experts, bias=False)
        self.spread = spread
        held = c.num_experts // spread.world if spread else None
        first = spread.rank * held if spread and held is not None else 0
        self.experts = Experts(c.num_experts, d, c.ff_mult * d, first, held)
        self.stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.routed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, d = x.shape, x.shape[-1]
        flat = x.reshape(-1, d)
        n, n_exp = flat.shape[0], self.router.out_features
        probs = at_least_fp32(self.router(flat)).softmax(-1)
        weight, expert = probs.topk(self.k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        # Assignments in priority order: every token's first choice, then every second one.
        choice, w = expert.t().reshape(-1), weight.t().reshape(-1)
        token = torch.arange(n, device=x.device).repeat(self.k)
        onehot = F.one_hot(choice, n_exp)
        counts = onehot.sum(0)
        load = counts.float() / choice.numel()
        aux = n_exp * (load * probs.mean(0)).sum()
        cap = 0
        if self.capacity_factor > 0:
            cap = max(1, math.ceil(self.capacity_factor * choice.numel() / n_exp))
        place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each assignment's place in its queue
        kept = place < cap if cap else torch.ones_like(choice, dtype=torch.bool)
        if self.spread is not None:
            out = self._exchanged(flat, choice, w, token, kept)
        elif cap:
            out = self._capped(flat, choice, w, token, place, kept, cap)
        else:
            out = self._exact(flat, choice, w, token, counts)
        dropped = 1 - kept.float().mean()
        self.stats = (aux, load.detach(), dropped.detach())
        self.routed = expert.detach()
        return out.view(shape)

    def _capped(self, flat, choice, w, token, place, kept, cap):
        """Fixed buffers of ``cap`` rows per expert (a last, spare row takes the dropped)."""
        n_exp, d = self.router.out_features, flat.shape[1]
        slot = torch.where(kept, choice * cap + place, n_exp * cap)
        buffers = flat.new_zeros(n_exp * cap + 1, d).index_copy(0, slot, flat[token])
        done = self.experts.batched(buffers[:-1].view(n_exp, cap, d)).reshape(-1, d)
        done = torch.cat([done, done.new_zeros(1, d)])
        scale = (w * kept).to(flat.dtype)[:, None]
        return flat.new_zeros(flat.shape).index_add(0, token, done[slot] * scale)

    def _exact(self, flat, choice, w, token, counts):
        """Every expert on exactly its assignments (sorted by expert: one host read)."""
        order = choice.argsort(stable=True)
        parts = flat[token[order]].split(counts.tolist())
        done = torch.cat([self.experts.one(e, part) for e, part in enumerate(parts)])
        scale = w[order].to(flat.dtype)[:, None]
        return flat.new_zeros(flat.shape).index_add(0, token[order], done * scale)

    def _exchanged(self, flat, choice, w, token, kept):
        """Expert parallelism: each kept assignment's row travels to the rank holding its
        expert, and its output back; the sizes are agreed first (host reads of the counts)."""
        sp, held = self.spread, self.experts.w1.shape[0]
        assert sp is not None  # expert parallelism: the model was built spread
        order = kept.nonzero().squeeze(1)
        order = order[choice[order].argsort(stable=True)]  # by expert: by rank, then expert
        sent = torch.bincount(choice[order], minlength=sp.world * held)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=sp.group)  # rows per (source rank, my expert)
        sent_rows = sent.view(sp.world, held).sum(1).tolist()
        got_rows = got.view(sp.world, held).sum(1).tolist()
        rows = Exchange.apply(flat[token[order]], got_rows, sent_rows, sp.group)
        # Received source by source, each source's rows by expert: regroup them by expert.
        mine = torch.arange(held, device=flat.device).repeat(sp.world)
        by_expert = torch.repeat_interleave(mine, got).argsort(stable=True)
        parts = rows[by_expert].split(got.view(sp.world, held).sum(0).tolist())
        done = torch.cat([self.experts.one(e, part) for e, part in enumerate(parts)])
        back = torch.empty_like(done).index_copy(0, by_expert, done)
        home = Exchange.apply(back, sent_rows, got_rows, sp.group)
        scale = w[order].to(flat.dtype)[:, None]
        return flat.new_zeros(flat.shape).index_add(0, token[order], home * scale)


class MoEBlock(Block):
    """The ``lm`` task's causal block with a mixture of experts as its feed-forward."""

    def __init__(self, c: MoEConfig, spread: Spread | None = None):
        super().__init__(c.d_model, c.n_heads, c.d_model, c.dropout, causal=True)
        self.ff = MoE(c.d_model, c, spread)


class MoEGPT(nn.Module):
    def __init__(self, c: MoEConfig, spread: Spread | None = None):
        super().__init__()
        self.spread = spread
        self.tok = nn.Embedding(VOCAB, c.d_model)
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.d_model))
        self.blocks = nn.ModuleList(MoEBlock(c, spread) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's scale: the tied table's default N(0, 1) makes first logits of ~√d_model.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"pos"}

    def forward(self, tokens: torch.Tensor):
        """(batch, time) bytes → the next-byte logits and the routing figures averaged over
        the blocks: (logits, aux loss, each expert's share, the share dropped)."""
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        stats = [cast(MoE, block.ff).stats for block in self.blocks]  # MoEBlock's
        aux, load, dropped = (torch.stack(s).mean(0) for s in zip(*stats, strict=True))
        return self.head(self.ln(x)), aux, load, dropped


def spread_for(c: Routing) -> Spread | None:
    """The ranks' spread of the experts under ``expert_parallel`` on several ranks, else
    None (every rank holds every expert)."""
    if c.expert_parallel and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1 and c.num_experts % world:
            raise ValueError(
                f"task.num_experts: {c.num_experts} experts do not divide evenly over "
                f"{world} ranks (task.expert_parallel)"
            )
        return Spread() if world > 1 else None
    return None


def spread_names(c: Routing, ctx, model: nn.Module) -> list[str]:
    """The experts' parameter names under ``expert_parallel`` on several ranks (``ctx``: the
    task's context, None before the engine assigns it), else none."""
    if not c.expert_parallel or ctx is None or ctx.world_size < 2:
        return []
    return [n for n, _ in model.named_parameters() if ".experts." in n]


class MoETask:
    Config = MoEConfig

    def __init__(self, config: MoEConfig):
        self.cfg = config

    def build_model(self) -> nn.Module:
        """Under ``expert_parallel`` on several ranks each rank holds its share of the
        experts (the values the whole model gives them); else every expert."""
        return MoEGPT(self.cfg, spread_for(self.cfg))

    def expert_parameters(self, model: MoEGPT) -> list[str]:
        """The parameters each rank holds alone, its slice of the experts (first dimension):
        the engine leaves them out of DDP's averaging and saves them whole
        (engine/strategy_expert.py). Named from the config and the ranks' world (``ctx``),
        not from this process's group: ``--dry-run`` builds the model in one process and
        names the strategy the ranks will use from this answer (engine/strategy.py)."""
        return spread_names(self.cfg, getattr(self, "ctx", None), model)

    def blocks(self, model: MoEGPT) -> list[nn.Module]:
        """The repeated blocks: the unit of FSDP sharding and of activation checkpointing."""
        return list(model.blocks)

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sequence (as ``lm``'s), the feed-forward counted for the
        ``top_k`` experts a token goes to, plus the router: 2 per multiply-add, 3× with the
        backward. Capacity's drops and the padding of its buffers are not counted."""
        c = self.cfg
        d, t, ff = c.d_model, c.seq_len, c.ff_mult * c.d_model
        layer = 8 * d * d + c.top_k * 4 * d * ff + 2 * d * c.num_experts + 4 * t * d
        return float(3 * (c.n_layers * layer + 2 * d * VOCAB) * t)

    def build_datasets(self):
        c = self.cfg
        data = torch.frombuffer(bytearray(read_text(c)), dtype=torch.uint8).long()
        train, tail = cut(data, c.seq_len + 1, c.eval_fraction)
        evals = windows(tail, c.seq_len + 1)
        return TensorSet(train), TensorSet(evals) if len(evals) else None

    def metric_reduce(self) -> dict[str, str]:
        """Shares of tokens: averaged over every token of the window on every rank."""
        names = ["ce", "aux_loss", "dropped"]
        names += [f"expert_load/{i}" for i in range(self.cfg.num_experts)]
        return dict.fromkeys(names, "mean_tokens")

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        (seq,) = batch
        logits, aux, load, dropped = model(seq[:, :-1])
        target = seq[:, 1:]
        ce = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), target.flatten())
        if not model.training:  # the eval: the language model's loss alone
            return TaskOutput(loss=ce, samples=len(seq), tokens=target.numel())
        metrics = {"ce": ce.detach(), "aux_loss": aux.detach(), "dropped": dropped}
        metrics.update((f"expert_load/{i}", share) for i, share in enumerate(load))
        return TaskOutput(
            loss=ce + self.cfg.aux_loss_coef * aux,
            samples=len(seq),
            tokens=target.numel(),
            metrics=metrics,
        )

    def on_eval_end(self, model: nn.Module, metrics, ctx) -> dict[str, float]:
        return {"ppl": math.exp(min(metrics["loss"], 50.0))}
