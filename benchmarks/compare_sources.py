"""Run benchmarks/bench_cpu.py on two source trees of addnorm in alternation (A B A B ...) and tabulate them side by
side: the best time of each row over the rounds, and B / A. Alternating keeps a drift in the machine's speed from
landing on one side only.

    python benchmarks/compare_sources.py --a /path/to/old/src --b src --rounds 2 -- --norm rms --shapes 1x4096 \\
        --dtypes fp32,bf16 --no-compile --reps 5

Everything after ``--`` goes to bench_cpu.py (which always gets ``--json --out ''``). Each tree is put first on
PYTHONPATH of its own process; bench_cpu.py itself is this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).with_name("bench_cpu.py")


def _run(src: str, bench_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    cmd = [sys.executable, str(BENCH), "--json", "--out", "", *bench_args]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="source tree A (the baseline): the directory holding addnorm/")
    p.add_argument("--b", required=True, help="source tree B")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_cpu.py's arguments")
    args = p.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    best: dict[tuple, dict[str, float]] = {}
    loads = []
    for _ in range(args.rounds):
        for side, src in (("A", args.a), ("B", args.b)):
            result = _run(src, bench_args)
            loads.append(round(result["env"]["loadavg_before"][0], 1))
            for row in result["rows"]:
                key = (row["dtype"], f"{row['m']}x{row['n']}", row["norm"], row["mode"], row["contender"])
                cur = best.setdefault(key, {})
                cur[side] = min(cur.get(side, float("inf")), row["ms"])
    print(f"load averages before each run: {loads}\n")
    print("| dtype | M x N | norm | mode | contender | A best ms | B best ms | B / A |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for (dt, shape, norm, mode, who), t in best.items():
        a, b = t.get("A", float("nan")), t.get("B", float("nan"))
        print(f"| {dt} | {shape} | {norm} | {mode} | {who} | {a:.4g} | {b:.4g} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
