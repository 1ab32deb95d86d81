"""MFU: the tasks' FLOP counts, the measurement, the peak table, and what a run reports (the
engine on 2 CPU ranks in the harness, tests/harness.py)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, events_of, fast_profile, read_events
from harness import run_engine

from gpu_console import runs
from gpu_console.commands.runs import run_rows
from gpu_console.engine import flops
from gpu_console.fold import RunFold
from gpu_console.peaks import Peak, UnknownPeak, matmul_precision, mfu, peak_for
from gpu_console.state import RunState
from gpu_console.summary import summary_lines
from gpu_console.tasks.base import batch_collate
from gpu_console.tasks.configs import MLPConfig, TransformerConfig
from gpu_console.tasks.mlp import MLPTask
from gpu_console.tasks.transformer import TransformerTask

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def _measured(task) -> float:
    model = task.build_model()
    train, _ = task.build_datasets()
    loader = torch.utils.data.DataLoader(train, batch_size=4, collate_fn=batch_collate)
    return flops.measure(task, model, flops.sample_batch(loader), contextlib.nullcontext())


def test_transformer_count_is_the_hand_count():
    # d=128, seq=64, 2 layers, ff=512, 4 classes. Forward FLOPs per token and layer:
    # qkv 2·128·384 + proj 2·128·128 = 131,072; ff 2·(128·512 + 512·128) = 262,144;
    # attention QKᵀ and AV 2·2·64·128 = 32,768. Two layers, 64 tokens: 54,525,952; the
    # head on the pooled vector 2·128·4 = 1,024. Training = 3 × forward.
    task = TransformerTask(TransformerConfig())
    assert task.flops_per_sample() == 3 * (2 * 64 * (131_072 + 262_144 + 32_768) + 1_024)


@pytest.mark.parametrize(
    "cfg",
    [
        TransformerConfig(train_samples=16, eval_samples=0),
        TransformerConfig(d_model=256, n_heads=8, seq_len=256, n_layers=1, ff_mult=2),
        TransformerConfig(d_model=64, n_heads=2, seq_len=512, n_layers=3, dropout=0.0),
    ],
    ids=["default", "wide", "long"],
)
def test_transformer_count_agrees_with_flop_counter_mode(cfg):
    task = TransformerTask(cfg)
    assert _measured(task) == pytest.approx(task.flops_per_sample(), rel=0.10)


@pytest.mark.parametrize(
    "cfg",
    [
        MLPConfig(),
        MLPConfig(num_layers=1),
        MLPConfig(input_dim=3, hidden_dim=17, num_layers=5, batch_norm=True, dropout=0.2),
    ],
    ids=["quickstart", "one-layer", "deep-bn"],
)
def test_mlp_count_agrees_with_flop_counter_mode(cfg):
    task = MLPTask(cfg)
    assert _measured(task) == pytest.approx(task.flops_per_sample(), rel=0.10)


def test_measuring_leaves_rng_buffers_gradients_and_data_untouched():
    task = MLPTask(MLPConfig(batch_norm=True, dropout=0.3, train_samples=256))
    model = task.build_model()
    train, _ = task.build_datasets()
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=8,
        collate_fn=batch_collate,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
    )
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    loader_rng = loader.generator.get_state()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert flops.measure(task, model, flops.sample_batch(loader), contextlib.nullcontext()) > 0
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew, in a forked stream
    assert torch.equal(loader.generator.get_state(), loader_rng)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(q.grad is None for q in model.parameters())


def test_measuring_gives_a_stateful_task_its_state_back():
    class Carrying(MLPTask):  # state changed by compute, like an RNN's carried hidden state
        seen = 0

        def compute(self, model, batch):
            self.seen += len(batch[0])
            return super().compute(model, batch)

        def state_dict(self):
            return {"seen": self.seen}

        def load_state_dict(self, state):
            self.seen = state["seen"]

    task = Carrying(MLPConfig(train_samples=64))
    task.seen = 5
    assert _measured(task) > 0
    assert task.seen == 5


def test_a_declared_count_wins_and_a_failed_measurement_says_why():
    class Declares:
        def flops_per_sample(self):
            return 123.0

    assert flops.per_sample(Declares(), lambda: 1 / 0) == (123.0, "task")
    value, why = flops.per_sample(object(), lambda: 1 / 0)
    assert value is None and "could not measure FLOPs: ZeroDivisionError" in why
    assert flops.per_sample(object(), lambda: 42.0) == (42.0, "measured")


@pytest.mark.parametrize(
    ("name", "gpu", "bf16_tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5),
        ("NVIDIA H200", "H200", 989.4),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
        ("NVIDIA A100-SXM4-40GB", "A100", 312.0),
        ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
        ("NVIDIA A100 80GB PCIe", "A100", 312.0),
        ("NVIDIA L40S", "L40S", 362.05),
        ("NVIDIA L4", "L4", 121.0),
        ("NVIDIA A10", "A10", 125.0),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
        ("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0),
    ],
)
def test_peak_of_real_device_names(name, gpu, bf16_tflops):
    peak = peak_for(name, "bf16")
    assert (peak.gpu, peak.flops) == (gpu, bf16_tflops * 1e12)
    assert peak_for(name, "fp16").flops == peak.flops
    # TF32 is half the bf16 rate; plain fp32 is below it (as fast on GeForce cards).
    tf32 = peak_for(name, "tf32").flops
    assert peak_for(name, "fp32").flops <= tf32 == pytest.approx(peak.flops / 2, rel=0.02)


def test_peaks_by_precision_for_the_h100_are_the_datasheets_dense_numbers():
    assert [peak_for("NVIDIA H100 80GB HBM3", p).flops / 1e12 for p in ("tf32", "fp32")] == [
        494.7,
        66.9,
    ]
    assert "dense" in peak_for("NVIDIA H100 80GB HBM3", "bf16").describe()


@pytest.mark.parametrize(
    "name", ["NVIDIA A10G", "NVIDIA L40", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090 D"]
)
def test_unknown_gpus_get_no_peak_and_say_so(name):
    with pytest.raises(UnknownPeak, match=rf"unknown GPU '{name}': MFU not shown"):
        peak_for(name, "bf16")


def test_fp32_matmuls_count_as_tf32_where_allowed_and_mfu_is_the_ratio():
    assert matmul_precision("fp32", True) == "tf32"
    assert matmul_precision("fp32", False) == "fp32"
    assert matmul_precision("bf16", True) == "bf16"
    assert mfu(1e9, 500.0, 2 * 1e12) == pytest.approx(0.25)
    assert mfu(None, 500.0, 1e12) is None and mfu(1e9, 500.0, None) is None


def test_the_peak_table_does_not_import_torch():
    code = "import sys, gpu_console.peaks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr


# A user task with no FLOPs hook: the MLP's model and data, so its measured FLOPs and its
# losses can be held against the built-in MLP's (which declares its count). It counts its
# training computes and writes the count at the end, per rank.
UNHOOKED_TASK = """
from gpu_console.tasks.mlp import MLPTask


class Unhooked(MLPTask):
    flops_per_sample = None  # no hook: the engine measures, where MFU is shown or asked
    computes = 0

    def compute(self, model, batch):
        if model.training:
            self.computes += 1
        return super().compute(model, batch)

    def on_train_end(self, model, ctx, reason):
        (ctx.task_dir / f"computes-{ctx.rank}.txt").write_text(str(self.computes))
"""


def _run(tmp_path, profile, name: str, *sets: str) -> Path:
    run = run_engine(tmp_path, profile, *sets, ranks=2, runs_dir=tmp_path / name)
    assert events_of(run, "status")[-1]["state"] == "finished"
    return run


def _summary(run: Path) -> str:
    """The headless console's end summary (off a terminal) of the run's events."""
    st = RunState()
    for e in read_events(run):
        st.apply(e)
    return "\n".join(summary_lines(st, run))


def _listed(run: Path) -> dict:
    """``ls --json``'s row of the run, its status.json folded from the run's events as the
    supervisor folds them (the harness has no supervisor)."""
    fold = RunFold()
    for e in read_events(run):
        fold.apply(e)
    runs.atomic_write_json(run / "status.json", {**fold.to_status(), "ended": time.time()})
    (row,) = run_rows([run])
    return row


def _regularised(tmp_path, name: str, kind: str):
    """The fast profile with BatchNorm (buffers) and dropout (RNG): what a careless
    measurement would disturb."""
    profile = fast_profile(tmp_path, name=name, max_steps=8, ranks=2)
    text = profile.read_text().replace(
        'kind = "mlp"', f'kind = "{kind}"\nbatch_norm = true\ndropout = 0.2'
    )
    profile.write_text(text)
    return profile


CPU_WHY = "CPU run (the peak table covers NVIDIA GPUs): MFU not shown"


def _computes(run) -> list[int]:
    return [int((run / "task" / f"computes-{r}.txt").read_text()) for r in (0, 1)]


def test_a_cpu_run_measures_no_flops_unless_asked_says_why_no_mfu_and_measuring_changes_nothing(
    tmp_path,
):
    (tmp_path / "unhooked.py").write_text(UNHOOKED_TASK)
    hooked = _regularised(tmp_path, "hooked", "mlp")
    unhooked = _regularised(tmp_path, "unhooked", "unhooked:Unhooked")
    run_hooked = _run(tmp_path, hooked, "hooked")
    run_auto = _run(tmp_path, unhooked, "auto")
    run_asked = _run(tmp_path, unhooked, "asked", "train.measure_flops=true")

    (start_h,) = events_of(run_hooked, "start")
    (start_a,) = events_of(run_auto, "start")
    (start_m,) = events_of(run_asked, "start")
    cfg = MLPConfig(hidden_dim=64, batch_norm=True, dropout=0.2)
    assert (start_h["flops_per_sample"], start_h["flops_from"]) == (
        MLPTask(cfg).flops_per_sample(),
        "task",
    )
    # CPU, auto: no MFU to show, so nothing measured: no compute before step 1 on any rank.
    assert (start_a["flops_per_sample"], start_a["flops_from"]) == (None, "not measured")
    assert _computes(run_auto) == [8, 8]
    # Asked: measured once, on rank 0, the same count as the MLP declares.
    assert start_m["flops_from"] == "measured"
    assert start_m["flops_per_sample"] == pytest.approx(start_h["flops_per_sample"], rel=1e-9)
    assert _computes(run_asked) == [9, 8]
    for start in (start_h, start_a, start_m):
        assert start["peak_flops"] is None
        assert start["mfu_not_shown"] == CPU_WHY
    # Measuring ran a forward and backward with dropout and BatchNorm on rank 0 before
    # training; the training that followed is bit for bit the one without it.
    steps = [events_of(r, "step") for r in (run_hooked, run_auto, run_asked)]
    assert [s["loss"] for s in steps[2]] == [s["loss"] for s in steps[1]]
    assert [s["loss"] for s in steps[1]] == [s["loss"] for s in steps[0]]
    assert all(len(s) == 8 and not any("mfu" in e for e in s) for s in steps)
    summary_row = r"^MFU: CPU run \(the peak table covers NVIDIA GPUs\): MFU not shown$"
    for run in (run_auto, run_asked):
        assert re.search(summary_row, _summary(run), re.M)
    for run in (run_hooked, run_auto, run_asked):
        row = _listed(run)
        assert (row["mfu"], row["mfu_not_shown"]) == (None, CPU_WHY)


@pytest.mark.parametrize(
    "asked, peak, measured, why",
    [
        ("auto", None, False, CPU_WHY),  # a CPU run: no MFU, so nothing measured
        (True, None, True, CPU_WHY),
        ("auto", "H100", True, None),  # a GPU in the table: measured, MFU shown
        (False, "H100", False, "FLOPs not measured (train.measure_flops = false): MFU not shown"),
    ],
)
def test_measure_flops_decides_whether_the_task_runs_once_more_before_training(
    monkeypatch, asked, peak, measured, why
):
    """Whether the measurement runs, by ``train.measure_flops`` and whether MFU can be shown
    (the GPU peak lookup stands in for a GPU this machine may not have)."""
    if peak is not None:
        known = Peak(peak, "fp32", 1e12, "test")
        monkeypatch.setattr(flops, "_peak", lambda device, precision: (known, None))

    class Counting(MLPTask):
        flops_per_sample = None
        computes = 0

        def compute(self, model, batch):
            self.computes += 1
            return super().compute(model, batch)

    task = Counting(MLPConfig(train_samples=64))
    model = task.build_model()
    train, _ = task.build_datasets()
    loader = torch.utils.data.DataLoader(train, batch_size=8, collate_fn=batch_collate)
    got = flops.setup(task, model, loader, "fp32", 2, contextlib.nullcontext(),
                      lambda b, d: b, True, asked)  # fmt: skip
    assert task.computes == (1 if measured else 0)
    assert (got.flops is not None, got.flops_from) == (
        (True, "measured") if measured else (False, "not measured")
    )
    assert got.why_not == why


def test_the_supervisor_keeps_the_newest_and_mean_mfu_in_status_json(tmp_path):
    """``ls --json`` reads status.json alone; the supervisor folds the step events' MFU there."""
    from gpu_console.supervisor import Supervisor

    (tmp_path / "logs").mkdir()
    (tmp_path / "run.toml").write_text("[distributed]\nshutdown_grace_s = 3.0\n")
    runs.atomic_write_json(tmp_path / "meta.json", {"id": tmp_path.name})
    with open(tmp_path / "events.jsonl", "w") as f:
        for e in _mfu_events():
            f.write(json.dumps({"v": 1, **e}) + "\n")
    sup = Supervisor(tmp_path)
    sup.fold_events()
    assert sup.status["mfu"] == 0.50
    assert sup.status["mfu_mean"] == pytest.approx(0.40)
    assert sup.status["mfu_not_shown"] is None


def _mfu_events(device: str = "cuda") -> list[dict]:
    start = {
        "kind": "start",
        "t": 1.0,
        "world_size": 1,
        "device_type": device,
        "precision": "bf16",
        "params": 10,
        "max_steps": 30,
        "flops_per_sample": 3e9,
        "flops_from": "task",
        "peak_flops": 989.4e12,
        "peak": "H100 SXM bf16 dense 989.4 TFLOP/s (NVIDIA H100 datasheet, SXM)",
        "mfu_not_shown": None,
    }
    steps = [
        {"kind": "step", "t": 1.0 + s, "step": s, "loss": 1.0, "samples_per_s": 1e5, "mfu": m}
        for s, m in ((10, 0.30), (20, 0.40), (30, 0.50))
    ]
    return [start, *steps]


def test_the_fold_the_progress_line_and_the_summary_show_mfu(tmp_path):
    from rich.console import Console

    from gpu_console.headless import _progress_text
    from gpu_console.state import RunState
    from gpu_console.summary import summary_table

    st = RunState()
    for e in _mfu_events():
        st.apply(e)
    assert st.mfu == 0.50 and st.mean_mfu() == pytest.approx(0.40)
    assert _progress_text(st).endswith("MFU 50.0%")
    console = Console(width=200, record=True)
    console.print(summary_table(st, tmp_path / "run"))
    assert re.search(r"│ MFU +│ 40\.0% \(mean\)", console.export_text())

    unknown = RunState()
    unknown.apply({"kind": "start", "mfu_not_shown": "unknown GPU 'NVIDIA X': MFU not shown"})
    unknown.apply({"kind": "step", "step": 1, "loss": 1.0, "samples_per_s": 5.0})
    assert unknown.mfu is None and "MFU" not in _progress_text(unknown)
    console = Console(width=200, record=True)
    console.print(summary_table(unknown, tmp_path / "run"))
    assert "unknown GPU 'NVIDIA X': MFU not shown" in console.export_text()


def test_the_run_header_shows_the_newest_mfu(tmp_path):
    import json

    import synthetic

    from gpu_console.tui.feed import RunFeed
    from gpu_console.tui.widgets.header import header_text

    run = synthetic.write_run(tmp_path / "run", steps=30, device_type="cuda", precision="bf16")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    for e in events:
        if e["kind"] == "start":
            e.update(flops_per_sample=3e9, peak_flops=989.4e12, mfu_not_shown=None)
        if e["kind"] == "step":
            e["mfu"] = 0.25 + e["step"] / 1000
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    feed = RunFeed(run, clock=lambda: synthetic.T0 + 60, telemetry=False)
    feed.load()
    assert "MFU 28.0%" in header_text(feed.snapshot()).plain
