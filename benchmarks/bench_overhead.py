"""Per-call overhead of each backend at decode sizes, where the host's Python, not memory, sets the time.

    python benchmarks/bench_overhead.py                    # CPU: 8x64 and 8x4096, writes results/overhead.{md,json}
    python benchmarks/bench_overhead.py --device cuda      # a GPU: the triton rows too (host time per call)
    python benchmarks/bench_overhead.py --json --out ''    # rows on stdout, nothing written
    python benchmarks/bench_overhead.py --triton-python-only   # CPU: + the Triton route with no-op kernels

The ``--triton-python-only`` rows ("... triton (no-op kernels)") run the Triton backend's whole Python path, every
launch included, on CPU tensors with each kernel launch replaced by a call that does nothing: what a GPU's host
pays around Triton's own launcher (which is not addnorm's to cut), measured without a GPU.

Each row is the best (and median) wall time of one call, calls repeated back to back; on CUDA the device is
synchronized once per sample, so the number is what the host spends issuing the call (the kernels of an 8-row
call take a few microseconds). "x eager" divides by the baseline in the same run:

    eager            h = x + r; out = F.rms_norm(h, ...)        two torch ops, what the fused call replaces
    addnorm <b>      out, h = addnorm.add_rms_norm(x, r, w, backend=b)
    in-place <b>     addnorm.add_rms_norm_(x, r, w, backend=b)  (serving: nothing allocated on cpu/triton)
    kernel <b>       the backend's forward_into on preallocated outputs: the launch with no API around it

Modes: "inference" runs under torch.inference_mode (what serving does); "train" has inputs that require grad, so
the forward also builds its autograd node. The machine's load average is recorded before and after: on a shared
machine every number is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

DEFAULT_SHAPES = ((8, 64), (8, 4096))
TARGET = 3.0  # issue 15: the kernel route's call at most 3x eager's two ops


def _time(fn, sync, reps: int, inner: int) -> tuple[float, float]:
    for _ in range(max(10, inner // 10)):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return min(samples), statistics.median(samples)


@contextlib.contextmanager
def _noop_launches(active: bool):
    """While active, the triton backend's launches are no-ops (its Python runs in full): --triton-python-only."""
    if not active:
        yield
        return
    from addnorm.ops.triton import launch as T

    class NoLaunch:
        def __getitem__(self, grid):  # kernel[grid](*args, **meta): a call that does nothing
            return lambda *args, **kwargs: None

    real, no_launch = T._kernel, NoLaunch()
    T._kernel = lambda kernel, traceable: no_launch
    try:
        yield
    finally:
        T._kernel = real


def run(device: str, shapes, reps: int, inner: int, triton_python_only: bool = False) -> tuple[list[dict], dict]:
    import torch
    import torch.nn.functional as F

    import addnorm
    from addnorm.ops.backends import kernel_module, unavailable_reason

    torch.set_num_threads(1)  # decode-size calls: one thread, no pool wake-ups in the numbers
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    backends = [b for b in ("torch", "reference", "cpu", "triton") if unavailable_reason(b, dev) is None]
    if dev.type == "cpu" and "triton" in backends and not triton_python_only:
        backends.remove("triton")  # Triton's interpreter: its cost is the interpreter, not addnorm's overhead
    label = lambda b: f"{b} (no-op kernels)" if b == "triton" and triton_python_only else b  # noqa: E731
    load_before = os.getloadavg()
    rows = []
    for m, n in shapes:
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(m, n, generator=g).to(dev) for _ in range(2)] + [torch.randn(n, generator=g).to(dev)]
        for mode in ("inference", "train"):
            x, r, w = (t.clone().requires_grad_(mode == "train") for t in base)
            ctx = torch.inference_mode if mode == "inference" else torch.enable_grad

            def eager():
                return F.rms_norm(x + r, (n,), w, 1e-6)

            cases = [("eager", eager)]
            for b in backends:
                cases.append((f"addnorm {label(b)}", lambda b=b: addnorm.add_rms_norm(x, r, w, 1e-6, backend=b)))
            if mode == "inference":
                xi, ri = base[0].clone(), base[1].clone()
                for b in backends:
                    cases.append(
                        (f"in-place {label(b)}", lambda b=b: addnorm.add_rms_norm_(xi, ri, w, 1e-6, backend=b))
                    )
                out, res, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(m, device=dev)
                for b in backends:
                    mod = kernel_module(b) if b in ("cpu", "triton") else None
                    if mod is not None and hasattr(mod, "forward_into"):
                        cases.append(
                            (
                                f"kernel {label(b)}",
                                lambda mod=mod: mod.forward_into(
                                    out,
                                    res,
                                    None,
                                    rstd,
                                    x,
                                    r,
                                    w,
                                    None,
                                    eps=1e-6,
                                    is_rms=True,
                                    dropout_p=0.0,
                                    seed=None,
                                    zero_centered_weight=False,
                                ),
                            )
                        )
            with ctx(), _noop_launches(triton_python_only):
                times = {name: _time(fn, sync, reps, inner) for name, fn in cases}
            base_us = times["eager"][0] * 1e6
            for name, (best, med) in times.items():
                rows.append(
                    dict(
                        m=m,
                        n=n,
                        mode=mode,
                        contender=name,
                        us=best * 1e6,
                        median_us=med * 1e6,
                        x_eager=best * 1e6 / base_us,
                    )
                )
    env = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        cores=os.cpu_count(),
        torch=torch.__version__,
        python=platform.python_version(),
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
    )
    return rows, env


def markdown(rows: list[dict], env: dict) -> str:
    load = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
    lines = [
        f"`{env['command']}`: {env['date']} - {env['device']}, {env['cores']} cores, torch {env['torch']}, one torch "
        f"thread; load average before {load(env['loadavg_before'])}, after {load(env['loadavg_after'])}",
        "",
        "| M x N | mode | contender | best us | median us | x eager |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['m']}x{r['n']} | {r['mode']} | {r['contender']} | {r['us']:.1f} | {r['median_us']:.1f} | "
            f"{r['x_eager']:.2f} |"
        )
    kernel_rows = [r for r in rows if r["contender"] in ("addnorm cpu", "addnorm triton")]  # no-op rows: no target
    if kernel_rows:
        lines += [
            "",
            f"| target: kernel route <= {TARGET:g}x eager | M x N | mode | measured | met |",
            "|---|---|---|---:|---|",
        ]
        for r in kernel_rows:
            met = "yes" if r["x_eager"] <= TARGET else "no"
            lines.append(f"| {r['contender']} | {r['m']}x{r['n']} | {r['mode']} | {r['x_eager']:.2f}x | {met} |")
    return "\n".join(lines)


def _shapes(text: str):
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must look like 8x64,8x4096; got {text!r}") from None
    if any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes must be positive MxN pairs; got {text!r}")
    return shapes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    p.add_argument("--shapes", type=_shapes, default=list(DEFAULT_SHAPES), help="comma-separated MxN (8x64,8x4096)")
    p.add_argument("--reps", type=int, default=7, help="timed samples per row; best and median reported")
    p.add_argument("--inner", type=int, default=300, help="calls per sample")
    p.add_argument(
        "--out",
        default=str(Path(__file__).parent / "results"),
        help="directory for overhead.md/overhead.json (default benchmarks/results; '' writes nothing)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a markdown table")
    p.add_argument(
        "--triton-python-only",
        action="store_true",
        help="CPU only: add the Triton route's rows with every kernel launch a no-op (its Python cost)",
    )
    a = p.parse_args(argv)
    if a.reps < 1 or a.inner < 1:
        p.error(f"--reps and --inner must be >= 1; got {a.reps}, {a.inner}")
    try:
        import torch

        torch.device(a.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    if a.triton_python_only:
        if a.device != "cpu":
            p.error(f"--triton-python-only runs on CPU tensors; got --device {a.device}")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors reach the launchers
    rows, env = run(a.device, a.shapes, a.reps, a.inner, a.triton_python_only)
    table = markdown(rows, env)
    if a.out:
        from addnorm.io import atomic_write_json, atomic_write_text

        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        suffix = "" if a.device == "cpu" else "_" + a.device.replace(":", "")
        atomic_write_text(
            out / f"overhead{suffix}.md", "# Per-call overhead (benchmarks/bench_overhead.py)\n\n" + table + "\n"
        )
        atomic_write_json(out / f"overhead{suffix}.json", dict(env=env, rows=rows))
    print(json.dumps(dict(env=env, rows=rows), indent=1) if a.json else table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
