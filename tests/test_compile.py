"""``train.compile`` on 2 CPU ranks through torchrun (inductor's C++ backend).

One tiny model, short runs: a compiled run says ``compiling`` until its first step, its start
event names the mode, its losses match an eager run's, and checkpoints cross between compiled
and eager runs both ways (the model is compiled in place: same state_dict keys). The inductor
cache is the suite's (``$XDG_CACHE_HOME``, conftest.py), so only the first compile is cold.
"""

from __future__ import annotations

import math

import pytest
from conftest import events_of, fast_profile, read_status, run_dirs

pytestmark = pytest.mark.torch_floor  # CI runs this module on the floor torch too

COMPILE_DEADLINE_S = 600.0  # a cold compile on a loaded 2-core machine takes a minute or more
STEPS = 6
# Inductor fuses and reorders fp32 reductions: the same maths, not the same rounding.
REL_TOL = 1e-4


def _run(procs, runs_dir, tmp_path, name: str, *sets: str, resume=None):
    args = ["run"]
    if resume is None:
        args += [str(fast_profile(tmp_path, max_steps=STEPS, ranks=2)), "--name", name]
    else:
        args += ["--resume", str(resume)]
    args += ["--headless", "--runs-dir", str(runs_dir)]
    for s in sets:
        args += ["--set", s]
    done = procs.cli(*args, cwd=tmp_path, timeout=COMPILE_DEADLINE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    if resume is not None:
        return resume, done
    (run,) = [r for r in run_dirs(runs_dir) if r.name.startswith(name + "-")]
    return run, done


def _losses(run, since: int = 0) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(run, "step") if e["step"] > since}


def test_compiled_run_matches_eager_and_checkpoints_cross(procs, runs_dir, tmp_path):
    compiled, out = _run(procs, runs_dir, tmp_path, "compiled", "train.compile=true")
    eager, _ = _run(procs, runs_dir, tmp_path, "eager")

    # It compiled: the start event says so, the run said "compiling" until its first step.
    (start,) = events_of(compiled, "start")
    assert start["compile"] == "default"
    assert events_of(eager, "start")[0]["compile"] is False
    states = [e["state"] for e in events_of(compiled, "status")]
    assert states == ["starting", "compiling", "running", "finished"], states
    compiling = events_of(compiled, "status")[1]
    assert compiling["since"] <= events_of(compiled, "step")[0]["t"]
    assert events_of(compiled, "status")[2]["compiled_s"] > 0
    assert "compiling the model (torch.compile mode default)" in out.stdout, out.stdout
    assert "compiled in" in out.stdout, out.stdout
    steps = events_of(compiled, "step")
    assert [e["recompiles"] for e in steps] == [0] * STEPS  # one shape: no recompile
    assert read_status(compiled)["compiling_since"] is None  # only while compiling

    # The same losses as eager, to inductor's rounding.
    a, b = _losses(compiled), _losses(eager)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert math.isclose(a[step], b[step], rel_tol=REL_TOL), (step, a[step], b[step])

    # Compiled → eager and eager → compiled resumes: the same keys, the same continuation.
    more = f"train.max_steps={STEPS + 3}"
    _run(procs, runs_dir, tmp_path, "", more, "train.compile=false", resume=compiled)
    _run(procs, runs_dir, tmp_path, "", more, "train.compile=true", resume=eager)
    assert events_of(compiled, "start")[-1]["compile"] is False
    assert events_of(eager, "start")[-1]["compile"] == "default"
    assert [e["state"] for e in events_of(eager, "status")][-3:] == [
        "compiling",
        "running",
        "finished",
    ]
    a, b = _losses(compiled, STEPS), _losses(eager, STEPS)
    assert sorted(a) == sorted(b) == [STEPS + 1, STEPS + 2, STEPS + 3]
    for step in a:
        assert math.isclose(a[step], b[step], rel_tol=REL_TOL), (step, a[step], b[step])


def test_a_shape_change_after_the_first_step_is_counted_and_warned_about(tmp_path, monkeypatch):
    import torch

    from gpu_console.engine.compile import Compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()

    class Small(torch.nn.Module):  # defined here: Dynamo traces it (not torch.nn's own code)
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x))

    model = Small()
    compiled = Compiled("default")
    compiled.apply(model)
    said: list[tuple] = []
    status = lambda state, **kw: said.append(("status", state, kw))  # noqa: E731
    log = lambda level, message: said.append((level, message))  # noqa: E731

    compiled.begin(status)
    model(torch.ones(4, 3)).sum().backward()
    compiled.first_step_done(status, log)
    model(torch.ones(4, 3)).sum().backward()
    compiled.check(log)
    assert compiled.recompiles == 0
    assert [s[1] for s in said if s[0] == "status"] == ["compiling", "running"]

    model(torch.ones(5, 3)).sum().backward()  # a new batch size: one recompile (then dynamic)
    model(torch.ones(6, 3)).sum().backward()
    compiled.check(log)
    compiled.check(log)  # warned once per new recompile, not at every log step
    assert compiled.recompiles == 1
    warnings = [m for level, m in (s for s in said if s[0] != "status") if level == "warning"]
    assert len(warnings) == 1 and "recompiled 1 time(s)" in warnings[0], warnings
    assert compiled.step_fields()["recompiles"] == 1
