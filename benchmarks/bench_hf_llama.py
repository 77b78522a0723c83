"""A small random Llama (transformers) forward + backward, unpatched vs addnorm.integrations.hf.apply.

Three variants of one model, timed round-robin so that machine noise hits all of them alike:

    hf          the unpatched transformers model
    norms       apply(model, fuse_residual=False): addnorm norms, HF's residual adds
    fused       apply(model, fuse_residual=True): addnorm norms, residual add + post-attention norm fused

Prints a table; writes it (with date, versions, backend and the command) to benchmarks/results/hf_llama.md, and the
raw numbers as JSON with --json. Nothing is downloaded: the model is built from a config.

    python benchmarks/bench_hf_llama.py                      # 4 layers, hidden 256, batch 4, seq 128, fp32
    python benchmarks/bench_hf_llama.py --dtype bf16 --repeats 30 --json out.json
    python benchmarks/bench_hf_llama.py --device cuda --dtype bf16 --layers 8 --hidden 4096 --heads 32 \
        --vocab 32000 --batch 4 --seq 2048 --out benchmarks/results/gpu/hf_llama.md     # a Llama-7B-wide step
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("hf", "norms", "fused")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "hf_llama.md"


@dataclass(kw_only=True)
class BenchConfig:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 1024
    batch: int = 4
    seq: int = 128
    dtype: str = "fp32"
    repeats: int = 20
    warmup: int = 3
    threads: int = 0  # 0: torch's default
    device: str = "cpu"


def parse_args(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = BenchConfig()
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (default %(default)s)")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads (default %(default)s)")
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="batch size (default %(default)s)")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length (default %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="model dtype (default %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed steps per variant (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per variant (default %(default)s)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (default %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads, 0 = default (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the raw results as JSON to PATH ('-': stdout)")
    p.add_argument("--out", metavar="PATH", default=str(DEFAULT_OUT), help="markdown table (default %(default)s)")
    p.add_argument("--no-write", action="store_true", help="print only; do not write the markdown file")
    p.add_argument("--note", default="", help="a sentence for the markdown file, e.g. how busy the machine was")
    args = p.parse_args(argv)
    cfg = BenchConfig(**{k: getattr(args, k) for k in asdict(d)})
    for name in ("layers", "hidden", "heads", "vocab", "batch", "seq", "repeats"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.warmup < 0 or cfg.threads < 0:
        p.error("--warmup and --threads must be >= 0")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {cfg.device}: no CUDA device here")
    if cfg.hidden % cfg.heads:
        p.error(f"--hidden ({cfg.hidden}) must be a multiple of --heads ({cfg.heads})")
    return cfg, args


def build(cfg: BenchConfig, variant: str):
    from addnorm.integrations import hf

    model = (
        hf.tiny_model(
            "llama",
            seed=0,
            dtype=DTYPES[cfg.dtype],
            num_hidden_layers=cfg.layers,
            hidden_size=cfg.hidden,
            intermediate_size=cfg.hidden * 8 // 3,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.heads,
            vocab_size=cfg.vocab,
            max_position_embeddings=max(cfg.seq, 128),
        )
        .to(cfg.device)
        .train()
    )
    if variant != "hf":
        hf.apply(model, fuse_residual=variant == "fused")
    return model


def step(model, ids, threads: int = 0) -> None:
    """One training step's worth of compute: forward, loss, backward (no optimizer: it is the same for all)."""
    if threads and torch.get_num_threads() != threads:
        # numba's OpenMP threading layer (the cpu backend) resets the process's OpenMP thread count, which torch
        # reads as its own, at its first parallel launch: pin it again, or every later step (hf's too) runs with
        # more threads than asked for
        torch.set_num_threads(threads)
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    if ids.is_cuda:  # the step's time is the device's: wait for its kernels
        torch.cuda.synchronize(ids.device)


def run(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0)).to(cfg.device)
    models = {v: build(cfg, v) for v in VARIANTS}
    for model in models.values():
        for _ in range(cfg.warmup):
            step(model, ids, cfg.threads)
    times = {v: [] for v in VARIANTS}
    for _ in range(cfg.repeats):
        for v, model in models.items():  # round-robin: drifting load hits every variant alike
            t0 = time.perf_counter()
            step(model, ids, cfg.threads)
            times[v].append((time.perf_counter() - t0) * 1e3)
    return {v: _summary(t) for v, t in times.items()}


def _summary(t: list[float]) -> dict:
    q = statistics.quantiles(t, n=4, method="inclusive") if len(t) > 1 else [t[0]] * 3  # within the data
    return {"median_ms": statistics.median(t), "p25_ms": q[0], "p75_ms": q[2], "min_ms": min(t), "times_ms": t}


def environment(device: str = "cpu") -> dict:
    import transformers

    import addnorm
    from addnorm.ops.backends import resolve_backend

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "addnorm": addnorm.__version__,
        "backend": resolve_backend("auto", torch.device(device)),
        "device": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def table(results: dict) -> str:
    base = results["hf"]["median_ms"]
    rows = [
        "| variant | median ms | p25 ms | p75 ms | min ms | speedup vs hf (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        r = results[v]
        rows.append(
            f"| {v} | {r['median_ms']:.2f} | {r['p25_ms']:.2f} | {r['p75_ms']:.2f} | {r['min_ms']:.2f} "
            f"| {base / r['median_ms']:.3f}x |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    cfg, args = parse_args(argv)
    results = run(cfg)
    env = environment(cfg.device)
    text = table(results)
    print(text)
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_hf_llama.py", *argv])
    if not args.no_write:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
        out.write_text(
            f"# transformers Llama forward + backward on {env['device']}: unpatched vs addnorm\n\n"
            f"Command: `{command}`\n\n"
            f"Model: Llama, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, vocab {cfg.vocab}; "
            f"batch {cfg.batch} x seq {cfg.seq}, {cfg.dtype}; {cfg.repeats} timed steps per variant after "
            f"{cfg.warmup} warm-up steps, run round-robin.\n\n{env_lines}\n\n{text}\n\n"
            "hf: unpatched; norms: `apply(model, fuse_residual=False)`; fused: `apply(model)` (residual add + "
            "post-attention norm in one call). A difference smaller than the p25-p75 spread is noise.\n"
            + (f"\nNote: {args.note}\n" if args.note else "")
        )
        print(f"wrote {out}")
    if args.json:
        payload = json.dumps({"config": asdict(cfg), "environment": env, "results": results}, indent=2)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
