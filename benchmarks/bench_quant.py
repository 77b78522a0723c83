"""Add + RMSNorm + FP8 quantization: addnorm's fused op against the unfused pipelines, and the streaming limit.

    python benchmarks/bench_quant.py                                  # CPU, bf16 in, e4m3 out, default shapes
    python benchmarks/bench_quant.py --device cuda --backend triton   # a GPU (sm_89+ for FP8)
    python benchmarks/bench_quant.py --modes static,token,group --shapes 4096x4096 --out ''

Bytes are counted by hand, per element of the (M, N) input, s = bytes of the activation dtype (2 for bf16); the
weight (N elements) and the scales (M or M * N / 128 floats) are ignored:

    the op        reads x, residual; writes residual_out (s each) and q (1 byte)        (3s + 1) * M * N
    stream        torch.add(x, r, out=h), preallocated: one read-read-write pass          3s * M * N

GB/s is the op's bytes over the median time, for every contender alike (what it would move if it were fused:
an unfused pipeline moves more, 5s + 1 with the bf16 output written and read again, and shows as slower), and
"of stream" divides it by the streaming limit's GB/s measured in the same run.

Contenders (all produce q, residual_out and the scales; the scale is static, per token, or per 1 x 128 group):

    fused        addnorm.add_rms_norm_quant(x, r, w, ...)                           (--backend, cpu by default)
    unfused      addnorm.add_rms_norm(x, r, w) then a PyTorch quantize of its bf16 output
    eager        h = x + r; y = F.rms_norm(h.float(), w); quantize(y), plain PyTorch
    compiled     torch.compile(eager) (inductor; compiled once per shape and mode)

Timing interleaves the contenders round-robin (each repetition times every contender once, in turn), so a busy
shared machine slows all of them alike; the median and the spread (25th to 75th percentile) are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import addnorm

ROOT = Path(__file__).resolve().parents[1]
QMAX = 448.0
MIN_SCALE = 1.0 / (QMAX * 512.0)


def quantize_torch(y: torch.Tensor, mode: str, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager quantize step: FP8 e4m3 codes and scales of float y (multiply by 1 / scale, saturate, round)."""
    y = y.float()
    if mode == "static":
        s = scale
        inv = 1.0 / scale
    else:
        m, n = y.shape
        g = n if mode == "token" else 128
        s = (y.view(m, n // g, g).abs().amax(-1) / QMAX).clamp(min=MIN_SCALE)
        inv = (1.0 / s).repeat_interleave(g, -1)
    return (y * inv).clamp(-QMAX, QMAX).to(torch.float8_e4m3fn), s


def eager(x, r, w, scale, mode: str):
    h = x + r
    y = F.rms_norm(h.float(), (x.shape[-1],), w.float(), 1e-6)
    q, s = quantize_torch(y, mode, scale)
    return q, h, s


def contenders(x, r, w, scale, mode: str, backend: str, compiled) -> dict:
    kw = dict(scale=scale) if mode == "static" else dict(group_size=128) if mode == "group" else {}

    def fused():
        return addnorm.add_rms_norm_quant(x, r, w, 1e-6, backend=backend, **kw)

    def unfused():
        out, h = addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend)
        return (*quantize_torch(out, mode, scale), h)

    fns = {"fused": fused, "unfused": unfused, "eager": lambda: eager(x, r, w, scale, mode)}
    if compiled is not None:
        fns["compiled"] = lambda: compiled(x, r, w, scale, mode)
    return fns


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(fns: dict, device, reps: int, warmup: int = 3) -> dict[str, list[float]]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def _quartiles(v: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(v, n=4)
    return q[0], statistics.median(v), q[2]


def run(args) -> tuple[list[dict], dict]:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    s = torch.finfo(dtype).bits // 8
    compiled = None if args.no_compile else torch.compile(eager, dynamic=False)
    rows = []
    for m, n in args.shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
        r = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)
        scale = torch.tensor([0.02], device=device)
        h = torch.empty_like(x)
        op_bytes = (3 * s + 1) * m * n
        for mode in args.modes:
            fns = {"stream": lambda: torch.add(x, r, out=h)}
            fns.update(contenders(x, r, w, scale, mode, args.backend, compiled))
            times = time_round_robin(fns, device, args.reps)
            stream_gbs = 3 * s * m * n / statistics.median(times["stream"]) / 1e9
            for name, t in times.items():
                lo, med, hi = _quartiles(t)
                nbytes = 3 * s * m * n if name == "stream" else op_bytes
                gbs = nbytes / med / 1e9
                rows.append(
                    dict(
                        shape=f"{m}x{n}",
                        mode=mode,
                        contender=name,
                        median_ms=round(med * 1e3, 4),
                        p25_ms=round(lo * 1e3, 4),
                        p75_ms=round(hi * 1e3, 4),
                        bytes=nbytes,
                        gb_s=round(gbs, 2),
                        of_stream=round(gbs / stream_gbs, 3),
                    )
                )
                print(f"{m}x{n} {mode:6s} {name:9s} {med * 1e3:9.3f} ms  {gbs:7.2f} GB/s  {gbs / stream_gbs:5.2f}")
    env = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_avg=[round(v, 2) for v in os.getloadavg()],
        torch=torch.__version__,
        python=platform.python_version(),
        backend=args.backend,
        dtype=args.dtype,
        reps=args.reps,
    )
    return rows, env


def markdown(rows: list[dict], env: dict, note: str) -> str:
    lines = [
        "# Add + RMSNorm + FP8 (e4m3) quantization: fused vs unfused",
        "",
        f"`python benchmarks/bench_quant.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()),
        "",
        note,
        "",
        "| shape | mode | contender | median ms | p25-p75 ms | GB/s (op bytes) | of stream |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['mode']} | {r['contender']} | {r['median_ms']:.3f} | "
            f"{r['p25_ms']:.3f}-{r['p75_ms']:.3f} | {r['gb_s']:.2f} | {r['of_stream']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        m, _, n = item.partition("x")
        if not (m.isdigit() and n.isdigit()) or int(n) % 128:
            raise argparse.ArgumentTypeError(f"shapes are MxN with N a multiple of 128, got {item!r}")
        out.append((int(m), int(n)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default=None, help="addnorm backend of fused/unfused (cpu on CPU, triton on CUDA)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--shapes", type=_shapes, default=_shapes("256x4096,2048x4096,512x8192"))
    p.add_argument("--modes", type=lambda t: t.split(","), default=["static", "token", "group"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile contender")
    p.add_argument("--note", default="", help="a line for the results file (e.g. that the machine was shared)")
    p.add_argument("--out", default="benchmarks/results/quant_cpu", help="PATH (.md and .json written); '' for none")
    args = p.parse_args(argv)
    args.backend = args.backend or ("triton" if args.device == "cuda" else "cpu")
    bad = [m for m in args.modes if m not in ("static", "token", "group")]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from static, token, group")
    rows, env = run(args)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(markdown(rows, env, args.note))
        out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
