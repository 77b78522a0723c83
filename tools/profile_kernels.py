"""Which GPU kernels one call launches, and how long each runs: the breakdown behind a row of the benchmark table.

    python tools/profile_kernels.py                                  # bf16 add + RMSNorm, 16384 x 4096, fwd and bwd
    python tools/profile_kernels.py --shapes 65536x1024,1024x65536 --providers addnorm,eager,liger

For each (shape, mode, provider) it runs the benchmark's own provider function (``bench_add_norm.make_provider``,
same inputs and cotangents) under ``torch.profiler`` for a few calls and prints every device kernel with its
launches per call and mean duration, then the device time per call against the wall time per call. A call whose
device time is far below its wall time is host-bound; a kernel that is not the fused one (a copy, a fill, the dw
reduction) shows what else the call pays for. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmark's own timing code
import bench_add_norm as bench  # noqa: E402


def _shape(text: str) -> tuple[int, int]:
    m, _, n = text.partition("x")
    return int(m), int(n)


def profile_one(provider: str, mode: str, m: int, n: int, dtype: torch.dtype, calls: int) -> list[str]:
    fn = bench.make_provider(provider, "rms", 1e-6, n, dtype, "cuda")
    grad = mode == "bwd"
    x, r = (torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(2))
    w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=grad)
    dout, dres = torch.randn(m, n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=dtype)

    def call():
        if not grad:
            with torch.no_grad():
                return fn(x, r, w, None)
        bench._grads(fn(x, r, w, None), {"x": x, "residual": r, "weight": w}, dout, dres)  # the forward's too

    for _ in range(3):  # JIT and allocator warm-up
        call()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6 / calls
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels[e.name].append(e.device_time)
    total = sum(sum(v) for v in kernels.values()) / calls
    lines = [
        f"{provider:8} {'fwd' if not grad else 'fwd+bwd':8} {m}x{n}: device {total:8.1f} us/call, "
        f"wall {wall_us:8.1f} us/call"
    ]
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"    {len(times) / calls:4.1f} x {sum(times) / len(times):8.1f} us  {name[:110]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16384x4096,65536x1024", help="comma-separated MxN")
    p.add_argument("--providers", default="addnorm,eager,liger", help="comma-separated, as in bench_add_norm.py")
    p.add_argument("--modes", default="fwd,bwd", help="fwd (no grad) and/or bwd (forward + backward)")
    p.add_argument("--dtype", default="bf16", choices=sorted(bench.DTYPES))
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the profile is of device kernels)")
    for shape in a.shapes.split(","):
        m, n = _shape(shape)
        for mode in a.modes.split(","):
            for provider in a.providers.split(","):
                try:
                    print("\n".join(profile_one(provider, mode, m, n, bench.DTYPES[a.dtype], a.calls)), flush=True)
                except Exception as e:  # noqa: BLE001 - a missing provider must not end the run
                    print(f"{provider:8} {mode:8} {m}x{n}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
