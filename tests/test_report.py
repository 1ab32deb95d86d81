"""``gpu-console report``: PNG plots and one HTML page of a run, or of several overlaid.

Real runs through torchrun with the two fake GPUs of the NVML seam (so the GPU plots have
something to draw), then the command as a user types it; the page is parsed and its
pictures decoded."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import Procs, events_of, fake_gpus_env, paced_profile, run_dirs, without_packages

from gpu_console.format import fmt
from gpu_console.results.report import Series
from gpu_console.runs import relative_text

plt = pytest.importorskip("matplotlib.pyplot", reason="the report extra (the dev extra has it)")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    runs = tmp / "runs"
    procs = Procs(runs)
    try:
        for name, lr in (("first", "3e-3"), ("second", "1e-2")):
            profile = paced_profile(tmp, name=name, max_steps=60,
                                    extra="[checkpoint]\nevery_steps = 20\n")  # fmt: skip
            done = procs.cli(
                "run", str(profile), "--headless", "--runs-dir", str(runs), "--set",
                f"train.lr={lr}", cwd=tmp, env=fake_gpus_env(PACE_S="0.05"),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
        yield procs, runs, {r.name.split("-")[0]: r for r in run_dirs(runs)}, tmp
    finally:
        procs.cleanup()


def _page(index: Path) -> tuple[str, list[bytes]]:
    text = index.read_text()
    pngs = [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', text)]
    return text, pngs


def _image(data: bytes, tmp_path: Path, name: str):
    path = tmp_path / name
    path.write_bytes(data)
    return plt.imread(path)


def test_a_runs_report_has_its_plots_and_page(two_runs, tmp_path):
    procs, runs, made, _ = two_runs
    run = made["first"]
    done = procs.cli("report", run.name, "--runs-dir", str(runs))
    assert done.returncode == 0, done.stderr
    out = run / "report"
    names = {p.name for p in out.iterdir()}
    assert names == {"index.html", "loss.png", "eval.png", "train_metrics.png", "throughput.png",
                     "lr.png", "gpus.png"}  # fmt: skip
    assert done.stdout.splitlines()[0] == f"report: {out / 'index.html'}"
    text, pngs = _page(out / "index.html")
    assert len(pngs) == 6  # every plot inline: the page is one file
    for i, data in enumerate(pngs):
        image = _image(data, tmp_path, f"{i}.png")
        assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0.01  # drawn
    status = json.loads(procs.cli("status", run.name, "--json", "--runs-dir", str(runs)).stdout)
    cells = html.unescape(text)
    assert f"<td>{fmt(status['loss'])}</td>" in cells  # the summary status prints
    assert "<td>60/60</td>" in cells
    for c in events_of(run, "checkpoint"):  # every checkpoint, with its step
        assert f'<td class="what">{c["step"]}</td>' in cells
        assert relative_text(run, Path(c["path"])) in cells  # as the run names its files
    assert "[train]" in cells and "lr = 0.003" in cells  # the resolved profile
    assert '<td class="what">launch</td>' in cells  # its one session


def test_two_runs_are_overlaid_and_their_profiles_compared(two_runs):
    procs, runs, made, tmp = two_runs
    out = tmp / "both"
    done = procs.cli("report", made["first"].name, made["second"].name, "--out", str(out),
                     "--runs-dir", str(runs), cwd=tmp)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text, pngs = _page(out / "index.html")
    cells = html.unescape(text)
    assert len(pngs) == 6
    assert f"report: {made['first'].name} vs {made['second'].name}" in cells
    diff = cells[cells.index("Profile: what differs") :]
    assert '<td class="what">train.lr</td><td>0.003</td><td>0.01</td>' in diff
    # The summary has a column per run.
    assert f"<th>{made['first'].name}</th><th>{made['second'].name}</th>" in cells


def test_a_resumed_sessions_curve_replaces_what_the_killed_one_logged_past_its_checkpoint():
    s = Series()
    s.apply({"kind": "start", "t": 1.0, "start_step": 0})
    for step in range(1, 8):
        s.apply({"kind": "step", "t": 1.0 + step, "step": step, "loss": 1.0})
    s.apply({"kind": "eval", "t": 9.0, "step": 6, "loss": 0.9})
    s.apply({"kind": "start", "t": 20.0, "start_step": 5, "resumed_from": "step-5"})
    for step in range(6, 9):
        s.apply({"kind": "step", "t": 20.0 + step, "step": step, "loss": 0.5})
    assert [(e["step"], e["loss"]) for e in s.steps] == [
        (1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 0.5), (7, 0.5), (8, 0.5)
    ]  # fmt: skip
    assert s.evals == [] and len(s.sessions) == 2
    assert s.step == 8  # THE fold underneath


def test_without_matplotlib_the_report_says_so_in_one_line(two_runs, tmp_path):
    procs, runs, made, _ = two_runs
    env = without_packages(tmp_path, "matplotlib")
    out = tmp_path / "nothing"
    done = procs.cli("report", made["first"].name, "--out", str(out), "--runs-dir", str(runs),
                     env=env)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "gpu-console: report: needs matplotlib (pip install 'gpu-console[report]')\n"
    )
    assert not out.exists()  # nothing written


def test_a_missing_run_is_one_line_exit_2(two_runs):
    procs, runs, _, _ = two_runs
    done = procs.cli("report", "nope", "--runs-dir", str(runs))
    assert done.returncode == 2 and done.stderr.count("\n") == 1


def test_a_run_whose_run_toml_is_damaged_is_reported_with_no_comparison(two_runs, tmp_path):
    # The damaged run.toml is said where the comparison would be; the rest of the page stands.
    procs, runs, made, _ = two_runs
    damaged = tmp_path / "runs" / made["second"].name
    shutil.copytree(made["second"], damaged, ignore=shutil.ignore_patterns("report"))
    (damaged / "run.toml").write_text("[train\nlr = ")
    out = tmp_path / "page"
    done = procs.cli("report", made["first"].name, str(damaged), "--out", str(out),
                     "--runs-dir", str(runs))  # fmt: skip
    assert done.returncode == 0, done.stderr
    text, pngs = _page(out / "index.html")
    cells = html.unescape(text)
    assert f"{damaged.name}: no comparison: {damaged / 'run.toml'}: not valid TOML" in cells
    assert "<td>60/60</td>" in cells and len(pngs) == 6
