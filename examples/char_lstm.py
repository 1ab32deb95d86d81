"""A stateful character LSTM language model with truncated BPTT (examples/char_lstm.toml).

The shape of PyTorch's word-language-model example, on characters: the corpus is cut into
``bptt``-long chunks read as ``data.order = "contiguous"`` streams, so row j of each batch
continues row j of the one before; the LSTM's hidden state is carried from batch to batch
(detached: gradients stop at the chunk's start), reset when an epoch starts the streams
again, and saved with every checkpoint (``state_dict``) so a resume carries on with it.
Plain SGD (clipped by ``train.clip_grad_norm``) whose lr is divided by 4 whenever the eval
loss does not improve (``ReduceLROnPlateau``); perplexity as a derived eval metric; the best
checkpoint kept by ``checkpoint.keep_best``.

The corpus is the source of a module of Python's own standard library: nothing to download.
Only the documented task API (``gpu_console.tasks.base``) and plain torch are used.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_console.tasks.base import OptimizerSpec, TaskOutput, TensorSet, perplexity


@dataclass
class CharLSTMConfig:
    corpus: str = "textwrap"  # a standard-library module whose source is the text
    bptt: int = 32  # characters per chunk: gradients flow this far back
    emb: int = 32
    hidden: int = 128
    layers: int = 1
    lr: float = 5.0  # SGD's lr (the word-language-model example's is 20)
    plateau_threshold: float = 0.0  # relative improvement the eval loss must make, else lr/4
    eval_fraction: float = 0.1  # the end of the text, held out


def corpus(module: str) -> tuple[list[str], torch.Tensor]:
    """The characters of a standard-library module's source: (vocabulary, token ids)."""
    text = inspect.getsource(importlib.import_module(module))
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return vocab, torch.tensor([index[c] for c in text], dtype=torch.long)


def chunks(tokens: torch.Tensor, bptt: int) -> TensorSet:
    """Consecutive ``bptt``-long inputs and their next-character targets."""
    n = (len(tokens) - 1) // bptt
    x = tokens[: n * bptt].view(n, bptt)
    y = tokens[1 : n * bptt + 1].view(n, bptt)
    return TensorSet(x, y)


class LSTMModel(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int, layers: int):
        super().__init__()
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x, state=None):
        out, state = self.rnn(self.encoder(x), state)
        return self.decoder(out), state


class CharLSTM:
    Config = CharLSTMConfig
    derived_metrics = {"perplexity": perplexity}  # exp(eval loss), in every eval event

    def __init__(self, config: CharLSTMConfig):
        self.cfg = config
        self.vocab, self.tokens = corpus(config.corpus)
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None  # (h, c), carried

    def build_model(self) -> nn.Module:
        c = self.cfg
        return LSTMModel(len(self.vocab), c.emb, c.hidden, c.layers)

    def build_datasets(self):
        cut = int(len(self.tokens) * (1 - self.cfg.eval_fraction))
        return chunks(self.tokens[:cut], self.cfg.bptt), chunks(self.tokens[cut:], self.cfg.bptt)

    def configure_optimizers(self, model, ctx):
        sgd = torch.optim.SGD(model.parameters(), lr=self.cfg.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            sgd, mode="min", factor=0.25, patience=0, threshold=self.cfg.plateau_threshold
        )
        return OptimizerSpec(sgd, schedule=plateau, monitor="loss")

    def compute(self, model, batch) -> TaskOutput:
        x, y = batch
        # Training carries the state across batches (row j continues row j); eval batches
        # are not contiguous streams, so each starts from zeros.
        state = self.state if model.training else None
        logits, state = model(x, state)  # model(x): through DDP in training (unwrap: base.py)
        if model.training:
            self.state = (state[0].detach(), state[1].detach())
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return TaskOutput(loss=loss, samples=len(x), tokens=y.numel())

    def on_epoch_end(self, model, ctx):
        self.state = None  # the next epoch starts every stream again

    def state_dict(self) -> dict:
        return {"state": list(self.state) if self.state is not None else None}

    def load_state_dict(self, saved: dict) -> None:
        state = saved["state"]
        self.state = tuple(t.to(self.ctx.device) for t in state) if state is not None else None
