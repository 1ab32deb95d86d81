"""The network, visible (issue 24): ``distributed.env`` reaches every rank before torch does
and the start event lists it; ``check`` reports the NCCL/gloo variables, the interfaces (a
``*_SOCKET_IFNAME`` naming none is a warning) and InfiniBand."""

from __future__ import annotations

import json
import os

import conftest
from conftest import events_of, run_finished
from typer.testing import CliRunner

from gpu_console import network
from gpu_console.cli import app
from gpu_console.commands import check
from gpu_console.commands.check import PASS, SKIP, WARN

# Each rank says, as a train metric summed over the ranks, whether it saw MY_FLAG = "x" and
# GLOO_SOCKET_IFNAME = "lo" in its own environment (set by the rank before torch started).
ENV_TASK = """
import os
import torch
from gpu_console.tasks.mlp import MLPTask


class SeesEnv(MLPTask):
    metric_reduce = {"saw_flag": "sum", "saw_ifname": "sum"}

    def compute(self, model, batch):
        out = super().compute(model, batch)
        out.metrics["saw_flag"] = torch.tensor(float(os.environ.get("MY_FLAG") == "x"))
        seen = os.environ.get("GLOO_SOCKET_IFNAME") == "lo"
        out.metrics["saw_ifname"] = torch.tensor(float(seen))
        return out
"""


def test_distributed_env_reaches_every_rank_and_the_start_event(procs, runs_dir, tmp_path):
    profile = conftest.task_profile(
        tmp_path, "sees_env", ENV_TASK, "SeesEnv", max_steps=3,
        extra='\n[distributed]\nenv = { GLOO_SOCKET_IFNAME = "lo", MY_FLAG = "x" }\n',
        ranks=2,
    )  # fmt: skip
    run, out = run_finished(procs, profile, runs_dir, tmp_path)
    (start,) = events_of(run, "start")
    assert start["env"] == {"GLOO_SOCKET_IFNAME": "lo", "MY_FLAG": "x"}
    steps = events_of(run, "step")
    assert steps and all(e["metrics"]["saw_flag"] == 2.0 for e in steps)  # both ranks
    assert all(e["metrics"]["saw_ifname"] == 2.0 for e in steps)
    assert "MY_FLAG" in out  # the headless start lines mention them
    assert 'MY_FLAG = "x"' in (run / "run.toml").read_text()
    shown = procs.cli("status", run.name, "--runs-dir", str(runs_dir)).stdout
    assert "GLOO_SOCKET_IFNAME=lo, MY_FLAG=x" in shown  # the summary's distributed.env row


def test_a_set_into_the_env_table_keeps_the_profiles_other_entries(tmp_path):
    from gpu_console.profile import load_profile

    path = conftest.write_profile(
        tmp_path / "p.toml", '[distributed]\nenv = { NCCL_DEBUG = "WARN", A = "1" }\n'
    )
    p = load_profile(str(path), ["distributed.env.NCCL_DEBUG=INFO", "distributed.env.N=4"])
    assert p.distributed.env == {"NCCL_DEBUG": "INFO", "A": "1", "N": "4"}


def test_env_values_become_text_and_owned_names_are_refused():
    good, bad = network.env_problems({"A": 1, "B": True, "C": False, "D": 0.5, "E": "x"})
    assert good == {"A": "1", "B": "1", "C": "0", "D": "0.5", "E": "x"} and bad == []
    names = ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RANK", "LOCAL_RANK", "WORLD_SIZE",
             "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "GPU_CONSOLE_RUNS", "1X", "A-B", ""]  # fmt: skip
    good, bad = network.env_problems(dict.fromkeys(names, "v"))
    assert good == {} and len(bad) == len(names)
    for name, line in zip(names, bad, strict=True):
        assert line.startswith(f"distributed.env.{name}: "), line


def test_apply_sets_the_run_tomls_env_over_the_inherited(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    toml = tmp_path / "run.toml"
    toml.write_text('[distributed.env]\nNCCL_DEBUG = "INFO"\nMY_FLAG = "x"\n')
    assert network.apply(toml) == {"NCCL_DEBUG": "INFO", "MY_FLAG": "x"}
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["MY_FLAG"] == "x"
    monkeypatch.delenv("MY_FLAG")
    assert network.apply(tmp_path / "missing.toml") == {}


def test_ifname_rules_follow_nccl_and_gloo():
    found = [{"name": "lo", "up": True}, {"name": "eth0", "up": True}, {"name": "ib0", "up": False}]
    good, bad = network.ifname_problems(
        {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth9", "TP_SOCKET_IFNAME": "ib0"},
        found,
    )
    assert good == ["NCCL_SOCKET_IFNAME=eth: eth0"]
    assert bad == [
        "GLOO_SOCKET_IFNAME=eth9 names no interface here (there are lo, eth0, ib0)",
        "TP_SOCKET_IFNAME=ib0: ib0 down",
    ]
    # NCCL: "=name" is exact, "^..." excludes (it never names a missing interface).
    assert network.ifname_problems({"NCCL_SOCKET_IFNAME": "=eth"}, found)[1]
    assert network.ifname_problems({"NCCL_SOCKET_IFNAME": "^docker"}, found)[1] == []


def test_infiniband_devices_and_port_states(tmp_path):
    assert network.infiniband(tmp_path / "none") == []
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (tmp_path / "mlx5_1" / "ports" / "1").mkdir(parents=True)  # state unreadable
    assert network.infiniband(tmp_path) == [
        {"device": "mlx5_0", "ports": [{"port": "1", "state": "ACTIVE"}]},
        {"device": "mlx5_1", "ports": [{"port": "1", "state": None}]},
    ]


def test_check_warns_of_a_socket_ifname_that_names_no_interface(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    result = CliRunner().invoke(app, ["check", "--json", "--runs-dir", str(tmp_path)])
    doc = json.loads(result.output)
    rows = {c["name"]: c for c in doc["checks"]}
    assert rows["socket_ifname"]["status"] == WARN
    assert rows["socket_ifname"]["detail"].startswith("NCCL_SOCKET_IFNAME=eth9 names no interface")
    assert rows["network env"]["status"] == PASS
    assert "NCCL_DEBUG=INFO" in rows["network env"]["detail"]
    assert "NCCL_SOCKET_IFNAME=eth9" in rows["network env"]["detail"]
    assert rows["interfaces"]["status"] == PASS and "lo (up" in rows["interfaces"]["detail"]
    assert rows["infiniband"]["status"] in (PASS, SKIP)
    net = doc["network"]
    assert net["env"]["NCCL_SOCKET_IFNAME"] == "eth9"
    assert "lo" in [i["name"] for i in net["interfaces"]]
    assert isinstance(net["infiniband"], list)
    assert "WARN socket_ifname: NCCL_SOCKET_IFNAME=eth9" in doc["report"]
    # The human table says the same (the rows alone: no second round of torch workers).
    rows, facts = check.network_checks()
    check.render(rows, {"status": check.nvml.status(), "network": facts}, "")
    assert "NCCL_SOCKET_IFNAME=eth9 names no interface here" in capsys.readouterr().out
