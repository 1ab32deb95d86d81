"""The three complete examples under examples/: each imports only the documented task API,
and each, trained on 2 CPU ranks (the harness, tests/harness.py), stopped half-way and resumed, goes
on exactly as an uninterrupted run (the same losses, lrs and metrics at every step, bit for
bit: the same fp32 kernels on the same data in the same order, with every optimizer,
schedule, RNG stream and task state restored), its optimizers' and schedules' states in the
end checkpoint equal to the uninterrupted run's."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, events_of
from harness import run_engine
from headless_text import headless_text

from gpu_console.engine import checkpoint
from gpu_console.profile import load_profile

EXAMPLES = ("char_lstm", "gan", "gpt_char")
PUBLIC = {"gpu_console.tasks.base"}  # the documented task API


def ours(module: str) -> bool:
    return module.split(".")[0] == "gpu_console"


def gpu_console_imports(source: str) -> set[str]:
    """Every gpu_console module a source imports (``import`` and ``from … import``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "gpu_console")
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gpu_console"
        ):
            found.add(node.module)
            # `from gpu_console import engine`, `from gpu_console.tasks import loader`
            if node.module != "gpu_console.tasks.base":
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_gpu_console_imports_are_found():
    src = "import gpu_console.engine.loop\nfrom gpu_console import engine\nimport torch\n"
    src += "from gpu_console.tasks.base import TaskOutput\n"
    assert gpu_console_imports(src) == {
        "gpu_console.engine.loop", "gpu_console", "gpu_console.engine", "gpu_console.tasks.base",
    }  # fmt: skip


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_uses_only_the_public_task_api(name):
    source = (REPO / "examples" / f"{name}.py").read_text()
    assert gpu_console_imports(source) <= PUBLIC, f"examples/{name}.py reaches into internals"
    module, cls = load_profile(str(REPO / "examples" / f"{name}.toml")).task_kind.split(":")
    assert module == f"examples.{name}"
    assert f"\nclass {cls}:" in source


# -- each example: uninterrupted, and stopped half-way then resumed -----------------------------


def uninterrupted_and_resumed(tmp_path: Path, name: str, steps: int, *sets: str):
    """(the uninterrupted run, the run stopped half-way and resumed), run where a user runs
    them: a directory holding the examples package (a copy of the repository's)."""
    examples = tmp_path / "examples"
    examples.mkdir()
    for ext in ("py", "toml"):
        shutil.copy(REPO / "examples" / f"{name}.{ext}", examples)
    profile = examples / f"{name}.toml"
    every = ("train.log_every=1", *sets)
    ref = run_engine(tmp_path, profile, *every, f"train.max_steps={steps}", ranks=2,
                     runs_dir=tmp_path / "ref")  # fmt: skip
    cut = run_engine(tmp_path, profile, *every, f"train.max_steps={steps // 2}", ranks=2,
                     runs_dir=tmp_path / "cut")  # fmt: skip
    run_engine(tmp_path, None, f"train.max_steps={steps}", ranks=2, resume=cut,
               runs_dir=tmp_path / "cut")  # fmt: skip
    starts = events_of(cut, "start")
    assert [s["start_step"] for s in starts] == [0, steps // 2]
    return ref, cut


def steps_of(run_dir: Path) -> dict[int, tuple]:
    return {
        e["step"]: (e["loss"], e["lr"], e.get("lrs"), e.get("metrics"))
        for e in events_of(run_dir, "step")
    }


def evals_of(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "t"} for e in events_of(run_dir, "eval")]


def end_state(run_dir: Path, step: int) -> dict:
    return checkpoint.load(run_dir / "checkpoints" / checkpoint.step_dir_name(step))


def assert_same(a, b, where: str = "") -> None:
    """Equal, tensors bit for bit, through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_optimizers_came_back(ref: Path, cut: Path, steps: int) -> dict:
    mine, theirs = end_state(cut, steps), end_state(ref, steps)
    assert_same(mine["optimizers"], theirs["optimizers"], "optimizers")
    assert_same(mine["schedulers"], theirs["schedulers"], "schedulers")
    assert_same(mine["model"], theirs["model"], "model")
    return mine


def test_char_lstm_resumes_its_hidden_state_and_plateau_exactly(tmp_path):
    # Every eval after the first counts as a plateau (a 50% improvement is asked for): the
    # lr is cut at each, which a resume that forgot the scheduler's best would not do.
    # An epoch is 17 steps (2 ranks × 16 streams); the cut at step 12 is mid-epoch, with a
    # hidden state carried into step 13 only by the task's state_dict.
    sets = ["train.eval_every=4", "task.plateau_threshold=0.5"]
    ref, cut = uninterrupted_and_resumed(tmp_path, "char_lstm", 24, *sets)
    expected = steps_of(ref)
    assert len(expected) == 24
    assert steps_of(cut) == expected
    assert evals_of(cut) == evals_of(ref)
    assert [e["step"] for e in evals_of(ref)] == [4, 8, 12, 16, 20, 24]
    assert all("perplexity" in e for e in evals_of(ref))
    # A step event's lr is the next update's; each eval (after the step's event) cuts it.
    lrs = [expected[s][1] for s in (8, 9, 13, 17, 24)]
    assert lrs == pytest.approx([5.0, 1.25, 0.3125, 0.078125, 5.0 / 4**4])
    state = assert_optimizers_came_back(ref, cut, 24)
    assert state["schedulers"]["main"]["_last_lr"] == [pytest.approx(5.0 / 4**5)]
    # The carried hidden state of each rank, saved per rank.
    assert [list(r["task"]["state"][0].shape) for r in state["ranks"]] == [[1, 16, 128]] * 2
    assert (cut / "checkpoints" / "BEST").is_file()


def test_gan_resumes_both_optimizers_and_writes_the_same_samples(tmp_path):
    # 512 points, 64 a rank, 2 ranks: an epoch is 4 steps.
    ref, cut = uninterrupted_and_resumed(tmp_path, "gan", 16, "task.samples=512")
    expected = steps_of(ref)
    assert len(expected) == 16
    assert steps_of(cut) == expected
    names = {"Loss_D", "Loss_G", "D(x)", "D(G(z))"}
    assert all(set(expected[s][3]) == names for s in expected)
    assert set(expected[16][2]) == {"D", "G"}
    ref_out = headless_text(ref)
    assert "train D(x): " in ref_out and "train Loss_G: " in ref_out  # the summary
    state = assert_optimizers_came_back(ref, cut, 16)
    for name in ("D", "G"):
        groups = state["optimizers"][name]["param_groups"]
        assert groups[0]["betas"] == (0.5, 0.999)
        assert {float(s["step"]) for s in state["optimizers"][name]["state"].values()} == {16.0}
    samples = sorted(p.name for p in (ref / "task").iterdir())
    assert samples == [f"samples-epoch-{e:03d}.csv" for e in range(4)]
    for sample in samples:
        assert (cut / "task" / sample).read_text() == (ref / "task" / sample).read_text()


def test_gpt_char_resumes_its_schedule_exactly_and_exports(procs, tmp_path):
    sets = ["train.eval_every=8", "task.warmup=4", "task.decay_steps=8"]
    ref, cut = uninterrupted_and_resumed(tmp_path, "gpt_char", 16, *sets)
    expected = steps_of(ref)
    assert len(expected) == 16
    assert steps_of(cut) == expected
    # eval_at_start: step 0, before any update; the resume at 8 already evaluated there.
    assert [e["step"] for e in evals_of(ref)] == [0, 8, 16]
    assert evals_of(cut) == evals_of(ref)
    assert {"val/loss", "train/loss", "val/perplexity"} <= set(evals_of(ref)[0])
    # Warmup over 4 steps, cosine over 8, then the floor (min_lr / lr = 0.1).
    lr = 1e-3
    assert expected[1][1] == pytest.approx(lr * 2 / 5)
    assert expected[13][1] == pytest.approx(1e-4) and expected[16][1] == pytest.approx(1e-4)
    state = assert_optimizers_came_back(ref, cut, 16)
    assert state["schedulers"]["main"]["last_epoch"] == 16
    groups = state["optimizers"]["main"]["param_groups"]
    assert [(g["weight_decay"], g["betas"]) for g in groups] == [
        (0.1, (0.9, 0.95)),
        (0.0, (0.9, 0.95)),
    ]
    start = events_of(cut, "start")[-1]
    assert start["flops_from"] == "task"
    assert start["optimizers"][0]["schedule"] == {"kind": "LambdaLR"}

    out = tmp_path / "gpt.pt"
    result = procs.cli("export", str(cut), "--best", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    sys.path.insert(0, str(REPO))  # the examples package, as a user's script imports it
    try:
        from examples.gpt_char import GPT, GPTChar, GPTConfig
    finally:
        sys.path.remove(str(REPO))

    model = GPT(GPTConfig(), len(GPTChar(GPTConfig()).vocab))
    model.load_state_dict(torch.load(out, weights_only=True)["gpt"])  # strict: every key
