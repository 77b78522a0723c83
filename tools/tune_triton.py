"""Sweep the Triton launchers' block sizes on a GPU: which ``Tuning`` values move the most bytes per second.

    python tools/tune_triton.py                               # bf16 add + RMSNorm, fwd and bwd, 5 sizes
    python tools/tune_triton.py --norm layer --sizes 4096,65536
    TRITON_INTERPRET=1 python tools/tune_triton.py --device cpu --quick         # smoke run (numbers meaningless)

A coordinate sweep: each knob of :class:`addnorm.ops.triton.plan.Tuning` is varied alone around the defaults
(the other knobs at their defaults), and every setting is timed with ``bench_add_norm.bench_one`` (same inputs,
byte counts and timing as the benchmark table, so the GB/s compare directly). A knob that does not change the
kernels the launcher picks at an N (e.g. ``max_bwd_block_n`` far above N) is skipped there rather than timed twice.
The output is the table of every timing and, per (N, mode), the best setting and its gain over the defaults; put
a gain that holds across sizes into ``Tuning``'s defaults, then re-run ``gpu_check.sh``. JIT compilation of each
new setting takes about a second, so the default sweep (about 100 settings) fits in a few minutes.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmark's own timing code
import bench_add_norm as bench  # noqa: E402

from addnorm.ops.triton import launch as T  # noqa: E402
from addnorm.ops.triton import plan as P  # noqa: E402

# the values tried for each knob (the default is always among them)
KNOBS: dict[str, tuple[int, ...]] = {
    "elems_per_thread": (4, 8, 16),
    "rows_block_elems": (2048, 4096, 8192),
    "max_fwd_block_n": (8192, 16384, 32768),
    "max_bwd_block_n": (4096, 8192, 16384),
    "max_bwd_block_n_rms_16bit": (8192, 16384),  # 8192: RMSNorm's N = 16384 backward back on row sums + tiles
    "loop_block_n": (2048, 4096, 8192),
    "programs_per_sm": (1, 2, 4, 8),  # the rows backward's persistent grid
    "looped_programs_per_sm": (2, 4, 8),  # the looped backward's row groups x column tiles
}
SIZES = (1024, 4096, 16384, 65536, 262144)
QUICK_SIZES = (96, 300)


def settings(knobs: dict[str, tuple[int, ...]]) -> list[tuple[str, int, P.Tuning]]:
    """("default", 0, defaults) first, then (knob, value, tuning) for every non-default value of every knob."""
    default = P.Tuning()
    out = [("default", 0, default)]
    for knob, values in knobs.items():
        for v in values:
            if v != getattr(default, knob):
                out.append((knob, v, dataclasses.replace(default, **{knob: v})))
    return out


def _launch_plan(tuning: P.Tuning, n: int, mode: str, rms_16bit: bool = False) -> tuple:
    """The blocks the launchers pick under ``tuning`` for ``mode`` (rows path: (BLOCK_M, BLOCK_N); looped: BLOCK_N)
    and the elements per thread that set the warps: two settings with the same plan launch the same kernels. The
    plan depends on the row width alone, never on the number of rows (batch invariance, docs/kernels.md).
    ``rms_16bit``: RMSNorm on 2-byte types, whose backward has its own row limit (max_bwd_block_n_rms_16bit)."""

    def path(max_block_n: int):
        return P._rows_blocks(n, max_block_n) or min(tuning.loop_block_n, max_block_n)

    saved = P.set_tuning(tuning)  # _rows_blocks reads rows_block_elems from the Tuning in force
    try:
        fwd = path(tuning.max_fwd_block_n) if mode != "bwd" else None
        bwd_limit = tuning.max_bwd_block_n
        if rms_16bit:
            bwd_limit = max(bwd_limit, tuning.max_bwd_block_n_rms_16bit)
        bwd = path(bwd_limit) if mode != "fwd" else None
        wide = isinstance(bwd, tuple) and bwd[1] > tuning.max_bwd_block_n  # those rows run wide_bwd_elems_per_thread
        per_sm = tuning.programs_per_sm if isinstance(bwd, tuple) else tuning.looped_programs_per_sm
        return (
            fwd,
            bwd,
            tuning.elems_per_thread,
            tuning.wide_bwd_elems_per_thread if wide else None,
            per_sm if mode != "fwd" else None,
        )
    finally:
        P.set_tuning(saved)


def sweep(cfg: bench.BenchConfig, knobs: dict[str, tuple[int, ...]], progress=print) -> list[dict]:
    copy_gbps = bench.copy_bandwidth(
        cfg.device, (1 << 30) if cfg.device.startswith("cuda") else (1 << 24), cfg.warmup, max(cfg.reps, 10)
    )
    rows = []
    saved = P.tuning()
    rms_16bit = cfg.norm == "rms" and bench.DTYPES[cfg.dtype].itemsize == 2
    try:
        for n in cfg.sizes:
            m = max(1, cfg.elements // n)
            timed: dict[tuple, dict] = {}
            for knob, value, tuning in settings(knobs):
                for mode in cfg.modes:
                    plan = _launch_plan(tuning, n, mode, rms_16bit)
                    if (plan, mode) in timed:  # same kernels as a setting already timed: nothing new to learn
                        continue
                    P.set_tuning(tuning)
                    r = bench.bench_one("addnorm", mode, m, n, cfg, copy_gbps)
                    row = dict(
                        knob=knob,
                        value=value,
                        n=n,
                        m=m,
                        mode=mode,
                        ms=r.ms,
                        gbps=r.gbps,
                        frac_copy=r.frac_copy,
                        note=r.note,
                    )
                    timed[plan, mode] = row
                    rows.append(row)
                    setting = "default" if knob == "default" else f"{knob}={value}"
                    progress(
                        f"N={n:<7} {mode:<8} {setting:<24} "
                        + (f"{r.gbps:9.4g} GB/s" if r.gbps is not None else f"   -     {r.note}")
                    )
    finally:
        P.set_tuning(saved)
    return rows


def best_per_size(rows: list[dict]) -> list[dict]:
    """Per (N, mode): the default's GB/s, the fastest setting and its gain over the default."""
    out = []
    for key in sorted({(r["n"], r["mode"]) for r in rows}):
        group = [r for r in rows if (r["n"], r["mode"]) == key and r["gbps"] is not None]
        default = next((r for r in group if r["knob"] == "default"), None)
        if not group or default is None:
            continue
        best = max(group, key=lambda r: r["gbps"])
        name = "default" if best["knob"] == "default" else f"{best['knob']}={best['value']}"
        out.append(
            dict(
                n=key[0],
                mode=key[1],
                default_gbps=default["gbps"],
                best=name,
                best_gbps=best["gbps"],
                gain=best["gbps"] / default["gbps"],
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(bench.DTYPES))
    p.add_argument("--norm", default="rms", choices=("rms", "layer"))
    p.add_argument("--sizes", default=None, help=f"comma-separated N (default {','.join(map(str, SIZES))})")
    p.add_argument("--modes", default="fwd,bwd", help="comma-separated subset of fwd,bwd,fwd+bwd")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two tiny sizes, two values per knob, few reps (smoke run)")
    p.add_argument("--out", default=None, help="directory for tune_<norm>_<dtype>.csv / .json")
    p.add_argument("--json", action="store_true", help="print the per-size summary as JSON")
    p.add_argument("--knobs", default=None, help=f"comma-separated subset of {','.join(KNOBS)} (default: all)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu with TRITON_INTERPRET=1 for a smoke run)")
    reason = T.unavailable_reason(torch.device(a.device))
    if reason is not None:
        p.error(f"--device {a.device}: {reason}")
    modes = tuple(a.modes.split(","))
    for mode in modes:
        if mode not in bench.MODES:
            p.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(bench.MODES)}")
    sizes = tuple(int(s) for s in a.sizes.split(",")) if a.sizes else (QUICK_SIZES if a.quick else SIZES)
    knobs = KNOBS
    if a.knobs:
        unknown = [k for k in a.knobs.split(",") if k not in KNOBS]
        if unknown:
            p.error(f"--knobs: unknown {', '.join(unknown)}; choose from {', '.join(KNOBS)}")
        knobs = {k: KNOBS[k] for k in a.knobs.split(",")}
    if a.quick:  # tiny sizes must reach the multi-row and looped paths: shrink the limits with them
        knobs = {"elems_per_thread": (4, 8), "max_fwd_block_n": (128, 16384), "max_bwd_block_n": (128, 8192)}
    cfg = bench.BenchConfig(
        device=a.device,
        dtype=a.dtype,
        norm=a.norm,
        sizes=sizes,
        modes=modes,
        providers=("addnorm",),
        elements=(1 << 12) if a.quick else (1 << 26),
        warmup=1 if a.quick else 5,
        reps=2 if a.quick else a.reps,
    )
    log = (lambda s: print(s, file=sys.stderr)) if a.json else print
    rows = sweep(cfg, knobs, progress=log)
    summary = best_per_size(rows)
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"\n{'N':>8} {'mode':<8} {'default GB/s':>12} {'best setting':<24} {'GB/s':>8} {'gain':>6}")
        for s in summary:
            print(
                f"{s['n']:>8} {s['mode']:<8} {s['default_gbps']:>12.4g} {s['best']:<24} {s['best_gbps']:>8.4g} "
                f"{s['gain']:>5.2f}x"
            )
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        stem = d / f"tune_{a.norm}_{a.dtype}"
        with open(f"{stem}.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["knob"])
            writer.writeheader()
            writer.writerows(rows)
        Path(f"{stem}.json").write_text(json.dumps({"rows": rows, "best": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
