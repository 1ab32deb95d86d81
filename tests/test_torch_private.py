"""Private torch APIs are reached through one door (engine/torch_private.py), and each of
its functions works on the installed torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import deadline
from conftest import test_env as cli_env
from torch import nn

from gpu_console.engine import torch_private

pytestmark = pytest.mark.torch_floor  # every use of the door, on the floor torch too

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_console"
DOOR = PACKAGE / "engine" / "torch_private.py"
# Private names of torch objects that are not reached through ``torch.``/``nn.`` spelled out.
KNOWN_PRIVATE = {
    "_last_lr", "_step_count", "_get_fsdp_state", "_lazy_init", "_NormBase",
    "_record_memory_history", "_dump_snapshot", "_load_state_dict_from_keys",
    "_set_params_and_buffers_to_ignore_for_model", "_ddp_params_and_buffers_to_ignore",
}  # fmt: skip
TORCH_ROOTS = {"torch", "nn", "dist", "F"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(_private(p) for p in parts):
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(_private(p) for p in a.name.split(".")):
                    found.append(f"{where}: import {a.name}")
        elif (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and (node.attr in KNOWN_PRIVATE or _root(node) in TORCH_ROOTS)
        ):
            found.append(f"{where}: .{node.attr}")
    return found


def test_no_module_but_the_door_reaches_a_private_torch_api():
    uses = [u for p in sorted(PACKAGE.rglob("*.py")) if p != DOOR for u in private_uses(p)]
    assert not uses, "private torch APIs outside engine/torch_private.py:\n" + "\n".join(uses)


def test_the_check_sees_a_private_use(tmp_path):
    # The scan above must be able to fail: each spelling it looks for is caught.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_leaves\n"
        "x = torch.cuda.memory._record_memory_history\n"
        "def f(s):\n    s._last_lr = [1.0]\n"
    )
    assert len(private_uses(probe)) == 4, private_uses(probe)


def test_norm_layers_cover_batch_and_instance_norms():
    kinds = torch_private.norm_layer_types()
    for layer in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.InstanceNorm2d(3), nn.LayerNorm(3)):
        assert isinstance(layer, kinds), type(layer)
    assert not isinstance(nn.Linear(2, 2), kinds)


def test_fused_kernel_devices_is_a_list_of_device_types():
    devices = torch_private.fused_kernel_devices()
    assert isinstance(devices, list) and "cuda" in devices


def test_tree_leaves_and_its_fallback_agree():
    tree = {"a": [1, (2, torch.ones(1))], "b": 3}
    leaves = torch_private.tree_leaves(tree)
    assert [x for x in leaves if not torch.is_tensor(x)] == [1, 2, 3]
    assert len(leaves) == 4
    assert len(torch_private._leaves(tree)) == 4


def test_a_dispatch_mode_sees_the_ops_of_a_forward():
    seen = []

    class Spy(torch_private.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.ones(2) @ torch.ones(2)
    assert any("dot" in s or "mm" in s or "matmul" in s for s in seen), seen


def test_scheduler_lr_and_step_count_are_set_where_torch_reads_them():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    opt.step(), sched.step(), opt.step(), sched.step()
    torch_private.set_last_lr(sched, [0.125])
    assert sched.get_last_lr() == [0.125]
    before = sched._step_count
    torch_private.rewind_step_count(sched, 2)
    assert sched._step_count == before - 2


def test_compile_counters_are_readable():
    assert isinstance(torch_private.unique_graphs(), int)


def test_memory_snapshot_functions_exist_on_this_torch():
    # Recording needs CUDA; on this torch the functions must at least be there to call.
    assert callable(getattr(torch.cuda.memory, "_record_memory_history", None))
    assert callable(getattr(torch.cuda.memory, "_dump_snapshot", None))


def test_ddp_leaves_the_ignored_parameters_alone(one_rank_group):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    torch_private.ddp_ignore(model, ["1.weight", "1.bias"])
    ddp = nn.parallel.DistributedDataParallel(model)
    assert set(ddp.parameters_to_ignore) == {"1.weight", "1.bias"}
    ddp(torch.randn(4, 3)).sum().backward()  # the ignored ones still get their gradients
    assert model[1].weight.grad is not None and model[0].weight.grad is not None


# Two gloo ranks: a collective whose peer is 3 s late passes under the group's first timeout
# (60 s), then fails after the one set_group_timeout gives it (1 s), well before the peer
# comes.
TIMEOUT_WORKER = r"""
import json, os, sys, time
from datetime import timedelta
from gpu_console.engine.signals import die_with_parent
die_with_parent()
import torch, torch.distributed as dist
from gpu_console.engine import torch_private

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()

def late(seconds):
    if rank == 1:
        time.sleep(seconds)
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "waited": time.monotonic() - began}

out = {"before": late(3.0), "set": torch_private.set_group_timeout(1.0)}
out["after"] = late(3.0)
if rank == 0:
    with open(os.path.join(sys.argv[1], "rank-0.json"), "w") as f:
        json.dump(out, f)
os._exit(0)  # rank 0's group is broken after its timeout: no teardown
"""


def test_a_gloo_groups_timeout_is_set_for_the_next_collective(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from conftest import repo_pythonpath

    script = tmp_path / "worker.py"
    script.write_text(TIMEOUT_WORKER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1")
    proc = subprocess.run([*argv, str(script), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    res = json.loads((tmp_path / "rank-0.json").read_text())
    assert res["set"] is None, (res, proc.stderr[-2000:])
    assert res["before"]["error"] is None and res["before"]["waited"] > 2.5
    assert "Timed out" in res["after"]["error"], res
    assert res["after"]["waited"] < 2.5, res  # 1 s, not the 3 s the peer took


def test_set_group_timeout_says_why_without_a_group():
    # No process group: torch raises, and the door turns it into a reason (the run's warning).
    import torch.distributed as dist

    assert not dist.is_initialized()
    why = torch_private.set_group_timeout(5.0)
    assert isinstance(why, str) and why


def test_an_optimizers_first_step_imports_the_compiler_so_a_rank_imports_it_up_front():
    # The premise of import_compiler: plain torch.optim use imports torch._dynamo anyway, so
    # a rank importing it with the rest of torch adds nothing. Also the rank's imports leave
    # the collector on, with what they made frozen.
    probe = (
        "import gc, sys, torch\n"
        "opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])\n"
        "opt.step()\n"
        "print('after a step', 'torch._dynamo' in sys.modules)\n"
        "from gpu_console.engine.__main__ import imports_without_gc\n"
        "imports_without_gc()\n"
        "print('collector', gc.isenabled(), gc.get_freeze_count() > 10_000)\n"
    )
    fresh = "import sys\nfrom gpu_console.engine.torch_private import import_compiler\n"
    fresh += "print('before', 'torch._dynamo' in sys.modules)\nimport_compiler()\n"
    fresh += "print('imported', 'torch._dynamo' in sys.modules)\n"
    for code, expected in (
        (probe, "after a step True\ncollector True True\n"),
        (fresh, "before False\nimported True\n"),
    ):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=deadline(120), env=cli_env())  # fmt: skip
        assert done.stdout == expected, done.stderr
