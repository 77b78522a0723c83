"""CPU benchmark of the fused norm-then-add ops against the unfused ops they replace, in one run.

    python benchmarks/bench_norm_add.py                         # decode and bandwidth sizes, fp32 and bf16, RMSNorm
    python benchmarks/bench_norm_add.py --shapes 4096x4096 --dtypes bf16 --out ''
    python benchmarks/bench_norm_add.py --device cuda --out results/gpu/norm_add.json   # the triton backend

Bytes are counted by hand per op, per element of the (M, N) rows (w is N elements and ignored), s = bytes per
element: whoever computes it, an op moves at least

    norm_add        h = residual + N(y)                 reads y, residual; writes h              3 * M * N * s
    norm_add_norm   h = residual + N1(y); out = N2(h)   reads y, residual; writes h, out         4 * M * N * s
    stream          torch.add(y, r, out=h)              reads y, r; writes h                     3 * M * N * s

and every contender of an op is credited with that op's bytes (the unfused ones move more: norm_add's composition
writes N(y) and reads it back, five transfers; the chain's, seven). GB/s is those bytes over the best time; "of
stream" divides by the GB/s of ``stream`` (preallocated, the streaming limit: one read-read-write pass) measured in
the same run for the same dtype and shape. The stream is timed alternately with every contender (one stream sample
before each contender sample, same threads, same arrays), and its row is the best and median of all those samples:
on a shared machine whose speed drifts over seconds, a reference timed once at the start and an op timed seconds
later compared two different machines (bf16 in-place norm_add read 71-74% in such runs against 92-99% in
alternating A/Bs); the pooled reference also has the most samples, so its best is never slower. That makes "of
stream" a biased ratio: the least of ten times as many samples of a noisy time is lower than the least of one
contender's. So each row also compares a contender with its own stream samples only, as many as its own and each
taken just before one of them: "paired best" divides the two bests, "paired median" is the median over the pairs of
(stream time / contender time) x (the op's transfers / 3), which a drift over seconds moves least. Contenders, per op:

    fused            the public op, backend=backend (allocates its outputs)
    fused kernel     the same kernel writing into preallocated outputs: no page faults of fresh outputs
    fused in-place   norm_add_ / norm_add_norm_ (serving): h into residual (and N2(h) into y), nothing allocated
    unfused cpu      the composition on the same backend: add_rms_norm(y, backend=backend), PyTorch's add (and
                     add_rms_norm(h, backend=backend))
    plain PyTorch    residual + F.rms_norm(y) (and F.rms_norm(h)): eager PyTorch

With ``--device cuda`` the backend is ``triton`` (the rows say "unfused triton") and every timed call ends with a
torch.cuda.synchronize(), so a decode-size row is the whole call's latency, host included.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu import _cpu_name, _threading_layer, parse_shapes  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_SHAPES = "1x4096,8x4096,4096x4096"


def _time_alternating(fn, ref, reps: int, sync=None) -> tuple[list[float], list[float]]:
    """Seconds per call of fn and of ref, sampled alternately (ref, fn, ref, fn, ...), after one warm-up call of
    each; calls are repeated inside a sample for tiny ones (timer resolution), as bench_cpu._time does."""
    calls = [f if sync is None else (lambda f=f: (f(), sync())) for f in (ref, fn)]
    inner = []
    for f in calls:
        f()
        t0 = time.perf_counter()
        f()
        inner.append(max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-7))))  # each sample at least ~2 ms
    samples = ([], [])
    for _ in range(max(2, reps)):
        for f, k, out in zip(calls, inner, samples):
            t0 = time.perf_counter()
            for _ in range(k):
                f()
            out.append((time.perf_counter() - t0) / k)
    return samples[1], samples[0]


def run(shapes, dtypes, reps: int, device: str = "cpu") -> tuple[list[dict], dict]:
    import torch
    import torch.nn.functional as F

    from addnorm.ops.add_norm import add_rms_norm
    from addnorm.ops.norm_add import norm_add, norm_add_, norm_add_norm, norm_add_norm_
    from addnorm.ops.norm_add_ops import fused_module

    backend = "cpu" if device == "cpu" else "triton"
    norm_add_launch = fused_module(backend)
    unfused = f"unfused {backend}"
    sync = torch.cuda.synchronize if device == "cuda" else None
    loadavg_before = os.getloadavg()
    eps = 1e-6
    opts = dict(eps1=eps, eps2=eps, is_rms1=True, is_rms2=True, zc1=False, zc2=False, cast1=False, cast2=False)
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, DTYPES[dname])
        s = torch.finfo(dtype).bits // 8
        for m, n in shapes:
            torch.manual_seed(0)
            y, r = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
            w1, w2 = torch.randn(n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
            h_pre, o_pre = torch.empty_like(y), torch.empty_like(y)
            stats = torch.empty((4, m), dtype=torch.float32, device=device)
            elems = m * n

            ref_samples = []  # the stream's samples, taken alternately with every contender's

            def stream_call():
                torch.add(y, r, out=h_pre)

            def make_row(op, name, samples, transfers, ref=None):
                best, med = min(samples), statistics.median(samples)
                nbytes = transfers * elems * s
                row = dict(dtype=dname, m=m, n=n, op=op, contender=name, us=best * 1e6,
                           median_us=med * 1e6, gbps=nbytes / best / 1e9)  # fmt: skip
                if ref is not None:  # its own stream samples: as many as its own, each taken just before one of them
                    row["paired_best"] = transfers / 3 * min(ref) / best
                    row["paired_median"] = statistics.median(transfers / 3 * a / b for a, b in zip(ref, samples))
                return row

            def add(op, name, fn, transfers):
                timed, ref = _time_alternating(fn, stream_call, reps, sync)
                ref_samples.extend(ref)
                rows.append(make_row(op, name, timed, transfers, ref))

            with torch.no_grad():
                first = len(rows)

                def unfused_norm_add(y, r):
                    return r + add_rms_norm(y, None, w1, eps, backend=backend)[0]

                def plain_norm_add(y, r):
                    return r + F.rms_norm(y, (n,), w1, eps)

                yi, ri = y.clone(), r.clone()  # overwritten at every call
                add("norm_add", "fused", lambda: norm_add(y, r, w1, None, eps, backend=backend), 3)
                add("norm_add", "fused kernel", lambda: norm_add_launch.forward_into(
                    h_pre, None, stats, y, r, w1, None, None, None, has_norm2=False, **opts), 3)  # fmt: skip
                add("norm_add", "fused in-place", lambda: norm_add_(yi, ri, w1, None, eps, backend=backend), 3)
                add("norm_add", unfused, lambda: unfused_norm_add(y, r), 3)
                add("norm_add", "plain PyTorch", lambda: plain_norm_add(y, r), 3)

                def unfused_chain(y, r):
                    h = unfused_norm_add(y, r)
                    return add_rms_norm(h, None, w2, eps, backend=backend)[0], h

                def plain_chain(y, r):
                    h = plain_norm_add(y, r)
                    return F.rms_norm(h, (n,), w2, eps), h

                yi, ri = y.clone(), r.clone()
                add(
                    "norm_add_norm",
                    "fused",
                    lambda: norm_add_norm(y, r, w1, w2, None, None, eps, eps, backend=backend),
                    4,
                )
                add("norm_add_norm", "fused kernel", lambda: norm_add_launch.forward_into(
                    h_pre, o_pre, stats, y, r, w1, None, w2, None, has_norm2=True, **opts), 4)  # fmt: skip
                add("norm_add_norm", "fused in-place", lambda: norm_add_norm_(
                    yi, ri, w1, w2, None, None, eps, eps, backend=backend), 4)  # fmt: skip
                add("norm_add_norm", unfused, lambda: unfused_chain(y, r), 4)
                add("norm_add_norm", "plain PyTorch", lambda: plain_chain(y, r), 4)
            rows.insert(first, make_row("stream", "torch.add(out=)", ref_samples, 3))
            yi = ri = None

    stream = {(row["dtype"], row["m"], row["n"]): row["gbps"] for row in rows if row["op"] == "stream"}
    for row in rows:
        row["of_stream"] = row["gbps"] / stream[(row["dtype"], row["m"], row["n"])]
    import numba

    env = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        command=" ".join(["python", *sys.argv]),
        cpu=_cpu_name(),
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        numba=numba.__version__,
        numba_threading_layer=_threading_layer(),
        torch=torch.__version__,
        python=platform.python_version(),
        loadavg_before=loadavg_before,
        loadavg_after=os.getloadavg(),
    )
    return rows, env


def markdown(rows: list[dict], env: dict) -> str:
    load = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
    lines = [
        f"{env['date']} - {env['device']}; {env['cpu']}, {env['cores']} cores, torch threads {env['torch_threads']}, numba "
        f"{env['numba']} ({env['numba_threading_layer']}), torch {env['torch']}; load average before "
        f"{load(env['loadavg_before'])}, after {load(env['loadavg_after'])}",
        "",
        "| dtype | M x N | op | contender | best us | median us | GB/s | of stream | paired best | paired median "
        "| vs unfused |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pct = lambda r, k: f"{r[k]:.0%}" if k in r else ""  # noqa: E731
    unfused = {(r["dtype"], r["m"], r["n"], r["op"]): r["us"] for r in rows if r["contender"].startswith("unfused")}
    for r in rows:
        base = unfused.get((r["dtype"], r["m"], r["n"], r["op"]))
        speedup = f"{base / r['us']:.2f}x" if base else ""
        lines.append(
            f"| {r['dtype']} | {r['m']}x{r['n']} | {r['op']} | {r['contender']} | {r['us']:.1f} | "
            f"{r['median_us']:.1f} | {r['gbps']:.2f} | {r['of_stream']:.0%} | {pct(r, 'paired_best')} | "
            f"{pct(r, 'paired_median')} | {speedup} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES), help=DEFAULT_SHAPES)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of fp32,bf16 (default fp32,bf16)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (numba) or cuda (triton)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per row; best and median reported")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "norm_add.json"),
                   help="JSON file of the rows and environment ('' writes nothing)")  # fmt: skip
    a = p.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in DTYPES]:
        p.error(f"--dtypes must be among {', '.join(DTYPES)}; got {', '.join(bad)}")
    rows, env = run(a.shapes, dtypes, max(1, a.reps), a.device)
    if a.out:
        import json

        Path(a.out).write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
