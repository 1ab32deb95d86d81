"""The built-in ``moe_mnist`` (issue 40): a mixture-of-experts image classifier on MNIST's IDX
files or, offline, scikit-learn's 8×8 digits. The IDX reader against files written here;
training through the harness (tests/harness.py) to above-chance accuracy with the expert
usage recorded (per expert, per class, dropped); the dropped-share warning on a tiny
capacity and not on the default; expert parallelism equal to the replicated run until a
routing decision flips; ``report``'s figures for the task; and the launch's one-line
refusal of a bad data directory."""

from __future__ import annotations

import gzip
import math
import struct

import pytest
import torch
from conftest import events_of, run_dirs
from harness import preload, run_engine

from gpu_console.profile import load_profile
from gpu_console.schema import KeyProblem
from gpu_console.tasks import configs, idx
from gpu_console.tasks.configs import installed

# The digits need scikit-learn (the digits extra; the dev extra has it); the IDX files do not.
digits = pytest.mark.skipif(not installed("sklearn"), reason="scikit-learn (the digits extra)")


def preloaded() -> None:
    """The task's modules, and scikit-learn's digits (some 2 CPU-s of imports in every
    rank), imported once by the harness's zygote: the 2-rank runs' ranks fork past them."""
    preload("gpu_console.tasks.moe_mnist", *(["sklearn.datasets"] if installed("sklearn") else []))


# -- the IDX reader ------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_idx_files_round_trip_and_read_as_the_format_says(tmp_path, gz):
    data = bytes(i % 251 for i in range(2 * 7 * 57))
    path = tmp_path / ("x-idx3-ubyte" + (".gz" if gz else ""))
    idx.write_idx(path, (2, 7, 57), data)
    assert idx.read_idx(path) == ((2, 7, 57), data)
    # The bytes as the format lays them out, written without our writer.
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    assert raw[:4] == b"\x00\x00\x08\x03"
    assert struct.unpack(">3I", raw[4:16]) == (2, 7, 57) and raw[16:] == data


def test_a_damaged_idx_file_is_one_line_saying_what(tmp_path):
    path = tmp_path / "labels"
    idx.write_idx(path, (10,), bytes(10))
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    with pytest.raises(idx.IdxError, match=r"7 bytes of values for dims 10 \(10 expected\)"):
        idx.read_idx(path)
    path.write_bytes(b"\x00\x00\x0d\x01" + struct.pack(">I", 1) + bytes(4))  # floats
    with pytest.raises(idx.IdxError, match="values of type 0x0d"):
        idx.read_idx(path)
    path.write_bytes(b"GIF89a....")
    with pytest.raises(idx.IdxError, match="not an IDX file"):
        idx.read_idx(path)


def write_mnist(folder, train: int = 64, test: int = 32, gz: bool = True) -> None:
    """A small MNIST in its four files: each class's images a bright band at its own rows."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        images_stem, labels_stem = idx.MNIST_FILES[split]
        labels = bytes(i % 10 for i in range(n))
        images = bytearray(n * 28 * 28)
        for i, label in enumerate(labels):
            start = i * 784 + label * 2 * 28
            images[start : start + 56] = b"\xff" * 56
        ext = ".gz" if gz else ""
        idx.write_idx(folder / (images_stem + ext), (n, 28, 28), bytes(images))
        idx.write_idx(folder / (labels_stem + ext), (n,), labels)


def test_mnist_files_train_the_task(tmp_path):
    write_mnist(tmp_path / "mnist")
    run = run_engine(tmp_path, "moe_mnist", f"task.data_dir={tmp_path / 'mnist'}",
                     "data.batch_size=16",
                     "train.max_steps=40", "train.log_every=10", "train.eval_every=40",
                     "train.warmup_steps=2", "checkpoint.every_steps=0")  # fmt: skip
    (start,) = events_of(run, "start")
    assert start["task"] == "moe_mnist"
    (ev,) = events_of(run, "eval")
    assert ev["accuracy"] > 0.5  # ten bands, one per class: easy once it learns


# -- training on the digits ----------------------------------------------------------------

QUICK = ("data.batch_size=32", "train.max_steps=60", "train.log_every=5",
         "train.eval_every=30", "train.warmup_steps=5", "checkpoint.every_steps=0")  # fmt: skip


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("digits")
    preloaded()
    return run_engine(tmp, "moe_mnist", *QUICK, ranks=2)


@digits
def test_it_learns_the_digits_and_records_each_experts_usage(digits_run):
    run = digits_run
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [30, 60]
    last = evals[-1]
    assert last["accuracy"] > 0.5, last["accuracy"]  # chance: 0.1
    assert last["loss"] < math.log(10) - 0.5
    shares = [last[f"expert_load/{e}"] for e in range(4)]
    assert math.isclose(sum(shares), 1, abs_tol=1e-5)
    assert 0 <= last["dropped"] < 1
    for c in range(10):  # each class's assignments over the experts
        row = [last[f"expert_class/{c}/{e}"] for e in range(4)]
        assert math.isclose(sum(row), 1, abs_tol=1e-5) and all(0 <= v <= 1 for v in row)
    # Experts specialise: the classes' rows differ (not every class routed alike).
    rows = torch.tensor([[last[f"expert_class/{c}/{e}"] for e in range(4)] for c in range(10)])
    assert float((rows - rows.mean(0)).abs().max()) > 0.05
    for s in events_of(run, "step"):
        m = s["metrics"]
        assert math.isclose(sum(m[f"expert_load/{e}"] for e in range(4)), 1, abs_tol=1e-5)
        assert {"accuracy", "ce", "aux_loss", "dropped"} <= set(m)
    assert not [e for e in events_of(run, "log") if e.get("level") == "warning"]


@digits
def test_the_digits_split_is_fixed_by_its_seed_and_disjoint():
    from gpu_console.tasks.moe_mnist import load_digits_split

    cfg = load_profile("moe_mnist", []).task
    (xa, ya), (xe, ye) = load_digits_split(cfg)
    (xa2, _), (xe2, _) = load_digits_split(cfg)
    assert torch.equal(xa, xa2) and torch.equal(xe, xe2)
    assert (len(xa), len(xe)) == (1797 - 359, 359)
    assert cfg.train_size() == len(xa)
    train_rows = {tuple(r.tolist()) for r in xa}
    # Disjoint by index; the digits hold a few duplicate images, so by content nearly so.
    assert sum(tuple(r.tolist()) in train_rows for r in xe) < 10


def test_without_scikit_learn_the_digits_are_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(configs, "installed", lambda package: package != "sklearn")
    cfg = load_profile("moe_mnist", []).task
    with pytest.raises(KeyProblem, match=r'task.data_dir: empty: the 8×8 digits need '
                       r'scikit-learn \(pip install "gpu-console\[digits\]"\)'):  # fmt: skip
        cfg.train_size()


# -- the dropped-share warning -------------------------------------------------------------

TINY_CAPACITY = """
[profile]
name = "moe_mnist-tiny-capacity"
[task]
kind = "moe_mnist"
capacity_factor = 0.5   # top-2: room for half the assignments at best
[data]
batch_size = 32
[train]
max_steps = 12
log_every = 2
eval_every = 0
warmup_steps = 2
[checkpoint]
every_steps = 0
"""


def warnings_of(run) -> list[dict]:
    return [e for e in events_of(run, "log") if e.get("level") == "warning"]


@digits
def test_a_capacity_too_small_warns_once_the_dropped_share_stays_high(tmp_path):
    run = run_engine(tmp_path, TINY_CAPACITY, name="tiny")
    steps = events_of(run, "step")
    assert all(s["metrics"]["dropped"] >= 0.5 - 1e-6 for s in steps)  # above 0.2 throughout
    (warning,) = warnings_of(run)  # once per streak, not at every log step after it
    assert "above task.drop_warn_share = 0.2 for 3 consecutive log steps" in warning["message"]
    assert "at step 6:" in warning["message"]  # the third log step (every 2)
    # A longer streak asked for: not reached in 6 log steps.
    quiet = run_engine(tmp_path, TINY_CAPACITY, "task.drop_warn_logs=7", name="quiet",
                       runs_dir=tmp_path / "quiet")  # fmt: skip
    assert not warnings_of(quiet)


# -- expert parallelism against the replicated run -------------------------------------------

PARITY = ("data.batch_size=32", "train.max_steps=30", "train.log_every=1",
          "train.eval_every=30", "train.warmup_steps=2", "checkpoint.every_steps=0")  # fmt: skip
# Equal until a routing decision flips (docs/performance.md): measured, this run kept the
# losses equal to 1.2e-7 over 200 steps; the promise held here is the first K steps.
K = 10


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    preloaded()
    rep = run_engine(tmp, "moe_mnist", *PARITY, ranks=2, runs_dir=tmp / "rep")
    ep = run_engine(tmp, "moe_mnist", *PARITY, "task.expert_parallel=true", ranks=2,
                    runs_dir=tmp / "ep")  # fmt: skip
    return rep, ep


@digits
def test_expert_parallel_equals_the_replicated_run_until_a_routing_decision_flips(parity_runs):
    rep, ep = parity_runs
    assert events_of(ep, "start")[0]["strategy"] == "expert"
    assert events_of(rep, "start")[0]["strategy"] == "ddp"
    a, b = events_of(rep, "step"), events_of(ep, "step")
    assert [s["step"] for s in a] == [s["step"] for s in b] == list(range(1, 31))
    for x, y in zip(a[:K], b[:K], strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
        for e in range(4):  # the same routing: each expert's share of the assignments
            name = f"expert_load/{e}"
            assert x["metrics"][name] == pytest.approx(y["metrics"][name], abs=1e-6)
    # After that the runs are statistically equivalent, not equal: both learn alike.
    (ea,), (eb,) = events_of(rep, "eval"), events_of(ep, "eval")
    assert ea["accuracy"] > 0.5 and eb["accuracy"] > 0.5
    assert abs(ea["accuracy"] - eb["accuracy"]) < 0.1


# -- the report ----------------------------------------------------------------------------


def _pngs_are_real(paths) -> None:
    for p in paths:
        head = p.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n", p
        width, height = struct.unpack(">II", head[16:24])
        assert width > 300 and height > 200, (p, width, height)


@digits
def test_report_draws_the_tasks_figures_and_a_summary_matching_the_events(digits_run,
                                                                          parity_runs):  # fmt: skip
    pytest.importorskip("matplotlib")
    from gpu_console.results import report

    run = digits_run
    data = report.load(run, run.parent)
    out = run / "report"
    index, written = report.write([data], out)
    names = {p.name for p in written}
    figures = ["training_metrics.png", "expert_activations.png", "expert_device_distribution.png"]
    assert set(figures) | {"performance_summary.txt"} <= names
    _pngs_are_real([out / f for f in figures])
    text = (out / "performance_summary.txt").read_text()
    rows = dict(line.split(": ", 1) for line in text.splitlines())
    last = events_of(run, "eval")[-1]
    assert rows["final accuracy"] == f"{last['accuracy']:.4f} (eval at step {last['step']})"
    assert rows["final eval loss"] == f"{last['loss']:.4f}"
    rates = [s["samples_per_s"] for s in events_of(run, "step")]
    assert rows["samples/s"] == f"{sum(rates) / len(rates):.1f} (mean of {len(rates)} log steps)"
    assert rows["compile"] == "off"
    assert rows["experts"] == "4 per layer x 1 layer(s), top-2, capacity factor 1.25"
    assert rows["placement"] == "replicated: each of 2 rank(s) (cpu) holds every expert"
    # The eval grid leaves the per-class figures to expert_activations.png.
    import matplotlib.pyplot as plt

    from gpu_console.results.plots import figures

    made = figures(plt, [data])
    try:
        (grid,) = [fig for name, _, fig in made if name == "eval"]
        titles = {ax.get_title() for ax in grid.axes if ax.get_visible()}
        assert "eval accuracy" in titles and not any("/" in t and "load" not in t
                                                    for t in titles), titles  # fmt: skip
        (acts,) = [fig for name, _, fig in made if name == "expert_activations"]
        assert len([ax for ax in acts.axes if ax.get_visible()]) == 10  # a panel per class
    finally:
        for _, _, fig in made:
            plt.close(fig)
    epoch = float(rows["time per epoch"].split(" s ")[0])
    steps = events_of(run, "step")
    assert 0 < epoch < steps[-1]["t"] - steps[0]["t"]
    # Under expert parallelism the summary names each rank's experts.
    _, ep = parity_runs
    report.write([report.load(ep, ep.parent)], ep / "report")
    ep_rows = dict(
        line.split(": ", 1) for line in (ep / "report" / "performance_summary.txt").read_text()
        .splitlines()
    )  # fmt: skip
    assert ep_rows["placement"] == (
        "expert parallel over 2 ranks: rank 0 (cpu): experts 0-1; rank 1 (cpu): experts 2-3"
    )


# -- bad input -------------------------------------------------------------------------------


def test_a_bad_data_directory_is_refused_in_one_line_before_anything_is_written(
    procs, tmp_path, runs_dir
):
    profile = tmp_path / "mnist.toml"
    profile.write_text('[task]\nkind = "moe_mnist"\ndata_dir = "no-such-dir"\n')
    result = procs.cli("run", str(profile), "--headless", "--devices", "cpu:2",
                       "--runs-dir", str(runs_dir), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(profile) in lines[0], result.stderr
    assert "task.data_dir: no such directory" in lines[0]
    # A file cut short: named, with what is wrong.
    write_mnist(tmp_path / "mnist")
    labels = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(gzip.decompress(labels.read_bytes())[:-5]))
    profile.write_text('[task]\nkind = "moe_mnist"\ndata_dir = "mnist"\n')
    result = procs.cli("run", str(profile), "--headless", "--devices", "cpu:2",
                       "--runs-dir", str(runs_dir), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "task.data_dir:" in lines[0], result.stderr
    assert "t10k-labels-idx1-ubyte.gz: 27 bytes of values for dims 32" in lines[0]
    assert not run_dirs(runs_dir)
