"""A run that never compiles does not import torch._dynamo (1.5 s of CPU a rank), and a run
that does compile, or a task that compiles on its own, gets torch's behaviour back before
anything compiles. Each case in a fresh interpreter: this one may have torch._dynamo already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import Procs, only_run, task_profile
from conftest import test_env as cli_env

pytestmark = pytest.mark.torch_floor  # a private torch wrapper, on the floor torch too

SCRIPT = r"""
import json, sys
import torch

defer, mode = sys.argv[1] == "defer", sys.argv[2]
deferred = 0
if defer:
    from gpu_console.engine.torch_private import defer_dynamo
    deferred = defer_dynamo()


def dynamo():
    return type(sys.modules.get("torch._dynamo")).__name__


def hexes(model):
    return [x.hex() for p in model.parameters() for x in p.detach().flatten().tolist()]


torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
x = torch.randn(8, 4)


def step():
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()


for _ in range(3):
    step()
opt.load_state_dict(opt.state_dict())
out = {"deferred": deferred, "eager": hexes(model), "after_eager": dynamo()}
if mode == "compile":
    # A task's own compile: Dynamo traces the optimizer's step (graph breaks where torch puts
    # them) and the wrapped functions are torch's own again.
    torch.compile(step, backend="eager")()
    zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__
    out["disabled"] = getattr(zero_grad, "__dynamo_disable", zero_grad) is not zero_grad
elif mode == "submodule":
    import torch._dynamo.config

    out["optimize_ddp"] = torch._dynamo.config.optimize_ddp
else:
    step()
out["params"] = hexes(model)
out["after"] = dynamo()
print(json.dumps(out))
"""


def run(defer: bool, mode: str = "eager") -> dict:
    argv = [sys.executable, "-c", SCRIPT, "defer" if defer else "torch", mode]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_training_without_compile_never_imports_dynamo_and_is_unchanged():
    torch_own, deferred = run(False), run(True)
    assert torch_own["after_eager"] == "module"  # torch alone imports it at the first step
    assert deferred["deferred"] > 0
    assert deferred["after"] == "_DynamoStandIn"
    assert deferred["params"] == torch_own["params"]


def test_a_compile_after_deferring_loads_dynamo_and_gives_torch_its_functions_back():
    torch_own, compiled = run(False, "compile"), run(True, "compile")
    assert compiled["after_eager"] == "_DynamoStandIn"
    assert compiled["after"] == "module"
    assert compiled["disabled"] is True and torch_own["disabled"] is True
    assert compiled["params"] == torch_own["params"]  # the compiled fourth step, the same


def test_importing_a_dynamo_submodule_through_the_stand_in_loads_the_real_one():
    out = run(True, "submodule")
    assert out["after"] == "module" and out["optimize_ddp"] in (True, False)


PROBE_TASK = """
import sys
from gpu_console.tasks.mlp import MLPTask


OUT = {out!r}


class Probe(MLPTask):
    def on_train_end(self, model, ctx, reason):
        with open(OUT, "w") as f:
            f.write(type(sys.modules.get("torch._dynamo")).__name__)
"""


def test_the_stand_ins_ddp_mode_is_dynamos_default():
    # DDP's constructor reads it on every run; the stand-in answers without Dynamo.
    code = (
        "import torch._dynamo.utils as u; from gpu_console.engine import torch_private as p; "
        "print(u.get_optimize_ddp_mode(), p._DEFAULT_DDP_MODE)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    real, stand_in = done.stdout.split()
    assert real == stand_in


def test_a_real_ddp_run_trains_without_importing_dynamo(tmp_path):
    # Two ranks: DDP's constructor and forward, the optimizer, eval, a checkpoint at the end.
    procs = Procs(tmp_path / "runs")
    try:
        out = tmp_path / "dynamo.txt"
        source = PROBE_TASK.replace("{out!r}", repr(str(out)))
        profile = task_profile(tmp_path, "probe", source, "Probe", max_steps=3, ranks=2)
        done = procs.cli(
            "run", str(profile), "--headless", "--runs-dir", str(tmp_path / "runs"),
            cwd=tmp_path, env=cli_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert out.read_text() == "_DynamoStandIn"
        assert only_run(tmp_path / "runs").is_dir()
    finally:
        procs.cleanup()
