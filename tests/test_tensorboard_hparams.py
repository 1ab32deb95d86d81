"""TensorBoard's HParams tab (issue 42, point 10): runs written by the supervisor's mirror
(results/tensorboard.py, results/hparams.py), then read by TensorBoard's own HParams backend,
the code behind the tab (its experiment and its session groups), over a log directory of
several runs as ``tensorboard --logdir runs/`` sees it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_console.results.tensorboard import TensorBoardMirror

pytestmark = pytest.mark.quick
pytest.importorskip("tensorboard", reason="the tensorboard package (the dev extra installs it)")

T0 = 1_800_000_000.0
PROFILE = """[profile]
name = "fast"

[task]
kind = "mlp"
hidden_dim = 64

[data]
batch_size = 32

[train]
lr = {lr}
betas = [0.9, 0.999]
precision = "auto"
"""


def _session(run: Path, lr: float, start: int, steps: list[int], evals: dict[int, float],
             t: float = T0) -> None:  # fmt: skip
    m = TensorBoardMirror(run, PROFILE.format(lr=lr))
    m.event({"kind": "start", "t": t, "start_step": start, "max_steps": 40, "task": "mlp",
             "world_size": 2, "precision": "fp32", "strategy": "ddp", "global_batch": 64,
             "device_type": "cpu", "params": 6922})  # fmt: skip
    for s in steps:
        m.event({"kind": "step", "t": t + s, "step": s, "loss": 9.0, "loss_avg": lr * 100 + 1 / s})
        if s in evals:
            m.event({"kind": "eval", "t": t + s, "step": s, "loss": evals[s], "accuracy": 0.5})
    m.close()


def _tab(logdir: Path):
    """What the HParams tab shows: (the experiment, {session: (hparams, metrics)})."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import (
        api_pb2,
        backend_context,
        get_experiment,
        list_session_groups,
    )

    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    backend = backend_context.Context(
        base_plugin.TBContext(logdir=str(logdir), data_provider=provider, multiplexer=mux)
    )
    ctx = context.RequestContext()
    experiment = get_experiment.Handler(
        ctx, backend, "", api_pb2.GetExperimentRequest(include_metrics=True)
    ).run()
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, include_metrics=True,
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS],
    )  # fmt: skip
    groups = list_session_groups.Handler(ctx, backend, "", request).run().session_groups
    sessions = {}
    for g in groups:
        values = {}
        for k, v in g.hparams.items():
            values[k] = getattr(v, v.WhichOneof("kind"))
        sessions[g.name] = (values, {m.name.tag: m.value for m in g.metric_values})
    return experiment, sessions


def test_the_hparams_tab_lists_each_run_with_its_lr_against_its_final_metrics(tmp_path):
    runs = tmp_path / "runs"
    _session(runs / "first", 0.003, 0, [10, 20], {20: 0.5})
    _session(runs / "second", 0.01, 0, [10, 20], {20: 0.25})
    experiment, sessions = _tab(runs)
    names = {h.name for h in experiment.hparam_infos}
    assert {"train.lr", "data.batch_size", "task.kind", "task.hidden_dim", "train.precision",
            "train.betas", "profile.name", "run.strategy", "run.precision", "run.world_size",
            "run.global_batch", "run.device_type", "run.params", "run.task"} <= names  # fmt: skip
    # The metrics are the final ones only, not every curve of the run.
    assert {m.name.tag for m in experiment.metric_infos} == {
        "final/train_loss", "final/eval/loss", "final/eval/accuracy"
    }  # fmt: skip
    assert set(sessions) == {"first/tensorboard/hparams", "second/tensorboard/hparams"}
    first, second = sessions["first/tensorboard/hparams"], sessions["second/tensorboard/hparams"]
    assert first[0]["train.lr"] == 0.003 and second[0]["train.lr"] == 0.01
    assert first[0]["run.strategy"] == "ddp" and first[0]["data.batch_size"] == 32
    assert first[0]["train.betas"] == "[0.9, 0.999]" and first[0]["task.kind"] == "mlp"
    assert first[1]["final/eval/loss"] == 0.5 and second[1]["final/eval/loss"] == 0.25
    assert first[1]["final/train_loss"] == pytest.approx(0.3 + 1 / 20)  # the interval mean


def test_a_resumed_run_shows_the_metrics_of_its_end_and_the_train_loss_of_its_last_step(
    tmp_path,
):
    run = tmp_path / "runs" / "resumed"
    _session(run, 0.003, 0, [10, 20, 30], {30: 0.9})  # killed after 30, checkpoint at 20
    _session(run, 0.003, 20, [30, 40, 45], {40: 0.4}, t=T0 + 100)  # no eval after 45
    _, sessions = _tab(tmp_path / "runs")
    (only,) = sessions.values()
    assert only[1]["final/eval/loss"] == pytest.approx(0.4)
    assert only[1]["final/train_loss"] == pytest.approx(0.3 + 1 / 45)  # written at the end


def test_hyperparameters_are_the_profiles_scalar_keys_flattened():
    from gpu_console.results import hparams

    text = PROFILE.format(lr=0.01) + '[logging]\nwandb = { project = "p" }\n'
    flat = hparams.flatten(text, {"strategy": "ddp", "world_size": 2, "flag": None})
    assert flat["train.lr"] == 0.01 and flat["logging.wandb.project"] == "p"
    assert flat["run.strategy"] == "ddp" and flat["run.world_size"] == 2.0
    assert not any(k.startswith("run.flag") for k in flat)
    assert hparams.flatten("[train\n", {}) == {}  # a damaged run.toml: no keys, no failure
