"""Overhead of addnorm.diagnostics.Monitor recording every step, on a small training step.

    python benchmarks/monitor_overhead.py                      # gpt2 preset, 6 layers, d=64, batch 8x64, CPU
    python benchmarks/monitor_overhead.py --device cuda --steps 400

One training step = forward, cross-entropy, backward, AdamW step, zero_grad. Steps with and without the Monitor
alternate one by one (so load from other processes hits both alike), after a warm-up; the overhead is the ratio of
the median step times (and, less sensitive to load swings, the median of the paired differences). The Monitor is
attached before each monitored step and detached after it, outside the timed region. Writes a Markdown table to
--out (the command, machine, versions, numbers).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(kw_only=True)
class OverheadConfig:
    preset: str = "gpt2"
    n_layers: int = 6
    d_model: int = 64
    n_heads: int = 4
    vocab_size: int = 256
    batch: int = 8
    seq_len: int = 64
    steps: int = 300  # timed steps per condition (plain and monitored alternate)
    warmup: int = 10
    threads: int = 0  # torch.set_num_threads (0: leave torch's default)
    device: str = "cpu"
    out: str = "benchmarks/results/monitor_overhead.md"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(cfg: OverheadConfig) -> dict:
    from addnorm.diagnostics import Monitor
    from addnorm.nn import TransformerConfig, TransformerLM

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    load_before = os.getloadavg()[0]
    device = torch.device(cfg.device)
    torch.manual_seed(0)
    mcfg = TransformerConfig.preset(
        cfg.preset,
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        max_seq_len=max(cfg.seq_len, 128),
    )
    model = TransformerLM(mcfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    step_times: list[float] = []  # time inside mon.step() alone (the rest of the overhead is in the hooks)

    def train_step(mon=None) -> float:
        _sync(device)
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if mon is not None:
            t1 = time.perf_counter()
            mon.step(loss=loss)  # one host transfer per step, like logging the loss would anyway
            step_times.append(time.perf_counter() - t1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t0

    for _ in range(cfg.warmup):
        train_step()
    mon = Monitor(model)
    for _ in range(cfg.warmup):
        train_step(mon)
    mon.detach()

    step_times.clear()
    plain, monitored = [], []
    for _ in range(cfg.steps):
        # Plain and monitored steps alternate one by one, so drifting load from other processes hits both alike;
        # attaching and detaching happen outside the timed region.
        plain.append(train_step())
        mon = Monitor(model)
        monitored.append(train_step(mon))
        mon.detach()
    rec = mon.history[-1]
    base, with_mon = statistics.median(plain), statistics.median(monitored)
    paired = statistics.median(m - p for m, p in zip(monitored, plain))
    return {
        "plain_ms": 1e3 * base,
        "monitor_ms": 1e3 * with_mon,
        "overhead_pct": 100.0 * (with_mon / base - 1.0),
        "paired_pct": 100.0 * paired / base,
        "mon_step_ms": 1e3 * statistics.median(step_times),
        "steps": len(plain),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "n_params": sum(p.numel() for p in model.parameters()),
        "layers_recorded": len(rec["layers"]),
        "record_keys": sorted(rec),
        "layer_keys": sorted(rec["layers"][0]),
    }


def main(argv: list[str] | None = None) -> int:
    cfg = OverheadConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in vars(cfg).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    cfg = OverheadConfig(**vars(args))
    res = run(cfg)
    line = (
        f"{cfg.preset} L={cfg.n_layers} d={cfg.d_model} batch {cfg.batch}x{cfg.seq_len} on {cfg.device}: "
        f"step {res['plain_ms']:.2f} ms plain, {res['monitor_ms']:.2f} ms with Monitor "
        f"-> overhead {res['overhead_pct']:+.1f}% (median of {res['steps']} steps each; median paired "
        f"difference {res['paired_pct']:+.1f}%; "
        f"mon.step() alone {res['mon_step_ms']:.2f} ms)"
    )
    print(line)
    command = "python benchmarks/monitor_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Monitor overhead",
        "",
        "Cost of `addnorm.diagnostics.Monitor` recording every step (per-block grad norm, residual RMS, norm-input",
        "RMS, log Z, global grad norm, one host transfer) on a full training step (forward, cross-entropy, backward,",
        "AdamW, zero_grad). Plain and monitored steps alternate step by step; medians after warm-up.",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, device {cfg.device}, {os.cpu_count()} CPUs, load average "
        f"{res['load_before']:.1f} before / {res['load_after']:.1f} after (other processes share the machine); "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| model | params | batch | plain step (ms) | with Monitor (ms) | overhead (ratio of medians) | "
        "median paired difference | mon.step() alone (ms) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {cfg.preset}, {cfg.n_layers} layers, d={cfg.d_model}, vocab {cfg.vocab_size} | {res['n_params']:,} | "
        f"{cfg.batch}x{cfg.seq_len} | {res['plain_ms']:.2f} | {res['monitor_ms']:.2f} | {res['overhead_pct']:+.1f}% | "
        f"{res['paired_pct']:+.1f}% | "
        f"{res['mon_step_ms']:.2f} |",
        "",
        f"Record keys: {', '.join(res['record_keys'])}; per layer: {', '.join(res['layer_keys'])} "
        f"({res['layers_recorded']} layers).",
        "",
    ]
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
