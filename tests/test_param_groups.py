"""Which parameters decay: the built-in models' groups, ``all``, and a task's own groups
reaching the optimizer of a run (its start event and its checkpoint; the engine in the
harness, tests/harness.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import events_of, fast_profile, task_profile
from harness import run_engine
from torch import nn

from gpu_console.engine import checkpoint
from gpu_console.engine import optim_build as optim
from gpu_console.profile import TrainConfig
from gpu_console.tasks.configs import MLPConfig, TransformerConfig
from gpu_console.tasks.mlp import MLPTask
from gpu_console.tasks.transformer import TransformerTask

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def decayed_names(model: nn.Module, which: str = "matrices") -> tuple[set[str], set[str]]:
    groups = optim.default_groups(model, 0.1, which)
    names = {id(q): n for n, q in model.named_parameters()}
    decayed = {names[id(q)] for g in groups if g["weight_decay"] > 0 for q in g["params"]}
    return decayed, set(names.values()) - decayed


def test_transformer_decays_its_matmul_weights_only():
    model = TransformerTask(TransformerConfig(n_layers=2)).build_model()
    decayed, kept = decayed_names(model)
    matmuls = {"qkv.weight", "proj.weight", "ff.0.weight", "ff.2.weight"}
    assert decayed == {f"blocks.{i}.{m}" for i in range(2) for m in matmuls} | {"head.weight"}
    # The token embedding and the positional table (2-D, but lookups), norms, every bias.
    assert {"tok.weight", "pos", "ln.weight", "ln.bias", "head.bias"} <= kept
    assert {"blocks.0.ln1.weight", "blocks.1.ln2.bias", "blocks.0.qkv.bias"} <= kept


def test_mlp_with_batchnorm_decays_its_linear_weights_only():
    model = MLPTask(MLPConfig(num_layers=3, batch_norm=True)).build_model()
    decayed, kept = decayed_names(model)
    assert decayed == {"0.weight", "3.weight", "6.weight"}  # Linear, BatchNorm, GELU, Linear...
    assert kept == {"0.bias", "1.weight", "1.bias", "3.bias", "4.weight", "4.bias", "6.bias"}


def test_norms_and_embeddings_of_any_shape_are_kept_and_no_weight_decay_is_relative():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.zeros(4, 4))
            self.w = nn.Parameter(torch.zeros(4, 4))

        def no_weight_decay(self):
            return {"table"}

    model = nn.ModuleDict(
        {
            "norm": nn.LayerNorm((3, 4)),  # a 2-D norm weight
            "bag": nn.EmbeddingBag(10, 4),
            "inner": Inner(),
            "conv": nn.Conv1d(2, 2, 3),
        }
    )
    decayed, kept = decayed_names(model)
    assert decayed == {"inner.w", "conv.weight"}
    assert kept == {"norm.weight", "norm.bias", "bag.weight", "inner.table", "conv.bias"}


def test_all_decays_everything_in_one_group_and_frozen_parameters_stay_out():
    model = TransformerTask(TransformerConfig(n_layers=1)).build_model()
    model.head.weight.requires_grad_(False)
    (group,) = optim.default_groups(model, 0.1, "all")
    assert group["weight_decay"] == 0.1
    assert len(group["params"]) == len(list(model.parameters())) - 1
    decayed, _ = decayed_names(model, "matrices")
    assert "head.weight" not in decayed


def test_a_task_leaving_a_trainable_parameter_out_is_told_which():
    class Partial(MLPTask):
        def param_groups(self, model):
            return [{"params": [model[0].weight]}]

    task = Partial(MLPConfig())
    with pytest.raises(optim.ParamGroupError, match=r"5 trainable parameters .*'0\.bias'"):
        optim.groups(task, task.build_model(), TrainConfig(), lambda lr: lr)


def test_the_split_counts_tensors_and_elements():
    model = MLPTask(MLPConfig(input_dim=32, hidden_dim=64, num_classes=10)).build_model()
    groups, split = optim.groups(MLPTask(MLPConfig()), model, TrainConfig(), lambda lr: lr)
    assert split.fields() == {
        "source": "matrices",
        "decayed": {"tensors": 3, "params": 32 * 64 + 64 * 64 + 64 * 10},
        "not_decayed": {"tensors": 3, "params": 64 + 64 + 10},
    }
    assert optim.build(groups, 1e-3, 0.01, "auto", "cpu").defaults["fused"]


# The head learns at 10× the rest with no decay; the hidden layers decay at 0.5.
OWN_GROUPS = """
from gpu_console.tasks.mlp import MLPTask


class OwnGroups(MLPTask):
    def param_groups(self, model):
        head = list(model[-1].parameters())
        rest = [q for q in model.parameters() if all(q is not h for h in head)]
        return [
            {"params": rest, "weight_decay": 0.5},
            {"params": head, "lr": 3e-2, "weight_decay": 0.0},
        ]
"""


def _read(run):
    start = events_of(run, "start")[0]
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    return start, checkpoint.load(run / "checkpoints" / latest)["optimizer"]["param_groups"]


def _run(tmp_path, profile, name: str, *sets: str):
    return _read(run_engine(tmp_path, profile, *sets, runs_dir=tmp_path / name))


def test_a_tasks_own_groups_reach_the_optimizer(tmp_path):
    profile = task_profile(tmp_path, "own_groups", OWN_GROUPS, "OwnGroups", max_steps=3)
    start, groups = _run(tmp_path, profile, "runs")
    assert start["weight_decay"] == {
        "source": "task",
        "decayed": {"tensors": 4, "params": 32 * 64 + 64 + 64 * 64 + 64},
        "not_decayed": {"tensors": 2, "params": 64 * 10 + 10},
    }
    assert start["optimizer"] == "AdamW (fused)"
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    # The schedule's base is each group's own lr (distributed.lr_scaling is none by default).
    assert [g["initial_lr"] for g in groups] == [3e-3, 3e-2]
    assert [len(g["params"]) for g in groups] == [4, 2]
    assert all(g["fused"] for g in groups)


def test_default_groups_and_all_in_a_real_run(tmp_path):
    profile = fast_profile(tmp_path, max_steps=2)
    start, groups = _run(tmp_path, profile, "default")  # the fast profile's defaults
    assert start["weight_decay"]["source"] == "matrices"
    assert start["weight_decay"]["decayed"] == {"tensors": 3, "params": 6784}
    assert start["weight_decay"]["not_decayed"] == {"tensors": 3, "params": 138}
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(0.01, 3), (0.0, 3)]
    assert start["optimizer"] == "AdamW (fused)" and all(g["fused"] for g in groups)

    everything = ("train.weight_decay_params=all", "train.weight_decay=0.2")
    start, groups = _run(tmp_path, profile, "all", *everything)
    assert start["weight_decay"] == {
        "source": "all",
        "decayed": {"tensors": 6, "params": 6784 + 138},
        "not_decayed": {"tensors": 0, "params": 0},
    }
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(0.2, 6)]


def test_a_checkpoint_with_other_groups_is_refused_with_the_way_to_resume_it():
    model = MLPTask(MLPConfig()).build_model()
    old = optim.build(model.parameters(), 1e-3, 0.01, "auto", "cpu")  # one group, as before
    groups, _ = optim.groups(MLPTask(MLPConfig()), model, TrainConfig(), lambda lr: lr)
    new = optim.build(groups, 1e-3, 0.01, "auto", "cpu")
    with pytest.raises(optim.ParamGroupError, match=r"\[6\] tensors, this run's \[3, 3\]"):
        optim.load_state(new, old.state_dict())
    again = optim.build(optim.default_groups(model, 0.01, "all"), 1e-3, 0.01, "auto", "cpu")
    optim.load_state(again, old.state_dict())
    assert again.param_groups[0]["weight_decay"] == 0.01


def test_a_tasks_groups_are_clipped_in_the_models_order_to_the_scripts_bits():
    """decay/no-decay groups list the parameters out of the model's order; the engine clips
    in the model's order, so its total norm is clip_grad_norm_(model.parameters())'s, bit
    for bit (summed in another order, it differs in the last bits)."""
    from gpu_console.engine.optim_set import Optimizers

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(40, 40) for _ in range(6)))
    decay = [q for q in model.parameters() if q.dim() > 1]
    no_decay = [q for q in model.parameters() if q.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    opts = Optimizers.from_task(opt, model)
    assert opts.entries[0].params == list(model.parameters())
    grads = [torch.randn_like(q) * (10.0 ** (i % 5 - 2)) for i, q in enumerate(model.parameters())]

    def with_grads():
        for q, g in zip(model.parameters(), grads, strict=True):
            q.grad = g.clone()

    with_grads()
    script = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with_grads()
    engine, _ = opts.clip(0.1)
    assert torch.equal(engine, script)
