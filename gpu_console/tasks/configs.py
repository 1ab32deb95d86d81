"""Config sections of the built-in tasks (the task's own keys in ``[task]``)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Literal

from ..schema import KeyProblem, opt
from . import text_data, volume_files


def heads_divide(d_model: int, n_heads: int, width: str = "d_model") -> None:
    """The attention heads split the width evenly (a ValueError the profile loader reports)."""
    if n_heads and d_model % n_heads:
        raise ValueError(f"task.n_heads: must divide task.{width}={d_model} (got {n_heads})")


@dataclass
class MLPConfig:
    input_dim: int = opt(32, "features per sample", min=1)
    hidden_dim: int = opt(256, "width of each hidden layer", min=1)
    num_layers: int = opt(3, "linear layers, the output layer included", min=1)
    num_classes: int = opt(10, "clusters to tell apart", min=2)
    dropout: float = opt(0.0, "dropout after each hidden layer", min=0.0, max=0.9)
    batch_norm: bool = opt(False, "BatchNorm after each hidden layer (see sync_batchnorm)")
    train_samples: int = opt(32768, "synthetic training samples", min=1)
    eval_samples: int = opt(4096, "synthetic held-out samples", min=0)
    noise: float = opt(1.0, "spread of each cluster around its centre", min=0.0)
    separation: float = opt(0.5, "scale of the cluster centres; smaller is harder", gt=0.0)
    data_seed: int = opt(1234, "seed of the synthetic data set (the same on every rank)")


@dataclass
class TransformerConfig:
    vocab_size: int = opt(128, "token vocabulary", min=4)
    seq_len: int = opt(64, "tokens per sequence", min=2)
    d_model: int = opt(128, "model width", min=8)
    n_heads: int = opt(4, "attention heads (must divide d_model)", min=1)
    n_layers: int = opt(2, "encoder layers", min=1)
    ff_mult: int = opt(4, "feed-forward width as a multiple of d_model", min=1)
    num_classes: int = opt(4, "sequence classes", min=2)
    dropout: float = opt(0.1, "dropout in attention and feed-forward", min=0.0, max=0.9)
    train_samples: int = opt(16384, "synthetic training sequences", min=1)
    eval_samples: int = opt(2048, "synthetic held-out sequences", min=0)
    data_seed: int = opt(1234, "seed of the synthetic data set (the same on every rank)")

    def __post_init__(self) -> None:
        # Cross-field rule; reported through the profile loader like any other problem.
        heads_divide(self.d_model, self.n_heads)


@dataclass
class Autoencoder3DConfig:
    size: int = opt(16, "voxels along each side of a volume (a multiple of 4)", min=8)
    channels: int = opt(
        8, "channels of the first convolution (doubled at each downsampling)", min=1
    )
    latent_channels: int = opt(16, "channels of the code at 1/4 resolution", min=1)
    max_ellipsoids: int = opt(3, "ellipsoids per volume: 1 to this many", min=1)
    noise: float = opt(0.1, "std of the Gaussian noise on the input (the target is clean)", min=0.0)
    train_samples: int = opt(2048, "synthetic training volumes", min=1)
    eval_samples: int = opt(128, "synthetic held-out volumes", min=0)
    slice_png: bool = opt(
        True,
        "each eval writes the fullest slice of one held-out volume as a labelled PNG (task/)",
    )
    data_seed: int = opt(
        1234,
        "seed of the synthetic data set, and of data_dir's held-out split and eval noise "
        "(the same on every rank)",
    )
    data_dir: str = opt(
        "",
        "a directory of volumes to train on: .npy (D, H, W) or (C, D, H, W); .nii/.nii.gz "
        "with the volumes extra; empty: synthetic ellipsoids (size, max_ellipsoids, "
        "train_samples and eval_samples are theirs)",
    )
    eval_fraction: float = opt(
        0.1,
        "data_dir: the share of its volumes held out for eval, at least one (chosen by "
        "data_seed; 0: no eval)",
        min=0.0,
        max=0.5,
    )
    normalize: Literal["minmax", "zscore", "none"] = opt(
        "minmax",
        "data_dir: each volume's values, per channel: minmax to [0, 1] (PSNR's peak), zscore "
        "to mean 0 and std 1, or none (the synthetic volumes are in [0, 1] already)",
    )
    flip: bool = opt(
        False,
        "augmentation: each training volume (input and target alike) flipped along each "
        "spatial axis with probability 1/2; eval volumes never",
    )

    def __post_init__(self) -> None:
        if self.size % 4:
            raise ValueError(f"task.size: must be a multiple of 4 (got {self.size})")

    def volumes(self, cwd: str | None = None) -> volume_files.Volumes | None:
        """``data_dir`` judged and split (volume_files.py), None without one."""
        if not self.data_dir:
            return None
        return volume_files.scan(self.data_dir, self.eval_fraction, self.data_seed, cwd)

    def train_size(self, cwd: str | None = None) -> int:
        """The training volumes: ``data_dir``'s, judged in ``cwd`` (the run's launch
        directory) from the files' headers, KeyProblem for what the ranks could not read;
        else the synthetic ``train_samples``."""
        found = self.volumes(cwd)
        return self.train_samples if found is None else len(found.train)


@dataclass
class LMConfig:
    text_file: str = opt(
        "",
        "a UTF-8 text file to train on, as bytes (no tokenizer); empty: Python's own help "
        "topics (pydoc_data, shipped with CPython)",
    )
    seq_len: int = opt(64, "bytes of context per sequence", min=2)
    d_model: int = opt(128, "model width", min=8)
    n_heads: int = opt(4, "attention heads (must divide d_model)", min=1)
    n_layers: int = opt(2, "transformer blocks", min=1)
    ff_mult: int = opt(4, "feed-forward width as a multiple of d_model", min=1)
    dropout: float = opt(0.0, "dropout in attention and feed-forward", min=0.0, max=0.9)
    eval_fraction: float = opt(
        0.05, "the text's tail held out for eval (0: no eval)", min=0.0, max=0.5
    )
    sample_bytes: int = opt(80, "bytes of greedy sample written at each eval (0: none)", min=0)
    prompt: str = opt("", "what each sample starts from (empty: the held-out text's start)")

    def __post_init__(self) -> None:
        heads_divide(self.d_model, self.n_heads)

    def train_size(self, cwd: str | None = None) -> int:
        """The training sequences the ranks will cut (text_data.py), counted from the text's
        size in ``cwd``, the run's launch directory; KeyProblem for a text they cannot read."""
        return text_data.train_windows(self, self.seq_len + 1, cwd)


@dataclass
class MoEConfig:
    text_file: str = opt(
        "",
        "a UTF-8 text file to train on, as bytes (no tokenizer); empty: Python's own help "
        "topics (pydoc_data, shipped with CPython)",
    )
    seq_len: int = opt(64, "bytes of context per sequence", min=2)
    d_model: int = opt(128, "model width", min=8)
    n_heads: int = opt(4, "attention heads (must divide d_model)", min=1)
    n_layers: int = opt(2, "transformer blocks, each with a mixture-of-experts feed-forward", min=1)
    ff_mult: int = opt(2, "each expert's feed-forward width as a multiple of d_model", min=1)
    num_experts: int = opt(8, "experts in each block's feed-forward", min=2)
    top_k: int = opt(2, "experts each token is routed to (1: Switch; 2: GShard)", min=1)
    capacity_factor: float = opt(
        1.25,
        "tokens an expert takes per batch, as a multiple of an even share (tokens × top_k ÷ "
        "num_experts); a token routed past it skips that expert (0: no limit)",
        min=0.0,
    )
    aux_loss_coef: float = opt(
        0.01, "weight of the load-balancing loss (Switch Transformer's) added to the loss", min=0.0
    )
    expert_parallel: bool = opt(
        False,
        "spread the experts over the ranks (each holds num_experts ÷ ranks; tokens travel "
        "with all_to_all); false: every rank holds every expert, averaged by DDP",
    )
    dropout: float = opt(0.0, "dropout in attention and feed-forward", min=0.0, max=0.9)
    eval_fraction: float = opt(
        0.05, "the text's tail held out for eval (0: no eval)", min=0.0, max=0.5
    )

    def __post_init__(self) -> None:
        heads_divide(self.d_model, self.n_heads)
        routing_problems(self)

    def train_size(self, cwd: str | None = None) -> int:
        """As ``lm``'s (:meth:`LMConfig.train_size`): the same text, cut the same way."""
        return text_data.train_windows(self, self.seq_len + 1, cwd)

    def launch_problem(self, world: int, profile) -> tuple[str, str, object] | None:
        """What launch refuses once it knows the ranks: (key, why, value), or None."""
        return expert_launch_problem(self, world, profile)


def routing_problems(c: MoEConfig | MoEImageConfig) -> None:
    """The router's keys against each other (a ValueError the profile loader reports)."""
    if c.top_k > c.num_experts:
        raise ValueError(f"task.top_k: at most task.num_experts={c.num_experts} (got {c.top_k})")
    if 0 < c.capacity_factor < 1 / c.top_k:
        raise ValueError(
            f"task.capacity_factor: 0 (no limit) or at least 1/top_k = {1 / c.top_k:g} "
            f"(got {c.capacity_factor:g}): below it most tokens skip every expert"
        )


def expert_launch_problem(c, world: int, profile) -> tuple[str, str, object] | None:
    """What launch refuses for a mixture of experts once it knows the ranks: (key, why,
    value), or None (the ``moe`` and ``moe_mnist`` tasks)."""
    if not c.expert_parallel or world < 2:
        return None
    if c.num_experts % world:
        why = f"{c.num_experts} experts do not divide evenly over {world} ranks"
        return "task.num_experts", f"{why} (task.expert_parallel)", c.num_experts
    if profile.distributed.strategy == "fsdp":
        why = 'not with distributed.strategy = "fsdp": the experts are spread, the rest DDP'
        return "task.expert_parallel", why, True
    if profile.train.activation_checkpointing != "none":
        # Seen to hang on 2 CPU ranks (the recompute's exchanges, or the held-memory
        # measurement's forward: not diagnosed); refused until it is.
        why = "not with train.activation_checkpointing (a block's exchanges are collectives)"
        return "task.expert_parallel", why, True
    return None


DIGITS = 1797  # scikit-learn's 8×8 digits (load_digits): samples, 10 classes


@dataclass
class MoEImageConfig:
    data_dir: str = opt(
        "",
        "a directory holding MNIST's IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each may be .gz); empty: "
        'scikit-learn\'s 8×8 digits, offline (pip install "gpu-console[digits]")',
    )
    d_model: int = opt(64, "width of the features the experts work on", min=8)
    n_layers: int = opt(1, "mixture-of-experts layers (each: LayerNorm, experts, residual)", min=1)
    ff_mult: int = opt(2, "each expert's feed-forward width as a multiple of d_model", min=1)
    num_experts: int = opt(4, "experts in each layer", min=2)
    top_k: int = opt(2, "experts each sample is routed to (1: Switch; 2: GShard)", min=1)
    capacity_factor: float = opt(
        1.25,
        "samples an expert takes per batch, as a multiple of an even share (samples × top_k ÷ "
        "num_experts); a sample routed past it skips that expert (0: no limit)",
        min=0.0,
    )
    aux_loss_coef: float = opt(
        0.01, "weight of the load-balancing loss (Switch Transformer's) added to the loss", min=0.0
    )
    expert_parallel: bool = opt(
        False,
        "spread the experts over the ranks (each holds num_experts ÷ ranks; samples travel "
        "with all_to_all); false: every rank holds every expert, averaged by DDP",
    )
    eval_fraction: float = opt(
        0.2,
        "the digits held out for eval, chosen by a permutation seeded with data_seed "
        "(MNIST: its t10k files are the eval set)",
        gt=0.0,
        max=0.5,
    )
    data_seed: int = opt(1234, "seed of the digits' train/eval split (the same on every rank)")
    drop_warn_share: float = opt(
        0.2,
        "the share of assignments dropped past capacity above which, for drop_warn_logs "
        "consecutive log steps, the run logs a warning",
        min=0.0,
        max=1.0,
    )
    drop_warn_logs: int = opt(
        3,
        "consecutive log steps the dropped share must stay above drop_warn_share for the "
        "warning (0: never warn)",
        min=0,
    )

    def __post_init__(self) -> None:
        routing_problems(self)

    def train_size(self, cwd: str | None = None) -> int:
        """The training samples the ranks will read: the digits' split, or MNIST's train
        files read and checked here (torch-free); KeyProblem for data they cannot read."""
        if not self.data_dir:
            if not installed("sklearn"):
                why = 'empty: the 8×8 digits need scikit-learn (pip install "gpu-console[digits]")'
                raise KeyProblem("task.data_dir", why, self.data_dir)
            return DIGITS - digits_held_out(self.eval_fraction)
        from .idx import IdxError, read_mnist

        folder = text_data.text_path(self.data_dir, cwd)
        if not folder.is_dir():
            why = f"no such directory: {folder.absolute()}"
            raise KeyProblem("task.data_dir", why, self.data_dir)
        try:
            dims, _, _ = read_mnist(folder, "train")
            read_mnist(folder, "test")
        except IdxError as e:
            raise KeyProblem("task.data_dir", str(e), self.data_dir) from None
        return dims[0]

    def launch_problem(self, world: int, profile) -> tuple[str, str, object] | None:
        """As ``moe``'s (:func:`expert_launch_problem`)."""
        return expert_launch_problem(self, world, profile)


def digits_held_out(eval_fraction: float) -> int:
    """How many of the digits the eval holds (at least one)."""
    return max(1, round(eval_fraction * DIGITS))


# The paper's vehicle capacity per instance size (Kool et al. 2019, after Nazari et al. 2018).
CVRP_CAPACITY = {10: 20, 20: 30, 50: 40, 100: 50}


@dataclass
class CVRPConfig:
    num_customers: int = opt(20, "customers per instance (the depot is one more node)", min=2)
    capacity: int = opt(
        0, "vehicle capacity; demands are 1..9 (0: the paper's 20/30/40/50 for 10/20/50/100)", min=0
    )
    encoder: Literal["gat", "gt", "dgt"] = opt(
        "gat",
        "gat: graph attention (the paper's); gt: graph transformer with a distance bias; "
        "dgt: dynamic graph transformer, re-embedding the nodes at every decoding step",
    )
    embed_dim: int = opt(128, "node embedding width", min=8)
    n_heads: int = opt(8, "attention heads (must divide embed_dim)", min=1)
    n_layers: int = opt(3, "encoder layers", min=1)
    ff_dim: int = opt(512, "feed-forward width in the encoder", min=1)
    tanh_clip: float = opt(10.0, "the pointer logits are clipped to ±this by tanh", gt=0.0)
    epoch_instances: int = opt(
        25600,
        "training instances per epoch; the rollout baseline is tested at each epoch's end",
        min=1,
    )
    baseline_instances: int = opt(
        1024, "instances of the paired t-test that decides whether the baseline is replaced", min=2
    )
    baseline_alpha: float = opt(
        0.05,
        "one-sided p-value below which the current policy becomes the baseline",
        gt=0.0,
        max=1.0,
    )
    ema_beta: float = opt(
        0.8, "decay of the moving-average baseline used during the first epoch", min=0.0, max=1.0
    )
    eval_instances: int = opt(1024, "fixed held-out instances of the eval (0: no eval)", min=0)
    eval_sampled_tours: int = opt(
        16,
        "tours sampled per eval instance; the eval's `sampled` is the shortest of them and the "
        "greedy tour (0: no sampling; the paper samples 1280 at test time)",
        min=0,
    )
    end_sampled_tours: int = opt(
        0,
        "tours sampled per eval instance by the eval at train.max_steps, the schedule's end, "
        "as papers sample at test time (1280); 0: eval_sampled_tours, as every eval",
        min=0,
    )
    eval_tours_at_once: int = opt(
        32768,
        "at most this many sampled tours driven at once by the eval (instances × samples, "
        "in chunks of samples)",
        min=1,
    )
    eval_beam_width: int = opt(
        0,
        "beam search at each eval: the shortest of the this many likeliest tours (`beam`, "
        "and its gaps); 0: none",
        min=0,
    )
    eval_tours_drawn: int = opt(
        4,
        "eval instances whose greedy and Clarke-Wright tours each eval writes to "
        "task/tours/step-N/, which `gpu-console report` draws (0: none)",
        min=0,
    )
    pyvrp_seconds: float = opt(
        0.0,
        "PyVRP's time limit per eval instance: its tour lengths (`pyvrp`) and the gaps to "
        "them, cached on disk per instance set (0: none; needs gpu-console[cvrp])",
        min=0.0,
    )
    eval_file: str = opt(
        "",
        "evaluate on these instances instead of eval_instances random ones: a VRPLIB file "
        "(.vrp), a directory of them, or saved arrays (.npz, .pt: coords, demand, capacity); "
        "put in the unit square and out of task.capacity (docs/tasks.md)",
    )
    data_seed: int = opt(
        1234, "seed of every instance (a training batch's also by its step and first sample)"
    )

    def __post_init__(self) -> None:
        heads_divide(self.embed_dim, self.n_heads, "embed_dim")
        if not self.capacity and self.num_customers not in CVRP_CAPACITY:
            sizes = ", ".join(f"{n}→{c}" for n, c in CVRP_CAPACITY.items())
            raise ValueError(
                f"task.capacity: give one for num_customers={self.num_customers} "
                f"(the paper's: {sizes})"
            )
        if self.pyvrp_seconds and not installed("pyvrp"):
            raise ValueError(
                'task.pyvrp_seconds: needs the pyvrp package: pip install "gpu-console[cvrp]"'
            )
        if self.capacity and self.capacity < 9:
            raise ValueError(
                f"task.capacity: must hold the largest demand, 9 (got {self.capacity})"
            )

    def train_size(self, cwd: str | None = None) -> int:
        """An epoch's instances: the training set is their indices (cvrp.py). A
        ``task.eval_file`` is read here first, as the ranks will read it (cvrp_files.py), so
        a file they could not use is refused before launch (KeyProblem)."""
        if self.eval_file and self.eval_instances:
            from . import cvrp_files

            capacity = self.capacity or CVRP_CAPACITY[self.num_customers]
            cvrp_files.check(self.eval_file, float(capacity), cwd)
        return self.epoch_instances

    def launch_problem(self, world: int, profile) -> tuple[str, str, object] | None:
        """What launch refuses once it knows the run: (key, why, value), or None."""
        if profile.distributed.strategy == "fsdp":
            # Seen: replacing the baseline copies sharded parameters into a plain module.
            why = ("the cvrp task's rollout baseline is a whole copy of the policy, replaced "
                   "at an epoch's end: not with a sharded policy; use ddp")  # fmt: skip
            return "distributed.strategy", why, "fsdp"
        return None


def installed(package: str) -> bool:
    """Whether ``package`` can be imported, found without importing it (it may import torch)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: blocked (sys.modules[package] is None)
        return False


@dataclass
class HFConfig:
    model: str = opt(
        "", "a local directory holding a saved transformers model (from_pretrained, offline)"
    )
    config: dict = opt(
        {},
        "a transformers config as a table (model_type and its keys), built with from_config: "
        "new weights, no download; used when task.model is empty",
    )
    head: Literal["causal-lm", "sequence-classification"] = opt(
        "causal-lm",
        "causal-lm: predict each next token; sequence-classification: tell the text from "
        "the text with every token shifted by one",
    )
    text_file: str = opt(
        "",
        "a UTF-8 text file to train on, through the model's own tokenizer when its directory "
        "has one, else as bytes; empty: Python's own help topics (pydoc_data)",
    )
    seq_len: int = opt(
        64,
        "tokens per sequence (at most the model's n_positions or max_position_embeddings)",
        min=2,
    )
    eval_fraction: float = opt(
        0.05, "the text's tail held out for eval (0: no eval)", min=0.0, max=0.5
    )

    def __post_init__(self) -> None:
        if not installed("transformers"):
            raise ValueError(
                'task.kind: "hf" needs the transformers package: pip install "gpu-console[hf]"'
            )
        if not self.model and not self.config:
            raise ValueError("task.model: give a model directory or a task.config table")
        if not self.model and "model_type" not in self.config:
            raise ValueError(
                'task.config: needs model_type (e.g. "gpt2"), the architecture to build'
            )

    def train_size(self, cwd: str | None = None) -> int | None:
        """What the ranks would refuse once built, judged in ``cwd`` (the run's launch
        directory): the model directory and its ``config.json``, the sequence against the
        model's positions, the text file. The training sequences of a config table's model
        (the text as bytes, cut as ``lm`` cuts it); None with a model directory, whose
        tokenizer only the ranks can count with."""
        table, where = self.config, "task.config"
        if self.model:
            table, where = _saved_config(self.model, cwd), "task.model"
        for key in POSITION_KEYS:
            if key == "max_position_embeddings" and _rotary(table):
                continue  # rotary positions (Llama, Mistral, Qwen): a longer sequence runs
            limit = table.get(key)
            if isinstance(limit, int) and not isinstance(limit, bool) and self.seq_len > limit:
                why = f"above the model's {key} = {limit} ({where}), the longest it can read"
                raise KeyProblem("task.seq_len", why, self.seq_len)
        if self.model:
            if self.text_file:
                text_data.text_size(self.text_file, cwd)
            return None
        vocab = self.config.get("vocab_size")
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < BYTES:
            why = f"the text is read as bytes without a tokenizer: needs {BYTES} tokens"
            raise KeyProblem("task.config.vocab_size", why, vocab)
        length = self.seq_len + 1 if self.head == "causal-lm" else self.seq_len
        return text_data.train_windows(self, length, cwd)


# A transformers config's maximum positions, under the names model types give it: a hard
# limit where positions are a learned table (GPT-2's n_positions, BERT's
# max_position_embeddings), only a training length where they are rotary.
POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")


def _rotary(table: dict) -> bool:
    """Whether a config's positions are rotary (no table a longer sequence overruns)."""
    kind = table.get("position_embedding_type")
    return any(k in table for k in ("rope_theta", "rope_scaling", "rotary_dim")) or (
        isinstance(kind, str) and "rotary" in kind
    )


BYTES = 256  # the vocabulary of a text read as bytes


def _saved_config(model: str, cwd: str | None) -> dict:
    """``task.model``'s ``config.json`` as plain JSON (no transformers here), or KeyProblem."""
    folder = text_data.text_path(model, cwd)
    if not folder.is_dir():
        raise KeyProblem("task.model", f"no such directory: {folder.absolute()}", model)
    path = folder / "config.json"
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        why = f"no config.json in {folder.absolute()}: not a saved transformers model"
        raise KeyProblem("task.model", why, model) from None
    except (OSError, ValueError) as e:
        raise KeyProblem("task.model", f"cannot read {path.absolute()}: {e}", model) from None
    if not isinstance(table, dict):
        raise KeyProblem("task.model", f"{path.absolute()} is not a JSON object", model)
    return table
