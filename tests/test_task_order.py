"""The task contract's order holds on every path that makes a task's parts.

docs/tasks.md promises: ``ctx`` set, then ``build_model()``, then the optimizers
(``configure_optimizers``), then ``build_datasets()``. A task that relies on it (its data
sets read what its model set) must launch, dry-run and resume. The task below writes each of
its calls, with the process that made it, to a file; each test holds every process's calls
against engine/task_parts.py's ORDER, and ORDER against the docs. The dry run and a refusal
go through the real CLI; a launch's and a resume's parts (the launch's data count and model
check, the ranks) on the engine harness (tests/harness.py), which runs the product's own
functions for them (the data count in this process, the resume's model check in its own).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from conftest import REPO, events_of, only_run, read_status, task_profile
from conftest import test_env as cli_env
from harness import run_engine

from gpu_console.engine.task_parts import ORDER

# build_datasets reads what build_model set, as four of six ported tasks did (issue 39).
ORDERED = """
import os
import torch
from dataclasses import dataclass
from gpu_console.tasks.mlp import MLPTask
from gpu_console.tasks.configs import MLPConfig


def _say(what):
    role = os.environ.get("LOCAL_RANK", "check")
    with open(os.environ["CALLS_FILE"], "a") as f:
        f.write(f"{os.getpid()} {role} {what}\\n")


@dataclass
class Config(MLPConfig):
    note: str = ""  # changes nothing in the model: a resume may change it


class Ordered(MLPTask):
    Config = Config

    def __setattr__(self, name, value):
        if name == "ctx":
            _say("ctx")
        super().__setattr__(name, value)

    def build_model(self):
        _say("build_model")
        self.vocab = self.cfg.num_classes  # what build_datasets reads
        return super().build_model()

    def configure_optimizers(self, model, ctx):
        _say("configure_optimizers")
        return torch.optim.AdamW(model.parameters(), lr=3e-3)

    def build_datasets(self):
        _say("build_datasets")
        assert self.vocab == self.cfg.num_classes
        return super().build_datasets()
"""


def calls(path: Path) -> dict[tuple[str, str], list[str]]:
    """Each process's calls, in order, by (pid, role)."""
    seen: dict[tuple[str, str], list[str]] = defaultdict(list)
    for line in path.read_text().splitlines():
        pid, role, what = line.split()
        seen[(pid, role)].append(what)
    return dict(seen)


def assert_in_order(seen: dict[tuple[str, str], list[str]]) -> None:
    """Every process made the contract's calls in its order, each once: all of them, or its
    start (a model check stops after build_model)."""
    for who, made in seen.items():
        assert made == list(ORDER[: len(made)]), (who, made)


def test_the_order_in_the_docs_is_the_engines():
    # The sentence users port against names the calls in ORDER's order.
    text = (REPO / "docs" / "tasks.md").read_text()
    assert "**The order.**" in text, "docs/tasks.md states the order of the task's calls"
    stated = text.split("**The order.**")[1].split("`build_datasets()`.")[0] + "`build_datasets`"
    named = re.findall(r"`(ctx|build_model|configure_optimizers|build_datasets)\b", stated)
    assert tuple(named) == ORDER
    repro = (REPO / "docs" / "reproducibility.md").read_text()
    assert "`build_model`, then `configure_optimizers` and `build_datasets`" in repro


def test_a_task_whose_data_reads_its_model_launches_dry_runs_and_resumes(procs, runs_dir, tmp_path):
    profile = task_profile(tmp_path, "ordered", ORDERED, "Ordered", max_steps=4, ranks=2)
    log = tmp_path / "calls.txt"
    env = cli_env(CALLS_FILE=str(log))

    dry = procs.cli("run", str(profile), "--dry-run", "--runs-dir", str(runs_dir),
                    cwd=tmp_path, env=env)  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    seen = calls(log)
    assert_in_order(seen)
    assert [made for made in seen.values() if made == list(ORDER)], seen  # the plan's
    log.unlink()

    # The launch: its data check (here, the pytest process: role "check") and 2 ranks.
    first = run_engine(tmp_path, profile, ranks=2, runs_dir=runs_dir, env={"CALLS_FILE": str(log)})
    assert first == only_run(runs_dir)
    assert events_of(first, "status")[-1]["state"] == "finished"
    seen = calls(log)
    assert_in_order(seen)
    full = [who for who, made in seen.items() if made == list(ORDER)]
    # The launch's data check and both ranks made every part, in the order.
    assert sorted(role for _, role in full) == ["0", "1", "check"], seen
    log.unlink()

    # A resume with a changed [task] key: the model check (a prefix), then the ranks.
    run_engine(tmp_path, None, 'task.note="more"', "train.max_steps=6", ranks=2, resume=first,
               runs_dir=runs_dir, env={"CALLS_FILE": str(log)})  # fmt: skip
    seen = calls(log)
    assert_in_order(seen)
    assert ["ctx", "build_model"] in seen.values(), seen  # resume_model's shape check
    roles = sorted(role for (_, role), made in seen.items() if made == list(ORDER))
    assert roles == ["0", "1", "check"], seen  # the data check and both ranks
    assert events_of(first, "status")[-1]["state"] == "finished"
    assert events_of(first, "step")[-1]["step"] == 6


def test_a_data_check_past_its_limit_is_refused_by_the_ranks_in_one_line(procs, runs_dir, tmp_path):
    # The launch's data check gives up at its limit (here at once): the ranks judge the
    # batch against the data set and refuse it as the launch would have: state refused,
    # exit 2, the key in one line, no traceback. One rank: each rank judges on its own.
    profile = task_profile(tmp_path, "ordered", ORDERED, "Ordered", max_steps=4)
    text = profile.read_text().replace("train_samples = 8192", "train_samples = 20")
    profile.write_text(text)
    env = cli_env(CALLS_FILE=str(tmp_path / "calls.txt"), GPU_CONSOLE_DATA_CHECK_S="0")
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                       cwd=tmp_path, env=env)  # fmt: skip
    both = result.stdout + result.stderr
    assert result.returncode == 2, both
    assert "Traceback" not in both
    status = read_status(only_run(runs_dir))
    assert status["state"] == "refused", status
    assert status["exit_code"] == 2
    assert status["reason"].startswith("data.batch_size: "), status["reason"]
    assert "\n" not in status["reason"]
    assert "state: refused data.batch_size: " in both, both
