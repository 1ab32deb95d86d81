"""``lm``: a GPT-style causal language model on the bytes of a text file.

Tokens are bytes (a vocabulary of 256: no tokenizer to ship or download). ``task.text_file``
names the text; without one the model reads Python's own help topics (``pydoc_data``, which
CPython ships), so the profile runs with no arguments and no download. The text's tail
(``eval_fraction``) is held out. Sequences are consecutive windows of ``seq_len + 1`` bytes;
the model predicts each next byte with causal ``scaled_dot_product_attention``, the output
layer tied to the byte embedding. Decay and no-decay groups follow the engine's default
(matrices decay; embeddings, norms and the positional table do not).

At each eval: the perplexity (``exp`` of the eval loss) joins the eval's figures, and a
greedy sample of ``sample_bytes`` bytes is written as a log event (the console's log pane
and the headless output). The blocks are named for activation checkpointing and FSDP.

Written against the public task contract (tasks/base.py), as a user's task would be; its
block is the ``transformer`` task's, made causal.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32
from .configs import LMConfig
from .text_data import read_text, split
from .transformer import Block

VOCAB = 256  # bytes


class GPT(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.seq_len = c.seq_len
        self.tok = nn.Embedding(VOCAB, c.d_model)
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.d_model))
        self.blocks = nn.ModuleList(
            Block(c.d_model, c.n_heads, c.ff_mult * c.d_model, c.dropout, causal=True)
            for _ in range(c.n_layers)
        )
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: one table reads and writes bytes
        # GPT-2's scale, as moe.py's: nn.Embedding's N(0, 1) made the tied output layer's
        # first logits so large that a byte model started at loss ~25, not near ln 256 = 5.5.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """The positional table is a lookup, like the byte embedding: it does not decay."""
        return {"pos"}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, time) bytes → (batch, time, 256) logits of each next byte."""
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def cut(data: torch.Tensor, length: int, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The training windows of ``length`` bytes and the held-out tail, where the console
    counted them before launch (text_data.split: one rule for both); ValueError where the
    text holds no training window."""
    count, held = split(len(data), length, eval_fraction)
    if count == 0:
        raise ValueError(
            f"task.text_file: {len(data):,} bytes hold no training sequence of "
            f"seq_len + 1 = {length} bytes"
        )
    return data[: count * length].view(count, length), data[len(data) - held :]


def windows(data: torch.Tensor, length: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows of ``length`` bytes (the ragged end dropped)."""
    n = len(data) // length
    return data[: n * length].view(n, length)


def greedy(model: nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` bytes after ``prompt`` (1-D), each the most likely next one, seen through at
    most the model's context."""
    out = prompt
    for _ in range(n):
        # a plain int attribute; nn.Module's stubs type every attribute a tensor or module
        logits = model(out[-cast(int, model.seq_len) :][None])[0, -1]
        out = torch.cat([out, logits.argmax()[None]])
    return out[len(prompt) :]


class LMTask:
    Config = LMConfig

    def __init__(self, config: LMConfig):
        self.cfg = config
        self._prompt: torch.Tensor | None = None

    def build_model(self) -> nn.Module:
        return GPT(self.cfg)

    def blocks(self, model: GPT) -> list[nn.Module]:
        """The repeated blocks: the unit of FSDP sharding and of activation checkpointing."""
        return list(model.blocks)

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sequence: 2 per multiply-add forward, 3× with the backward.
        Per layer and token: qkv and proj 8·d², the feed-forward 4·d·ff, attention 4·t·d
        (QKᵀ and AV, counted whole though causal; FlopCounterMode counts no attention
        kernel on CPU); the output layer 2·d·256 per token. Embeddings, norms, GELU and
        softmax are not counted."""
        c = self.cfg
        d, t, ff = c.d_model, c.seq_len, c.ff_mult * c.d_model
        per_token = c.n_layers * (8 * d * d + 4 * d * ff + 4 * t * d) + 2 * d * VOCAB
        return float(3 * per_token * t)

    def build_datasets(self):
        c = self.cfg
        data = torch.frombuffer(bytearray(read_text(c)), dtype=torch.uint8).long()
        train, tail = cut(data, c.seq_len + 1, c.eval_fraction)
        prompt = c.prompt.encode() or bytes(tail[: c.seq_len // 2].tolist())
        self._prompt = torch.tensor(list(prompt or b"\n"), dtype=torch.long)
        evals = windows(tail, c.seq_len + 1)
        return TensorSet(train), TensorSet(evals) if len(evals) else None

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        (seq,) = batch
        logits = model(seq[:, :-1])
        target = seq[:, 1:]
        loss = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), target.flatten())
        return TaskOutput(loss=loss, samples=len(seq), tokens=target.numel())

    def on_eval_end(self, model: nn.Module, metrics, ctx) -> dict[str, float]:
        """The perplexity; a greedy sample as a log event. Every rank makes the sample's
        forwards (a sharded model's need every rank); rank 0's line is the event."""
        if self.cfg.sample_bytes and self._prompt is not None:
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    made = greedy(model, self._prompt.to(ctx.device), self.cfg.sample_bytes)
            finally:
                model.train(was_training)
            text = bytes(made.tolist()).decode("utf-8", errors="replace")
            if ctx.rank == 0:
                ctx.log(f"sample @ step {ctx.step}: {text!r}")
        return {"ppl": math.exp(min(metrics["loss"], 50.0))}
