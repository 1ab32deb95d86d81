"""A small GPT-style character model with its own optimizer groups and schedule
(examples/gpt_char.toml).

The shape of nanoGPT's character-level training: batches of random windows of the token
stream (``data.order = "random"``, its ``get_batch``), a causal transformer, AdamW with two
parameter groups (matrices decay; biases, norms and embeddings do not) and nanoGPT's betas,
a linear warmup then a cosine decay to a floor (a ``LambdaLR``), a loss estimate on a val
split and a train split before the first step (``train.eval_at_start``) and every
``eval_every`` steps, the best val checkpoint kept, and ``flops_per_sample`` (nanoGPT's
``estimate_mfu`` count) for MFU on GPUs. ``gpu-console export RUN --out gpt.pt`` writes the
model's ``state_dict`` as ``gpt``, which :class:`GPT` loads with plain torch.

The corpus is the source of a module of Python's own standard library: nothing to download.
Only the documented task API (``gpu_console.tasks.base``) and plain torch are used.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_console.tasks.base import OptimizerSpec, TaskOutput, perplexity


@dataclass
class GPTConfig:
    corpus: str = "argparse"  # a standard-library module whose source is the text
    block: int = 64  # context length
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 20
    decay_steps: int = 300  # the cosine's length after warmup; then min_lr
    weight_decay: float = 0.1
    eval_windows: int = 64  # windows per eval split


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd)
        )
        self.drop = nn.Dropout(c.dropout)
        self.n_head, self.dropout = c.n_head, c.dropout

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.attn(self.ln1(x)).split(e, dim=2)
        q, k, v = (z.view(b, t, self.n_head, e // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, e)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, c.n_embd)
        self.pos = nn.Embedding(c.block, c.n_embd)
        self.blocks = nn.Sequential(*(Block(c) for _ in range(c.n_layer)))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, vocab, bias=False)

    def forward(self, idx):
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


class Windows:
    """Every ``block + 1``-long window of a token stream, by offset: with ``data.order =
    "random"`` a batch is ``batch_size`` offsets drawn with replacement (nanoGPT's
    ``get_batch``). ``__getitems__`` slices the whole batch at once; the task's ``collate``
    passes it on as is."""

    def __init__(self, tokens: torch.Tensor, block: int, offsets: torch.Tensor | None = None):
        self.tokens, self.block = tokens, block
        self.offsets = offsets  # eval: a fixed set of windows (None: every offset)

    def __len__(self) -> int:
        return len(self.offsets) if self.offsets is not None else len(self.tokens) - self.block

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.as_tensor(indices)
        if self.offsets is not None:
            starts = self.offsets[starts]
        rows = self.tokens[starts.unsqueeze(1) + torch.arange(self.block + 1)]
        return rows[:, :-1], rows[:, 1:]

    def __getitem__(self, i: int):
        x, y = self.__getitems__([i])
        return x[0], y[0]


class GPTChar:
    Config = GPTConfig
    derived_metrics = {"perplexity": perplexity}

    def __init__(self, config: GPTConfig):
        self.cfg = config
        text = inspect.getsource(importlib.import_module(config.corpus))
        self.vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.vocab)}
        self.tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)

    def build_model(self) -> nn.Module:
        model = GPT(self.cfg, len(self.vocab))
        self.n_params = sum(q.numel() for q in model.parameters()) - model.pos.weight.numel()
        return model

    def build_datasets(self):
        c = self.cfg
        cut = int(len(self.tokens) * 0.9)
        train, val = self.tokens[:cut], self.tokens[cut:]

        def spread(n: int) -> torch.Tensor:  # fixed windows spread over a split
            return torch.linspace(0, n - c.block - 1, c.eval_windows).long()

        evals = {
            "val": Windows(val, c.block, spread(len(val))),
            "train": Windows(train, c.block, spread(len(train))),
        }
        return Windows(train, c.block), evals

    def collate(self, batch):
        return batch  # Windows.__getitems__ returns the stacked (x, y)

    def configure_optimizers(self, model, ctx):
        c = self.cfg
        decay = [q for q in model.parameters() if q.requires_grad and q.dim() >= 2]
        no_decay = [q for q in model.parameters() if q.requires_grad and q.dim() < 2]
        # nanoGPT decays every >= 2-D weight, its embeddings included.
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": c.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=c.lr,
            betas=(0.9, 0.95),
        )
        return OptimizerSpec(opt, schedule=torch.optim.lr_scheduler.LambdaLR(opt, self.lr_factor))

    def lr_factor(self, step: int) -> float:
        """nanoGPT's get_lr(step) / lr: the factor for the update after ``step`` updates."""
        c = self.cfg
        if step < c.warmup:
            return (step + 1) / (c.warmup + 1)
        if step > c.warmup + c.decay_steps:
            return c.min_lr / c.lr
        ratio = (step - c.warmup) / c.decay_steps
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return (c.min_lr + coeff * (c.lr - c.min_lr)) / c.lr

    def compute(self, model, batch) -> TaskOutput:
        x, y = batch
        logits = model(x)  # through DDP in training: its backward averages the gradients
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return TaskOutput(loss=loss, samples=len(x), tokens=y.numel())

    def flops_per_sample(self) -> float:
        """nanoGPT's estimate_mfu: 6 N + 12 L H Q T per token (forward and backward), where
        N counts the parameters without the position table."""
        c = self.cfg
        per_token = 6 * self.n_params + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block
        return per_token * c.block

    def export_modules(self) -> dict[str, str]:
        return {"gpt": ""}  # the whole model: GPT(config, vocab).load_state_dict(out["gpt"])
