"""``addnorm train``: train one configuration on the synthetic language (or a text file) and report its stability.

    addnorm train --preset gpt2 --set n_layers=6 --set qk_norm=true --steps 300 --lr 3e-3 --out runs/a
    addnorm train --preset llama --data notes.txt --steps 500 --json
    torchrun --nproc_per_node 2 -m addnorm train --preset gpt2 --steps 200        # data-parallel

``--set key=value`` sets a TransformerConfig field (overriding the preset) or a TrainConfig field (``z_loss``,
``weight_decay``, ``schedule``, ...); values are read as Python literals (``3e-4``, ``true``, ``None``) or kept as
strings. The report: final, best and optimum loss, spikes, max gradient norm, diverged or not; with ``--out``
the JSONL log, a checkpoint, ``summary.json`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

__all__ = ["register", "parse_sets", "build_run", "run_training"]

_TRUE, _FALSE = {"true", "yes", "on"}, {"false", "no", "off"}


def _literal(text: str):
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_sets(items: list[str] | None) -> dict:
    """``["a=1", "b=pre"]`` -> ``{"a": 1, "b": "pre"}``; an item without '=' is a ValueError naming it."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = _literal(value)
    return out


def build_run(*, preset: str, sets: dict, train_fields: dict, data_file: str | None = None, data_seed: int = 0):
    """(model, data, TrainConfig, TransformerConfig) from a preset, ``--set`` overrides and explicit flags.

    The vocabulary follows the data (64 for the synthetic language, 256 for bytes) and max_seq_len is raised to the
    training sequence length, unless ``--set`` gives them."""
    import dataclasses

    import torch

    from addnorm.nn import TransformerConfig, TransformerLM
    from addnorm.train.data import MarkovLanguage, TextData
    from addnorm.train.loop import TrainConfig

    model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    tfields = TrainConfig.field_names()
    unknown = sorted(set(sets) - model_fields - tfields)
    if unknown:
        raise ValueError(f"--set: unknown field(s) {unknown}; model fields: {sorted(model_fields)}; "
                         f"training fields: {sorted(tfields)}")  # fmt: skip
    tkw = {**train_fields, **{k: v for k, v in sets.items() if k in tfields and k not in model_fields}}
    cfg = TrainConfig(**tkw)
    data = TextData(data_file) if data_file else MarkovLanguage(seed=data_seed)
    mkw = {k: v for k, v in sets.items() if k in model_fields}
    mkw.setdefault("vocab_size", data.vocab_size)
    if mkw["vocab_size"] < data.vocab_size:
        raise ValueError(f"vocab_size={mkw['vocab_size']} is smaller than the data's vocabulary ({data.vocab_size})")
    base = TransformerConfig.preset(preset, **mkw)
    if "max_seq_len" not in mkw and base.max_seq_len < cfg.seq_len:
        base = base.replace(max_seq_len=cfg.seq_len)
    torch.manual_seed(cfg.seed)  # model init
    model = TransformerLM(base)
    return model, data, cfg, base


def _plot(result, path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the PNG is optional: the JSON has the curve
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(result.losses)), result.losses, lw=1, label="train loss")
    if result.evals:
        s, v = zip(*result.evals)
        ax.plot(s, v, "o-", ms=3, label="validation loss")
    if result.optimum is not None:
        ax.axhline(result.optimum, color="k", ls="--", lw=1, label=f"optimum {result.optimum:.3f}")
    for i in result.spikes:
        ax.axvline(i, color="r", alpha=0.3, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run_training(args: argparse.Namespace) -> int:
    import dataclasses
    import sys

    from addnorm.train import distributed as D
    from addnorm.train.loop import train

    flags = {"steps": args.steps, "lr": args.lr, "warmup": args.warmup, "batch_size": args.batch_size,
             "seq_len": args.seq_len, "seed": args.seed, "device": args.device, "monitor": args.monitor,
             "out_dir": args.out, "resume": args.resume}  # fmt: skip
    flags = {k: v for k, v in flags.items() if v is not None and v is not False}
    try:
        sets = parse_sets(args.set)
        model, data, cfg, mcfg = build_run(preset=args.preset, sets=sets, train_fields=flags, data_file=args.data,
                                           data_seed=args.data_seed)  # fmt: skip
    except (ValueError, TypeError) as e:
        print(f"addnorm train: error: {e}", file=sys.stderr)
        return 2
    info = D.init_from_env(cfg.device)
    bar = None
    if info.is_main and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"train {args.preset}", unit="step", file=sys.stderr, leave=False)

    def on_step(entry: dict) -> None:
        if bar is not None:
            if bar.n < entry["step"]:  # resumed: jump to where the checkpoint was
                bar.update(entry["step"] - bar.n)
            bar.update(1)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", gnorm=f"{entry['grad_norm']:.2f}")

    result = train(model, data, cfg, callback=on_step)
    if bar is not None:
        bar.close()
    if not info.is_main:
        return 0
    summary = result.summary()
    report = {
        "preset": args.preset, "summary": summary, "data": data.describe(cfg.seq_len),
        "model": dataclasses.asdict(mcfg), "train": dataclasses.asdict(cfg), "world_size": info.world_size,
        "losses": [x if math.isfinite(x) else None for x in result.losses], "evals": result.evals, "figures": [],
    }  # fmt: skip
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        png = _plot(result, out / "loss.png", f"{args.preset}: loss vs step")
        if png:
            report["figures"].append(png)
        (out / "summary.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_summary(args.preset, summary, report)
    return 1 if summary["diverged"] else 0


def _print_summary(preset: str, s: dict, report: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.4f}"

    print(f"addnorm train: {preset}, {s['steps']} steps, {report['world_size']} process(es)")
    print(f"  final loss     {f(s['final_loss'])}   (best {f(s['best_loss'])}, initial {f(s['initial_loss'])})")
    if s["optimum"] is not None:
        print(f"  optimum        {f(s['optimum'])}   excess loss {f(s['excess_loss'])}")
    print(f"  spikes         {s['spikes']}" + (f" at steps {s['spike_steps'][:10]}" if s["spikes"] else ""))
    print(f"  max grad norm  {f(s['max_grad_norm'])}")
    print(f"  diverged       {'YES' if s['diverged'] else 'no'}")
    if s["step_time_s"] is not None:
        print(f"  step time      {s['step_time_s'] * 1e3:.1f} ms")
    for fig in report["figures"]:
        print(f"  figure         {fig}")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train one model configuration and report loss curves and stability metrics",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--preset", default="gpt2", help="model preset (TransformerConfig.preset names); default gpt2")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="set a model or training field (repeatable), e.g. --set n_layers=6 --set z_loss=1e-4")
    p.add_argument("--steps", type=int, help="training steps (default 200)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, help="warmup steps (default 20)")
    p.add_argument("--batch-size", type=int, help="global batch size (default 16)")
    p.add_argument("--seq-len", type=int, help="sequence length (default 64)")
    p.add_argument("--seed", type=int, help="seed of model init, data order and dropout (default 0)")
    p.add_argument("--data", metavar="FILE", help="train on this text file (bytes) instead of the synthetic language")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic language itself (default 0)")
    p.add_argument("--device", help="cpu or cuda (default cpu)")
    p.add_argument("--monitor", action="store_true", help="record per-layer telemetry every step into the log")
    p.add_argument("--out", metavar="DIR", help="write log.jsonl, checkpoint.pt, summary.json, loss.png here")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt (needs --out)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_training)
