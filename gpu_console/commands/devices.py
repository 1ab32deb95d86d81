"""``gpu-console devices [--json]``: the GPUs as NVML sees them, or why it cannot.

A one-shot view in the spirit of gpustat: memory bar, utilisation, temperature, power and
processes per GPU, with GPUs that look busy marked so a person can pick free ones. Without
NVML it says why and shows what a run would use instead (CPU cores and RAM).
"""

from __future__ import annotations

from typing import Any

from .. import strict_json
from ..telemetry import nvml
from ..telemetry.host import host_summary

# A GPU looks busy when something else may be using it: a process is listed (processes of
# other containers are not, but their memory and utilisation still show).
BUSY_UTIL_PERCENT = 10
BUSY_MEMORY_FRACTION = 0.10
GIB = 1024**3


def busy_reasons(gpu: dict[str, Any]) -> list[str]:
    if gpu.get("lost"):
        return ["lost: the GPU stopped answering"]
    reasons = []
    procs = gpu.get("processes") or []
    if procs:
        reasons.append(f"{len(procs)} process{'es' if len(procs) != 1 else ''}")
    util = gpu.get("util_gpu")
    if isinstance(util, int) and util >= BUSY_UTIL_PERCENT:
        reasons.append(f"util {util}%")
    used, total = gpu.get("memory_used"), gpu.get("memory_total")
    share = used / total if isinstance(used, int) and isinstance(total, int) and total else 0
    if share >= BUSY_MEMORY_FRACTION:
        reasons.append(f"memory {share:.0%}")
    return reasons


def collect() -> dict[str, Any]:
    """The ``--json`` document: ``{"gpus": [...], "grant": {...}, "nvml": {...}, "host": {...}}``.

    Each GPU's ``yours`` says whether the environment grants it (a run never uses one that
    is not); ``grant`` says which variable decided, and why it could not be read, if so.
    """
    from ..devices import read_grant

    status = nvml.status()
    samples = [s.to_json() for s in nvml.sample_gpus()]
    grant = read_grant(samples)
    gpus = []
    for gpu in samples:
        reasons = busy_reasons(gpu)
        gpu["busy"] = bool(reasons)
        gpu["busy_reasons"] = reasons
        gpu["yours"] = grant.owns(gpu["index"])
        gpus.append(gpu)
    return {
        "gpus": gpus,
        "grant": {
            "source": grant.source,
            "value": grant.value,
            "gpus": sorted(grant.indices),
            "mig": [g.token for g in grant.gpus if g.index is None],
            "problem": grant.problem or None,
        },
        "nvml": {
            "available": status.available,
            "reason": status.reason,
            "driver_version": status.driver_version or None,
            "cuda_driver_version": status.cuda_driver_version or None,
            "device_count": len(gpus),
        },
        "host": host_summary(),
    }


def _gib(n: Any) -> str:
    return f"{n / GIB:.1f}" if isinstance(n, int) else "?"


def _bar(used: Any, total: Any, width: int = 10) -> str:
    if not (isinstance(used, int) and isinstance(total, int) and total):
        return "[" + "?" * width + "]"
    filled = round(width * min(used / total, 1.0))
    return "[" + "█" * filled + "░" * (width - filled) + "]"


def _na(value: Any, fmt: str = "{}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _short_name(name: Any) -> str:
    name = str(name or "?").removeprefix("NVIDIA ")
    return name if len(name) <= 18 else name[:17] + "…"


def gpu_lines(gpu: dict[str, Any], name_width: int, state_width: int = 4) -> list[str]:
    """Rich markup: one line of readings, then one of why it is busy and who holds it."""
    name = _short_name(gpu["name"]).ljust(name_width)
    if gpu["lost"]:
        return [f"{gpu['index']:>2} [red]lost[/]  {name}  stopped answering (needs a GPU reset)"]
    if not gpu.get("yours", True):
        state = "[dim]not yours[/]"  # a run never uses it; its readings are still shown
    else:
        state = "[yellow]busy[/]" if gpu["busy"] else "[green]free[/]"
        state += " " * (state_width - 4)
    memory = f"{_gib(gpu['memory_used']):>4}/{_gib(gpu['memory_total'])} GiB"
    power = "n/a"
    if gpu["power_w"] is not None or gpu["power_limit_w"] is not None:
        power = f"{_na(gpu['power_w'], '{:.0f}')}/{_na(gpu['power_limit_w'], '{:.0f}')} W"
    lines = [
        f"{gpu['index']:>2} {state}  {name}  {_bar(gpu['memory_used'], gpu['memory_total'])} "
        f"{memory:<14} {_na(gpu['util_gpu'], '{}%'):>4}  {_na(gpu['temperature_c'], '{}°C'):>5}"
        f"  {power:>9}"
    ]
    procs = gpu["processes"]
    # Listed pids say "N processes" better than the count does.
    detail = [r for r in gpu["busy_reasons"] if not (procs and "process" in r)]
    if procs:
        detail.append(
            "pids "
            + ", ".join(
                f"{p['pid']} ({_gib(p['used_memory'])} GiB)"
                if p["used_memory"] is not None
                else str(p["pid"])
                for p in procs
            )
        )
    elif procs is None:
        detail.append("processes n/a")
    if detail:
        lines.append("        " + "; ".join(detail))
    return lines


def render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    host = doc["host"]
    host_line = (
        f"host: {host['cores']} cores ({host['physical_cores']} physical), "
        f"RAM {_gib(host['ram_used'])} / {_gib(host['ram_total'])} GiB used, "
        f"CPU {host['cpu_percent']:.0f}%, load {host['load_1m']}"
    )
    status = doc["nvml"]
    if not status["available"]:
        console.print(f"NVML unavailable: {status['reason']}.")
        console.print("No GPU can be used here; runs use the CPU (--devices cpu or cpu:N).")
        console.print(host_line)
        return
    head = f"NVIDIA driver {status['driver_version'] or '?'}"
    if status["cuda_driver_version"]:
        head += f", CUDA {status['cuda_driver_version']}"
    n = len(doc["gpus"])
    console.print(f"{head}, {n} GPU{'s' if n != 1 else ''}")
    if not doc["gpus"]:
        console.print("NVML works but sees no GPU; runs use the CPU (--devices cpu or cpu:N).")
        console.print(host_line)
        return
    width = max(len(_short_name(g["name"])) for g in doc["gpus"])
    state_width = 4 if all(g.get("yours", True) for g in doc["gpus"]) else len("not yours")
    for gpu in doc["gpus"]:
        for line in gpu_lines(gpu, width, state_width):
            console.print(line)
    grant = doc["grant"]
    if grant["problem"]:
        console.print(f"[red]{escape(grant['problem'])}[/]")
    elif grant["source"]:
        yours = ",".join(map(str, grant["gpus"])) or "none"
        mig = f" and MIG {', '.join(grant['mig'])}" if grant["mig"] else ""
        console.print(
            f"{grant['source']}={escape(grant['value'])} grants GPU {yours}{escape(mig)} "
            "(--devices takes the numbers shown)"
        )
    console.print(host_line)


def main(as_json: bool = False) -> int:
    doc = collect()
    if as_json:
        print(strict_json.dumps(doc, indent=2))
    else:
        render(doc)
    return 0
