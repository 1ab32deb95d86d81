"""``hf``: a Hugging Face ``transformers`` model, causal LM or sequence classifier.

``task.model`` names a local directory a model was saved to (``save_pretrained``): it is
loaded with ``local_files_only``, never downloaded. Without one, ``task.config`` is a table
of a transformers config (``model_type`` and its keys) and the model is built new with
``from_config``: so a tiny config trains offline, which is how the tests run it.

The text (``task.text_file``; by default Python's own help topics, as ``lm`` reads) goes
through the model directory's tokenizer when it has one, else it is read as bytes (the
model's vocabulary must then hold 256 tokens). ``causal-lm`` predicts each next token of
consecutive windows; ``sequence-classification`` learns to tell a window from one with every
token shifted by one (half of them are: a cipher), with its accuracy as a metric.

transformers is an optional extra (``pip install "gpu-console[hf]"``): the profile checks
for it before launch (configs.py, torch-free) and this module imports it on the ranks only.
Written against the public task contract (tasks/base.py), as a user's task would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32
from .configs import BYTES, HFConfig
from .lm import windows
from .text_data import held_out, read_text

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFTask:
    Config = HFConfig

    def __init__(self, config: HFConfig):
        self.cfg = config
        self.tokenizer = None
        self.vocab = BYTES  # the text's tokens: bytes, or the tokenizer's

    def model_class(self):
        import transformers

        if self.cfg.head == "causal-lm":
            return transformers.AutoModelForCausalLM
        return transformers.AutoModelForSequenceClassification

    def build_model(self) -> nn.Module:
        import transformers

        c = self.cfg
        extra: dict[str, Any] = {"num_labels": 2} if c.head == "sequence-classification" else {}
        if c.model:
            where = Path(c.model).expanduser()
            if not where.is_dir():
                raise FileNotFoundError(f"task.model: no such directory: {where.resolve()}")
            self.tokenizer = local_tokenizer(where)
            model = self.model_class().from_pretrained(where, local_files_only=True, **extra)
        else:
            config = transformers.AutoConfig.for_model(**c.config, **extra)
            model = self.model_class().from_config(config)
        if self.tokenizer is None and vocabulary(model) < BYTES:
            raise ValueError(
                f"task.config: the text is read as bytes without a tokenizer: the model's "
                f"vocabulary needs {BYTES} tokens (has {vocabulary(model)})"
            )
        if c.head == "sequence-classification" and model.config.pad_token_id is None:
            model.config.pad_token_id = 0  # batches are never padded; the model asks for one
        model.config.use_cache = False  # training: no key/value cache to keep
        return model

    def build_datasets(self):
        c = self.cfg
        text = read_text(c)
        if self.tokenizer is not None:
            ids = self.tokenizer(text.decode("utf-8", errors="replace"))["input_ids"]
            data = torch.tensor(ids, dtype=torch.long)
            self.vocab = len(self.tokenizer)
        else:
            data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
            self.vocab = BYTES
        held = held_out(len(data), c.eval_fraction)
        length = c.seq_len + 1 if c.head == "causal-lm" else c.seq_len
        train = self.examples(windows(data[: len(data) - held], length))
        if train is None:
            raise ValueError(
                f"task.text_file: {len(data):,} tokens hold no training sequence of {length} tokens"
            )
        evals = self.examples(windows(data[len(data) - held :], length))
        return train, evals

    def examples(self, seqs: torch.Tensor) -> TensorSet | None:
        if not len(seqs):
            return None
        if self.cfg.head == "causal-lm":
            return TensorSet(seqs)
        shifted = torch.arange(len(seqs)) % 2
        seqs = torch.where(shifted[:, None].bool(), (seqs + 1) % self.vocab, seqs)
        return TensorSet(seqs, shifted)

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        if self.cfg.head == "causal-lm":
            (seq,) = batch
            logits = model(input_ids=seq[:, :-1]).logits
            target = seq[:, 1:]
            loss = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), target.flatten())
            return TaskOutput(loss=loss, samples=len(seq), tokens=target.numel())
        seq, label = batch
        logits = at_least_fp32(model(input_ids=seq).logits)
        accuracy = (logits.argmax(-1) == label).float().mean()
        return TaskOutput(
            loss=F.cross_entropy(logits, label),
            samples=len(seq),
            tokens=seq.numel(),
            metrics={"accuracy": accuracy},
        )


def local_tokenizer(where: Path):
    """The directory's own tokenizer, or None where it has none (the text is then bytes)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError):
        return None


def vocabulary(model: PreTrainedModel) -> int:
    return cast(nn.Embedding, model.get_input_embeddings()).num_embeddings
