"""``gpu-console check [--json]``: is this machine ready for a long run?

Python, torch, CUDA, cuDNN, NCCL, NVML, the GPUs (capability, bf16, TF32, a matmul checked
against float64), a real 2-process all_reduce on the backend a run would use, torchrun, a
rendezvous port, the runs directory and free disk. Each check is PASS, WARN, FAIL or SKIP
with one line of detail; the exit code is 1 only when a check FAILs.

The console never imports torch: the torch side runs in time-boxed subprocesses
(:mod:`.check_worker`) started together, and a worker that fails or hangs becomes a FAIL row
with one line of detail, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import __version__, launch, network, strict_json
from ..devices import bf16_native
from ..telemetry import nvml
from ..telemetry.host import host_summary

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
TIMEOUT_S = 120.0
GIB = 1024**3
DISK_FAIL_BYTES = 1 * GIB
DISK_WARN_BYTES = 10 * GIB
RAM_WARN_BYTES = 2 * GIB
MATMUL_WARN = 1e-4  # float32 against float64 at n=256 is ~1e-6; TF32 is ~1e-3
MATMUL_FAIL = 1e-2
WORKER = [sys.executable, "-m", "gpu_console.commands.check_worker"]


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


@dataclass
class WorkerResult:
    ok: bool
    data: dict[str, Any] | None  # the worker's JSON answer
    detail: str  # one line: why it failed ("" when ok)
    seconds: float


class _Worker:
    """One subprocess; its output goes to files, so a chatty child never blocks on a pipe."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.out = tempfile.TemporaryFile()  # noqa: SIM115 - closed in result()
        self.err = tempfile.TemporaryFile()  # noqa: SIM115
        self.started = time.monotonic()
        self.ended: float | None = None
        self.why_killed = ""
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self.out, stderr=self.err, env=env
        )

    def running(self) -> bool:
        if self.ended is None and self.popen.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is None

    def failed(self) -> bool:
        return not self.running() and self.popen.returncode != 0

    def kill(self, why: str) -> None:
        if self.running():
            self.why_killed = why
            self.popen.kill()
            self.popen.wait()
            self.ended = time.monotonic()

    def result(self) -> WorkerResult:
        self.out.seek(0)
        self.err.seek(0)
        stdout = self.out.read().decode(errors="replace")
        stderr = self.err.read().decode(errors="replace")
        self.out.close()
        self.err.close()
        seconds = (self.ended or time.monotonic()) - self.started
        data = _last_json(stdout)
        if self.why_killed:
            return WorkerResult(False, data, self.why_killed, seconds)
        if self.popen.returncode != 0:
            why = (data or {}).get("error") or _last_line(stderr)
            why = why or f"exited with code {self.popen.returncode}"
            return WorkerResult(False, data, why, seconds)
        if data is None:
            return WorkerResult(False, None, _last_line(stderr) or "no answer", seconds)
        return WorkerResult(True, data, "", seconds)


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            return value if isinstance(value, dict) else None
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_workers(
    groups: list[list[list[str]]], timeout: float = TIMEOUT_S, env: dict[str, str] | None = None
) -> list[list[WorkerResult]]:
    """Run every command at once; end the rest of a group when one of it fails.

    A group is processes that only make sense together (the ranks of a collective: a rank
    left alone would wait for its partner until its own timeout).
    """
    started = [[_Worker(argv, env) for argv in group] for group in groups]
    deadline = time.monotonic() + timeout
    try:
        while any(w.running() for group in started for w in group):
            for group in started:
                if any(w.failed() for w in group):
                    for w in group:
                        w.kill("stopped: its partner process failed")
            if time.monotonic() > deadline:
                for group in started:
                    for w in group:
                        w.kill(f"timed out after {timeout:g} s")
            time.sleep(0.05)
    finally:
        for group in started:
            for w in group:
                w.kill("interrupted")
    return [[w.result() for w in group] for group in started]


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_runs_dir(runs_dir: Path) -> Check:
    if runs_dir.exists():
        if not runs_dir.is_dir():
            return Check("runs_dir", FAIL, f"{runs_dir} exists and is not a directory")
        try:
            fd, tmp = tempfile.mkstemp(dir=runs_dir, prefix=".check-")
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            return Check("runs_dir", FAIL, f"{runs_dir} is not writable ({e.strerror})")
        count = sum(1 for p in runs_dir.iterdir() if (p / "run.toml").is_file())
        return Check("runs_dir", PASS, f"{runs_dir} is writable ({count} runs)")
    parent = _existing_ancestor(runs_dir)
    if not parent.is_dir():
        return Check("runs_dir", FAIL, f"{runs_dir} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        return Check("runs_dir", FAIL, f"{runs_dir} cannot be created: {parent} is not writable")
    return Check("runs_dir", PASS, f"{runs_dir} will be created in {parent} (writable)")


def check_disk(runs_dir: Path) -> Check:
    where = _existing_ancestor(runs_dir)
    try:
        free = shutil.disk_usage(where).free
    except OSError as e:
        return Check("disk", WARN, f"cannot read free space under {where} ({e.strerror})")
    text = f"{free / GIB:.1f} GiB free under {where}"
    if free < DISK_FAIL_BYTES:
        return Check("disk", FAIL, text + " (checkpoints need room)")
    if free < DISK_WARN_BYTES:
        return Check("disk", WARN, text + " (checkpoints of a large model may not fit)")
    return Check("disk", PASS, text)


def check_port() -> tuple[Check, int | None]:
    try:
        port = launch.free_port()
    except OSError as e:
        return Check("rendezvous_port", FAIL, f"cannot bind 127.0.0.1 ({e.strerror})"), None
    detail = f"127.0.0.1:{port} is free (a launch lets its rendezvous store bind a free port)"
    return Check("rendezvous_port", PASS, detail), port


def check_host(host: dict[str, Any]) -> Check:
    text = (
        f"{host['cores']} cores, RAM {host['ram_total'] / GIB:.1f} GiB "
        f"({host['ram_available'] / GIB:.1f} GiB available)"
    )
    if host["ram_available"] < RAM_WARN_BYTES:
        return Check("host", WARN, text + ": data loaders and checkpoints may run short")
    return Check("host", PASS, text)


def _torch_checks(
    info: WorkerResult, status: nvml.NvmlStatus, nvml_count: int
) -> tuple[list[Check], dict[str, Any]]:
    """Rows from the torch worker's answer, cross-checked with what NVML sees."""
    rows: list[Check] = []
    if not info.ok or info.data is None:
        rows.append(Check("torch", FAIL, info.detail or "the torch check gave no answer"))
        for name in ("cuda", "cudnn", "nccl", "gpus", "bf16", "tf32", "matmul:cpu", "gloo"):
            rows.append(Check(name, SKIP, "torch could not be checked"))
        rows.append(Check("torchrun", SKIP, "torch could not be checked"))
        return rows, {}
    d = info.data
    errors: dict[str, str] = d.get("errors", {})
    torch_v = d["torch"]
    rows.append(Check("torch", PASS, torch_v))
    cuda_ok = d["cuda_available"]
    build = d["cuda_build"]
    why_no_cuda = errors.get("cuda") or d.get("cuda_warning") or ""

    # CUDA, cuDNN, NCCL
    if build is None:
        rows.append(Check("cuda", SKIP, f"torch {torch_v} is a CPU-only build"))
    elif cuda_ok:
        driver = (
            f", the driver supports CUDA {status.cuda_driver_version}"
            if (status.cuda_driver_version)
            else ""
        )
        rows.append(Check("cuda", PASS, f"torch built for CUDA {build}{driver}"))
    elif nvml_count == 0:
        rows.append(Check("cuda", SKIP, f"torch built for CUDA {build}, but there is no GPU here"))
    else:
        rows.append(
            Check(
                "cuda",
                FAIL,
                f"torch built for CUDA {build} cannot use the GPUs: "
                f"{why_no_cuda or 'torch.cuda.is_available() is False'}",
            )
        )
    if not cuda_ok:
        rows.append(Check("cudnn", SKIP, "no usable CUDA"))
    elif d.get("cudnn"):
        rows.append(Check("cudnn", PASS, str(d["cudnn"])))
    else:
        rows.append(Check("cudnn", WARN, errors.get("cudnn") or "cuDNN is not available"))
    if not cuda_ok:
        where = "not built into this torch" if not d["nccl_available"] else "no usable CUDA"
        rows.append(Check("nccl", SKIP, f"{where}; CPU runs use gloo"))
    elif d.get("nccl"):
        rows.append(Check("nccl", PASS, str(d["nccl"])))
    else:
        rows.append(
            Check(
                "nccl",
                FAIL,
                (errors.get("nccl") or "NCCL is not available")
                + ": GPU runs use nccl (distributed.backend auto) and do not fall back to gloo; "
                'set distributed.backend = "gloo" (slow) or run on the CPU (--devices cpu)',
            )
        )

    # GPUs as torch sees them, against NVML
    devices = d.get("devices") or []
    if cuda_ok and devices:
        caps = ", ".join(
            f"cuda:{x['index']} {x['name']} ({x['capability'][0]}.{x['capability'][1]})"
            for x in devices
        )
        note = ""
        if status.available and nvml_count != len(devices):
            note = f"; NVML sees {nvml_count} (CUDA_VISIBLE_DEVICES hides the rest)"
        order = _order_note(devices)
        rows.append(Check("gpus", WARN if order else PASS, caps + note + order))
    elif nvml_count > 0:
        why = (
            f"torch {torch_v} is a CPU-only build"
            if build is None
            else (why_no_cuda or "torch.cuda.is_available() is False")
        )
        rows.append(
            Check(
                "gpus",
                FAIL,
                f"NVML sees {nvml_count} GPU{'s' if nvml_count != 1 else ''} "
                f"but torch cannot use CUDA ({why}): install a CUDA build of torch, "
                "or run with --devices cpu",
            )
        )
    else:
        why = "NVML unavailable" if not status.available else "NVML sees none"
        rows.append(Check("gpus", SKIP, f"no GPU ({why}); runs use the CPU"))

    # Precision support
    if cuda_ok and devices:
        # The launch's rule (capability ≥ 8.0), not is_bf16_supported(), which counts emulation.
        lacking = [f"cuda:{x['index']}" for x in devices if not bf16_native(x["capability"])]
        if lacking:
            rows.append(
                Check(
                    "bf16",
                    WARN,
                    f"not on {', '.join(lacking)} (capability below 8.0): precision auto "
                    "uses fp16 with a GradScaler there, and --precision bf16 is refused",
                )
            )
        else:
            rows.append(Check("bf16", PASS, f"supported on all {len(devices)} GPUs"))
        old = [f"cuda:{x['index']}" for x in devices if x["capability"][0] < 8]
        if old:
            rows.append(Check("tf32", SKIP, f"no TF32 below capability 8.0 ({', '.join(old)})"))
        else:
            rows.append(
                Check(
                    "tf32",
                    PASS,
                    "supported (capability ≥ 8.0); on when the profile sets hardware.tf32",
                )
            )
    else:
        rows.append(Check("bf16", SKIP, "no GPU (CPU runs train in fp32)"))
        rows.append(Check("tf32", SKIP, "no GPU"))

    # A matmul on every device against float64
    names = ["cpu"] + [f"cuda:{x['index']}" for x in devices]
    for m, dev in zip(d.get("matmul") or [], names, strict=False):
        name = f"matmul:{dev}"
        if m is None:
            rows.append(Check(name, FAIL, errors.get(name, "no answer")))
            continue
        err = m["rel_error"]
        text = f"float32 {m['n']}×{m['n']} against float64: max relative error {err:.1e}"
        if not math.isfinite(err) or err > MATMUL_FAIL:
            rows.append(Check(name, FAIL, text + " (wrong results: a faulty device or driver)"))
        elif err > MATMUL_WARN:
            rows.append(Check(name, WARN, text + " (TF32 is on, or the device is unwell)"))
        else:
            rows.append(Check(name, PASS, text))

    if d["gloo"]:
        rows.append(Check("gloo", PASS, "available"))
    else:
        rows.append(
            Check("gloo", WARN if cuda_ok else FAIL, "torch has no gloo backend (CPU runs need it)")
        )

    tr = d.get("torchrun")
    if tr is None:
        rows.append(Check("torchrun", FAIL, errors.get("torchrun", "no answer")))
    else:
        where = f"; torchrun on PATH: {tr['path']}" if tr.get("path") else "; no torchrun on PATH"
        rows.append(Check("torchrun", PASS, f"python -m {tr['module']} is ready{where}"))
        rows.append(_torchrun_flags_check())
    return rows, d


def _torchrun_flags_check() -> Check:
    """Which of launch's torchrun flags this torch lacks, and what does their job instead."""
    compat = launch.torchrun_compat()
    if compat["detection_error"]:
        return Check("torchrun flags", WARN, f"cannot ask torchrun: {compat['detection_error']}")
    dropped = compat["dropped"]
    if not dropped:
        return Check("torchrun flags", PASS, "every flag a launch passes is accepted")
    # Left out on purpose, each with its behaviour provided elsewhere: not a fault.
    missing = "; ".join(f"{flag}: {how}" for flag, how in dropped.items())
    return Check("torchrun flags", PASS, f"this torchrun lacks {missing}")


def _order_note(devices: list[dict[str, Any]]) -> str:
    """A warning when CUDA's device order is not NVML's (a rank would land on another GPU)."""
    if os.environ.get("CUDA_DEVICE_ORDER", "").upper() == "PCI_BUS_ID":
        return ""
    nvml_index = {u: i for i, u in nvml.uuids().items()}
    cuda_to_nvml = [nvml_index.get(x.get("uuid")) for x in devices]
    if None in cuda_to_nvml or cuda_to_nvml == sorted(cuda_to_nvml):
        return ""
    pairs = ", ".join(f"cuda:{c}=NVML {n}" for c, n in enumerate(cuda_to_nvml))
    return f"; CUDA order differs from NVML's ({pairs}); gpu-console names a run's GPUs by UUID"


def _collective_check(results: list[WorkerResult], backend: str, nvml_count: int) -> Check:
    failed = [r for r in results if not r.ok]
    if failed:
        # The first real failure, not a partner stopped because of it.
        first = next((r for r in failed if not r.detail.startswith("stopped:")), failed[0])
        return Check("collective", FAIL, f"{backend} all_reduce across 2 processes: {first.detail}")
    if not all(r.data.get("ok") for r in results):
        got = results[0].data.get("value")
        return Check(
            "collective",
            FAIL,
            f"{backend} all_reduce gave {got}, expected {results[0].data.get('expected')}",
        )
    median = max(r.data["median_s"] for r in results)
    text = (
        f"{backend} all_reduce across 2 processes: correct, {median * 1000:.2f} ms median "
        f"over {results[0].data['calls']} calls"
    )
    if nvml_count == 1:
        text += " (nccl needs 2 GPUs for this check)"
    return Check("collective", PASS, text)


def run_checks(runs_dir: Path, timeout: float = TIMEOUT_S) -> tuple[list[Check], dict[str, Any]]:
    """Every check, and the facts for the report block."""
    status = nvml.status()
    nvml_count = nvml.device_count()
    backend = "nccl" if nvml_count >= 2 else "gloo"
    port_row, port = check_port()
    groups = [[WORKER + ["info"]]]
    if port is not None:
        groups.append([WORKER + ["collective", str(r), "2", str(port), backend] for r in (0, 1)])
    # One thread per rank is plenty for a 1-element all_reduce and spares a small machine.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = run_workers(groups, timeout, env)

    rows = [Check("python", PASS, f"{platform.python_version()} ({sys.executable})")]
    torch_rows, info = _torch_checks(results[0][0], status, nvml_count)
    rows += torch_rows[:4]  # torch, cuda, cudnn, nccl
    if status.available:
        driver = f"driver {status.driver_version or '?'}"
        if status.cuda_driver_version:
            driver += f" (CUDA {status.cuda_driver_version})"
        rows.append(
            Check("nvml", PASS, f"{driver}, {nvml_count} GPU{'s' if nvml_count != 1 else ''}")
        )
    elif info.get("cuda_available"):
        rows.append(
            Check(
                "nvml",
                WARN,
                f"NVML unavailable: {status.reason}; device panels show CPU and RAM only",
            )
        )
    else:
        rows.append(Check("nvml", SKIP, f"NVML unavailable: {status.reason}"))
    rows += [r for r in torch_rows[4:] if not r.name.startswith("torchrun")]
    if port is not None:
        rows.append(_collective_check(results[1], backend, nvml_count))
    else:
        rows.append(Check("collective", SKIP, "no free port to rendezvous on"))
    rows += [r for r in torch_rows if r.name.startswith("torchrun")]
    host = host_summary()
    rows += [port_row, check_runs_dir(runs_dir), check_disk(runs_dir), check_host(host)]
    net_rows, net = network_checks()
    rows += net_rows
    rows.append(slurm_check())
    facts = {"status": status, "nvml_count": nvml_count, "info": info, "host": host}
    facts["network"] = net
    return rows, facts


def slurm_check(environ: dict[str, str] | None = None) -> Check:
    """The SLURM job a run launched here would belong to: its nodes and rendezvous (what
    ``launch.job_nodes`` would use, checked the same way), or that there is none."""
    from .. import slurm

    job = slurm.job(environ)
    if job is None:
        return Check("slurm", SKIP, "not in a SLURM job")
    where = f"job {job.job_id}: node {job.node_id} of {job.nnodes}"
    if job.restart_count:
        where += f", requeued {job.restart_count}×"
    where += f"; granted {slurm.grant_text(os.environ if environ is None else environ)}"
    try:
        slurm.check_one_console_per_node(job)
        if job.nnodes < 2:
            return Check("slurm", PASS, f"{where}; one node: the rendezvous is local")
        endpoint = slurm.head_endpoint(job)
    except slurm.SlurmError as e:
        return Check("slurm", WARN, f"{where}; {e}")
    return Check("slurm", PASS, f"{where}; rendezvous {endpoint} ({job.rdzv_id})")


def network_checks(environ: dict[str, str] | None = None) -> tuple[list[Check], dict[str, Any]]:
    """What the ranks' NCCL and gloo would meet here: the variables they inherit, the
    interfaces, whether each ``*_SOCKET_IFNAME`` names one, InfiniBand devices."""
    environ = dict(os.environ if environ is None else environ)
    env = network.inherited(environ)
    found = network.interfaces()
    ib = network.infiniband()
    shown = ", ".join(f"{k}={v}" for k, v in env.items())
    rows = [Check("network env", PASS, shown or "no NCCL_*, GLOO_* or TORCH_NCCL_* variable set")]
    ifaces = ", ".join(
        f"{i['name']} ({'up' if i['up'] else 'down'}"
        + (f", {' '.join(i['addresses'])})" if i["addresses"] else ")")
        for i in found
    )
    rows.append(Check("interfaces", PASS if found else WARN, ifaces or "none found"))
    good, bad = network.ifname_problems(environ, found)
    if bad:
        rows.append(Check("socket_ifname", WARN, "; ".join(bad + good)))
    elif good:
        rows.append(Check("socket_ifname", PASS, "; ".join(good)))
    else:
        rows.append(Check("socket_ifname", SKIP, "none set: NCCL and gloo choose an interface"))
    ports = [
        f"{d['device']} port {p['port']} {p['state'] or 'state unreadable'}"
        for d in ib
        for p in d["ports"]
    ] or [f"{d['device']} (no port)" for d in ib]
    rows.append(Check("infiniband", PASS if ib else SKIP, ", ".join(ports) or "none"))
    return rows, {"env": env, "interfaces": found, "infiniband": ib}


def report(rows: list[Check], facts: dict[str, Any]) -> str:
    """A block to paste into a bug report: versions and the verdicts, nothing private."""
    info, status, host = facts["info"], facts["status"], facts["host"]
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, WARN, FAIL, SKIP)}
    gpus = (
        ", ".join(
            f"{d['name']} ({d['capability'][0]}.{d['capability'][1]})"
            for d in info.get("devices") or []
        )
        or "none visible to torch"
    )
    lines = [
        f"gpu-console {__version__} on {platform.platform()}",
        f"python {platform.python_version()}, torch {info.get('torch', '?')}, "
        f"CUDA {info.get('cuda_build') or 'none'}, cuDNN {info.get('cudnn') or 'none'}, "
        f"NCCL {info.get('nccl') or 'none'}",
        "NVML: "
        + (
            f"driver {status.driver_version}, {facts['nvml_count']} GPUs"
            if status.available
            else f"unavailable: {status.reason}"
        ),
        f"GPUs: {gpus}",
        f"host: {host['cores']} cores, {host['ram_total'] / GIB:.1f} GiB RAM",
        _network_line(facts.get("network") or {}),
        "checks: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
    ]
    lines += [f"{r.status} {r.name}: {r.detail}" for r in rows if r.status in (FAIL, WARN)]
    return "\n".join(lines)


def _network_line(net: dict[str, Any]) -> str:
    """The variables, the interfaces' names and InfiniBand: no address (nothing private)."""
    env = ", ".join(f"{k}={v}" for k, v in (net.get("env") or {}).items()) or "no variable set"
    names = ", ".join(i["name"] for i in net.get("interfaces") or []) or "none"
    ib = ", ".join(d["device"] for d in net.get("infiniband") or []) or "none"
    return f"network: {env}; interfaces {names}; InfiniBand {ib}"


_STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def render(rows: list[Check], facts: dict[str, Any], text: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in rows:
        table.add_row(f"[{_STYLE[r.status]}]{r.status}[/]", r.name, escape(r.detail))
    console.print(table)
    status = facts["status"]
    if not status.available:
        console.print(
            f"\nNVML is unavailable: {escape(status.reason)}. GPU checks are skipped; "
            "runs use the CPU."
        )
    fails = [r.name for r in rows if r.status == FAIL]
    console.print(
        "\n"
        + (
            f"{len(fails)} check(s) failed: {', '.join(fails)}."
            if fails
            else "Ready: no check failed."
        )
    )
    console.print("\nReport (paste into a bug report):\n```")
    console.print(escape(text), soft_wrap=True)
    console.print("```")


def main(as_json: bool, runs_dir: Path, timeout: float = TIMEOUT_S) -> int:
    rows, facts = run_checks(runs_dir, timeout)
    text = report(rows, facts)
    if as_json:
        doc = {
            "checks": [asdict(r) for r in rows],
            "ok": not any(r.status == FAIL for r in rows),
            "report": text,
            "network": facts["network"],  # the variables, the interfaces, InfiniBand
        }
        print(strict_json.dumps(doc, indent=2))
    else:
        render(rows, facts, text)
    return 1 if any(r.status == FAIL for r in rows) else 0
