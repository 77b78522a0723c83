"""Seconds per training step: one tiny LM (addnorm.train.loop.train) vs K of them batched (train_batched).

The lab's model (d_model 32, 2 heads, T 32, B 8, Pre-LN LayerNorm GELU, Xavier, backend torch) at several depths.
A step is the whole training step of the loop: the batch, forward, cross-entropy, backward, gradient clipping,
AdamW and the schedule (no evaluation). Each configuration runs ``--steps`` steps after one warm-up step; the three
ways (one model; K models through ``engine="vmap"``; K models through ``engine="stacked"``) are interleaved
round by round (``--rounds``), so machine load hits them alike, and the medians over all measured steps are
compared. Speedup = (K x seconds per single-model step) / seconds per batched step: the throughput per model.
Both CPU time (process_time: what a step costs on a core of its own, robust to other jobs on the machine) and
wall time (perf_counter: what a shared machine delivered) are measured; the table leads with CPU time.

    PYTHONPATH=src python benchmarks/bench_batched_train.py                      # the table in results/
    PYTHONPATH=src python benchmarks/bench_batched_train.py --layers 2 6 --ks 3 --steps 4 --rounds 1

One torch thread (the lab's setting). Writes a markdown table to stdout and, with --out, to a file.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch


def _train_cfg(steps: int, lr: float, seed: int):
    from addnorm.train.config import TrainConfig

    return TrainConfig(steps=steps + 1, batch_size=8, seq_len=32, lr=lr, warmup=2, seed=seed, eval_batches=1)


MODEL_KW: dict = {}  # extra TransformerConfig fields (--record-logits)


def _models(layers: int, seeds: list[int]):
    from addnorm.lab.experiments.training_setup import model_config
    from addnorm.nn import TransformerLM

    out = []
    for s in seeds:
        torch.manual_seed(s)
        out.append(TransformerLM(model_config(n_layers=layers, **MODEL_KW)))
    return out


class _Clock:
    """A step callback that stamps wall and CPU time at the end of every step: differences of consecutive stamps
    are whole steps. CPU time (this process) is what the step costs on a core of its own; wall time also counts
    the waits for a core, which on a shared machine are most of it."""

    def __init__(self):
        self.wall, self.cpu = [], []

    def __call__(self, _entry: dict) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def steps(self) -> tuple[list[float], list[float]]:
        """(wall, cpu) seconds of steps 1.. (step 0 pays one-off costs and has no previous stamp)."""
        diff = lambda t: [b - a for a, b in zip(t, t[1:])]  # noqa: E731
        return diff(self.wall), diff(self.cpu)


def single_step_times(layers: int, steps: int) -> tuple[list[float], list[float]]:
    from addnorm.lab.experiments.training_setup import language
    from addnorm.train.loop import train

    (model,) = _models(layers, [0])
    clock = _Clock()
    train(model, language(0), _train_cfg(steps, 1e-3, 0), callback=clock)
    return clock.steps()


def batched_step_times(layers: int, k: int, steps: int, engine: str) -> tuple[list[float], list[float]]:
    """(wall, cpu) seconds of each batched step of K members."""
    from addnorm.lab.experiments.training_setup import language
    from addnorm.train.batched import train_batched

    seeds = list(range(k))
    cfgs = [_train_cfg(steps, 1e-3 * (1 + i), s) for i, s in enumerate(seeds)]  # per-member seed and LR
    clock = _Clock()
    train_batched(_models(layers, seeds), language(0), cfgs, engine=engine, callback=clock)
    return clock.steps()


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 6, 24, 48])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 6, 7], help="members per batch")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per configuration")
    ap.add_argument("--engines", nargs="+", default=["vmap", "stacked"], choices=["vmap", "stacked"])
    ap.add_argument(
        "--record-logits",
        action="store_true",
        help="explicit attention recording the max logit (lr-sensitivity's models; vmap cannot)",
    )
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    for name in ("layers", "ks", "steps", "rounds"):
        vals = getattr(args, name)
        if any(v < 1 for v in (vals if isinstance(vals, list) else [vals])):
            ap.error(f"--{name} must be positive")
    if args.record_logits:
        if "vmap" in args.engines:
            ap.error("--record-logits works with --engines stacked only")
        MODEL_KW["record_logits"] = True
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*batching rule.*")  # vmap's SDPA fallback, measured here
    rows = []
    load_before = os.getloadavg()
    t_start = time.time()
    for layers in args.layers:
        single: tuple[list[float], list[float]] = ([], [])
        batched = {(e, k): ([], []) for e in args.engines for k in args.ks}
        for _ in range(args.rounds):
            for acc, new in zip(single, single_step_times(layers, args.steps)):
                acc += new
            for k in args.ks:
                for e in args.engines:
                    for acc, new in zip(batched[(e, k)], batched_step_times(layers, k, args.steps, e)):
                        acc += new
        s_wall, s_cpu = map(statistics.median, single)
        for k in args.ks:
            row = {"L": layers, "K": k, "single_cpu_ms": s_cpu * 1e3, "single_wall_ms": s_wall * 1e3}
            for e in args.engines:
                b_wall, b_cpu = map(statistics.median, batched[(e, k)])
                row[f"{e}_cpu_ms"], row[f"{e}_wall_ms"] = b_cpu * 1e3, b_wall * 1e3
                row[f"{e}_cpu_speedup"], row[f"{e}_wall_speedup"] = s_cpu * k / b_cpu, s_wall * k / b_wall
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    head = ["L", "K", "one model: CPU ms/step"]
    for e in args.engines:
        head += [f"{e}: CPU ms/step (K models)", f"{e}: speedup (CPU)", f"{e}: speedup (wall)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["L"]), str(r["K"]), f"{r['single_cpu_ms']:.1f}"]
        for e in args.engines:
            cells += [f"{r[e + '_cpu_ms']:.1f}", f"**{r[e + '_cpu_speedup']:.2f}x**", f"{r[e + '_wall_speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    logits = "; record_logits=True" if args.record_logits else ""
    load = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
    meta = (
        f"torch {torch.__version__}, {_cpu_name()}, {os.cpu_count()} CPUs, 1 torch thread{logits}; "
        f"load average (1/5/15 min) {load(load_before)} before, {load(load_after)} after; "
        f"{args.steps} steps x {args.rounds} rounds per cell; {time.time() - t_start:.0f} s in all"
    )
    table = "\n".join(lines) + "\n\n" + meta + "\n"
    print(table)
    if args.out:
        from addnorm.io import atomic_write_text

        atomic_write_text(Path(args.out), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
