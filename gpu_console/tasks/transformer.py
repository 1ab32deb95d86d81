"""``transformer``: an encoder classifier on synthetic token sequences.

Each class favours its own band of tokens; a sequence mixes class tokens with uniform
noise, so the model must attend over the whole sequence to tell classes apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32
from .configs import TransformerConfig


class Block(nn.Module):
    """A pre-norm transformer block (``causal``: each position attends to itself and before:
    the ``lm`` task's)."""

    def __init__(self, d: int, heads: int, ff: int, dropout: float, causal: bool = False):
        super().__init__()
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff: nn.Module = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.ff(self.ln2(x)))


class Encoder(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.d_model))
        self.blocks = nn.ModuleList(
            Block(c.d_model, c.n_heads, c.ff_mult * c.d_model, c.dropout) for _ in range(c.n_layers)
        )
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.num_classes)

    def no_weight_decay(self) -> set[str]:
        """The positional table is a lookup, like the token embedding: it does not decay."""
        return {"pos"}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


def make_sequences(c: TransformerConfig, n: int, g: torch.Generator):
    labels = torch.randint(0, c.num_classes, (n,), generator=g)
    band = max(1, c.vocab_size // c.num_classes)
    from_class = labels[:, None] * band + torch.randint(0, band, (n, c.seq_len), generator=g)
    uniform = torch.randint(0, c.vocab_size, (n, c.seq_len), generator=g)
    use_class = torch.rand(n, c.seq_len, generator=g) < 0.3
    return torch.where(use_class, from_class, uniform).clamp_max(c.vocab_size - 1), labels


class TransformerTask:
    Config = TransformerConfig

    def __init__(self, config: TransformerConfig):
        self.cfg = config

    def build_model(self) -> nn.Module:
        return Encoder(self.cfg)

    def blocks(self, model: Encoder) -> list[nn.Module]:
        """The model's repeated blocks, the encoder layers: the unit of sharding
        (``distributed.strategy = "fsdp"``) and of ``train.activation_checkpointing``."""
        return list(model.blocks)

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sequence, counted from the model above: 2 per multiply-add
        forward, 3× that with the backward (every matmul's input and weight gradients: the
        embeddings feed a parameter sum, so block 0 needs its input gradient too).

        Forward FLOPs per layer and token: qkv and proj 8·d², the feed-forward 4·d·ff,
        attention 4·seq·d (QKᵀ and AV over all heads). The head sees one pooled vector per
        sequence. Embedding lookups, LayerNorm, GELU, softmax and biases are not counted.
        That is the usual 6·N per token (N: the blocks' matmul weights) plus 12·L·d·seq.
        """
        c = self.cfg
        d, t, ff = c.d_model, c.seq_len, c.ff_mult * c.d_model
        per_token = c.n_layers * (8 * d * d + 4 * d * ff + 4 * t * d)
        forward = per_token * t + 2 * d * c.num_classes
        return float(3 * forward)

    def build_datasets(self):
        c = self.cfg
        g = torch.Generator().manual_seed(c.data_seed)
        train = TensorSet(*make_sequences(c, c.train_samples, g))
        evals = TensorSet(*make_sequences(c, c.eval_samples, g)) if c.eval_samples else None
        return train, evals

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        tokens, y = batch
        logits = model(tokens)
        loss = F.cross_entropy(at_least_fp32(logits), y)
        accuracy = (logits.argmax(-1) == y).float().mean()
        return TaskOutput(
            loss=loss, samples=len(y), tokens=tokens.numel(), metrics={"accuracy": accuracy}
        )
