"""What a lab run records about the machine and software it ran on (``meta`` in results.json, the "Machine" and
"Software" lines of the results page).

High-LR training runs can differ in their last digits between machines (docs/lab-results.md says why), so the
record names the machine as precisely as the OS lets it: some virtual machines report only a vendor's family
name as the CPU model ("AMD EPYC"), which says nothing of the microarchitecture; the CPUID family, model and
stepping do, and the instruction set PyTorch's CPU kernels were dispatched to (AVX2, AVX512, ...) decides which
reduction code ran.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

from addnorm.lab import cache

__all__ = ["cpu_model", "run_meta"]


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name and, where /proc/cpuinfo gives them, its CPUID family, model and stepping, e.g.
    "AMD EPYC (family 25, model 1, stepping 1)"; else what platform knows. ``cpuinfo``: the text of
    /proc/cpuinfo (read from the file when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if ":" not in line:
            if fields:  # the first processor's block ends at its blank line
                break
            continue
        key, value = (part.strip() for part in line.split(":", 1))
        fields.setdefault(key.lower(), value)
    name = fields.get("model name") or fields.get("hardware") or fields.get("cpu model")
    if not name:
        return platform.processor() or platform.machine() or "unknown"
    ids = [
        f"{label} {fields[key]}"
        for key, label in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
        if fields.get(key)
    ]
    return f"{name} ({', '.join(ids)})" if ids else name


def run_meta(options: Any, device: torch.device, *, jobs: int = 1, world_size: int = 1) -> dict[str, Any]:
    """The ``meta`` of a run's results.json: what produced it (sources, software, machine) and how it was run
    (``options``: the run's :class:`~addnorm.lab.runner.RunOptions`)."""
    import addnorm

    return {
        "addnorm": addnorm.__version__,
        "code": cache.package_digest(),  # which sources produced the results (merge refuses to mix two)
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        # the instruction set ATen's CPU kernels dispatch to: it decides which vectorized reductions ran
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": options.quick,
        "seed": options.seed,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "jobs": jobs,
        "world_size": world_size,
        "shard": f"{options.shard[0]}/{options.shard[1]}" if options.shard else None,
        "only": list(options.only) if options.only else None,
        "suite": options.suite,
        "engine": options.engine,
    }
