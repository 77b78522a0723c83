"""``addnorm train``: train one configuration on the synthetic language (or a text file) and report its stability.

    addnorm train --preset gpt2 --set n_layers=6 --set qk_norm=true --steps 300 --lr 3e-3 --out runs/a
    addnorm train --preset llama --data notes.txt --steps 500 --json
    addnorm train --out runs/a --resume            # continue runs/a with the flags it was started with
    torchrun --nproc_per_node 2 -m addnorm train --preset gpt2 --steps 200        # data-parallel

``--set key=value`` sets a TransformerConfig field (overriding the preset) or a TrainConfig field (``z_loss``,
``weight_decay``, ``schedule``, ...); values are read as Python literals (``3e-4``, ``true``, ``None``) and must
fit the field's type (``true``/``false`` for a switch, a finite number for a rate, a word for a name). The report:
final, best and optimum loss, spikes, max gradient norm, diverged or not (a non-finite loss or weight is a
divergence: exit status 1); with ``--out`` the JSONL log, a checkpoint (every 50 steps and at the end;
``--set checkpoint_every=N``), ``args.json`` (the flags, with --data's absolute path and SHA-256, for
``--resume``), ``summary.json`` and ``loss.png``; one run at a time per ``--out``. ``--resume`` on a directory
without a run, or after the --data file changed, is an error; so is a new run (no ``--resume``) into a directory that
holds a checkpoint (it would overwrite it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import typing
from pathlib import Path

from addnorm.train.sets import check_set_types, parse_sets

__all__ = ["register", "parse_sets", "build_run", "run_training"]


def build_run(*, preset: str, sets: dict, train_fields: dict, data_file: str | None = None, data_seed: int = 0):
    """(model, data, TrainConfig, TransformerConfig) from a preset, ``--set`` overrides and explicit flags.

    The vocabulary follows the data (64 for the synthetic language, 256 for bytes) and max_seq_len is raised to the
    training sequence length, unless ``--set`` gives them."""
    import dataclasses

    import torch

    from addnorm.nn import TransformerConfig, TransformerLM
    from addnorm.train.config import TrainConfig
    from addnorm.train.data import MarkovLanguage, TextData

    model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    tfields = TrainConfig.field_names()
    unknown = sorted(set(sets) - model_fields - tfields)
    if unknown:
        raise ValueError(
            f"--set: unknown field(s) {unknown}; model fields: {sorted(model_fields)}; "
            f"training fields: {sorted(tfields)}"
        )
    sets = check_set_types(
        sets, {**typing.get_type_hints(TrainConfig), **typing.get_type_hints(TransformerConfig)}
    )  # a model field wins a name clash, as below
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


ARGS_FILE = "args.json"  # in --out: the flags of the run, so `--out DIR --resume` alone continues it
CHECKPOINT = "checkpoint.pt"  # = addnorm.train.checkpoint.CHECKPOINT (not imported from there: that imports torch)
# The flags that define a run; on --resume each one not given again is taken from ARGS_FILE.
_RUN_FLAGS = ("preset", "set", "steps", "lr", "warmup", "batch_size", "seq_len", "seed", "data", "data_seed")
_DEFAULTS = {"preset": "gpt2", "data_seed": 0}  # argparse leaves these None so --resume can tell "not given"


def _saved_args(out: Path) -> dict | None:
    path = out / ARGS_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--resume: cannot read {path}: {e}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"--resume: {path} is not an `addnorm train` arguments file")
    return saved


def _check_something_to_resume(out: str | None) -> None:
    """--resume continues a run: an --out that is missing or holds no run is an error, not a fresh default run."""
    if not out:
        raise ValueError("--resume needs --out DIR, the directory of the run to continue")
    path = Path(out)
    if not path.exists():
        raise ValueError(f"--resume: nothing to resume: {out} does not exist (start the run without --resume)")
    if not path.is_dir():
        raise ValueError(f"--resume: nothing to resume: {out} is a file, not a run directory")
    if not (path / ARGS_FILE).is_file() and not (path / CHECKPOINT).is_file():
        raise ValueError(
            f"--resume: nothing to resume in {out}: it holds neither {CHECKPOINT} nor {ARGS_FILE} "
            "of an `addnorm train` run (start the run without --resume)"
        )


def resolve_run_args(args: argparse.Namespace) -> None:
    """Fill in defaults; with --resume, take every run flag not given again from OUT/args.json, and reject one
    given with another value (it would continue a different run from the checkpoint)."""
    if args.resume:
        _check_something_to_resume(args.out)
    elif args.out and (Path(args.out) / CHECKPOINT).is_file():  # a new run would overwrite it: a forgotten --resume
        raise ValueError(
            f"--out {str(args.out)!r} holds a run ({CHECKPOINT}): --resume continues it; to start a new run, give "
            f"another --out (or delete {Path(args.out) / CHECKPOINT} first)"
        )
    saved = _saved_args(Path(args.out)) if args.resume and args.out else None
    if saved is not None:
        conflicts = []
        for key in _RUN_FLAGS:
            given, old = getattr(args, key), saved.get(key)
            if given is None:
                setattr(args, key, old)
            elif _differs(key, given, old):
                conflicts.append(f"--{key.replace('_', '-')} {given!r} (the run in {args.out} used {old!r})")
        if conflicts:
            raise ValueError(
                f"--resume continues the run in {args.out} with its own settings, but got "
                f"{'; '.join(conflicts)}: drop these flags, or train into a new --out"
            )
        args.monitor = args.monitor or bool(saved.get("monitor"))
    for key, value in _DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.data_sha256 = None
    if args.data is not None:
        _pin_data(args, saved)


def _differs(key: str, given, old) -> bool:
    if key == "set":
        return parse_sets(given) != parse_sets(old)
    if key == "data" and isinstance(given, str) and isinstance(old, str):  # one file, named from another folder
        return Path(given).resolve() != Path(old).resolve()
    return given != old


def _pin_data(args: argparse.Namespace, saved: dict | None) -> None:
    """Store --data as an absolute path with its SHA-256, so a resume from another folder reads the same file and
    a resume after the file changed is refused (it would continue the run on other data)."""
    path = Path(args.data).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"--data {args.data!r}: no such file ({path})")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    args.data, args.data_sha256 = str(path), digest.hexdigest()
    old = (saved or {}).get("data_sha256")
    if old and old != args.data_sha256:
        raise ValueError(
            f"--data {path}: the file changed since the run in {args.out} started (SHA-256 {args.data_sha256[:12]}, "
            f"the run's {old[:12]}); resuming would continue on other data: restore the file, or train into a new --out"
        )


def _save_args(out: Path, args: argparse.Namespace) -> None:
    from addnorm.io import atomic_write_json

    data = {key: getattr(args, key) for key in _RUN_FLAGS}
    data["monitor"] = bool(args.monitor)
    data["data_sha256"] = getattr(args, "data_sha256", None)
    atomic_write_json(out / ARGS_FILE, data)  # a crash never leaves half a file for --resume to read


def run_training(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:  # holds --out's lock until the report is written
        return _run_training(args, stack)


# TrainConfig fields that have their own flag: an error about one names the flag the user typed
_FIELD_FLAGS = {
    "steps": "--steps",
    "lr": "--lr",
    "warmup": "--warmup",
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "seed": "--seed",
    "device": "--device",
}


def name_flags(message: str) -> str:
    """``message`` with each ``TrainConfig.FIELD`` that has a flag named as that flag too (``--lr (TrainConfig.lr)``),
    so an error about ``--lr nan`` names ``--lr``."""
    import re

    def named(m: re.Match) -> str:
        flag = _FIELD_FLAGS.get(m.group(1))
        already = message[m.end() : m.end() + len(flag) + 2] == f" ({flag}" if flag else True
        return m.group(0) if flag is None or already else f"{flag} ({m.group(0)})"

    return re.sub(r"TrainConfig\.(\w+)", named, message)


def _run_training(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    import dataclasses
    import sys

    from addnorm.outpaths import describe_os_error, out_dir, out_lock
    from addnorm.train import distributed as D
    from addnorm.train.loop import train

    try:
        if args.out is not None:  # "" is refused here: it used to mean "write nothing", silently
            out_dir(args.out, create=False)
        resolve_run_args(args)
        if args.data_seed < 0:
            raise ValueError(f"--data-seed must be an int >= 0, got {args.data_seed}")
    except ValueError as e:
        print(f"addnorm train: error: {e}", file=sys.stderr)
        return 2
    flags = {
        "steps": args.steps,
        "lr": args.lr,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "device": args.device,
        "monitor": args.monitor,
        "out_dir": args.out,
        "resume": args.resume,
    }
    flags = {k: v for k, v in flags.items() if v is not None and v is not False}
    try:
        sets = parse_sets(args.set)
        model, data, cfg, mcfg = build_run(
            preset=args.preset, sets=sets, train_fields=flags, data_file=args.data, data_seed=args.data_seed
        )
    except (ValueError, TypeError) as e:
        print(f"addnorm train: error: {name_flags(str(e))}", file=sys.stderr)
        return 2
    info = D.init_from_env(cfg.device)
    if args.out and info.is_main:
        try:
            out_dir(args.out)
            # one run per --out (two interleaved their log.jsonl), taken before anything is written into it
            stack.enter_context(out_lock(Path(args.out), command="addnorm train"))
            if args.resume and not (Path(args.out) / CHECKPOINT).exists():
                print(f"addnorm train: no checkpoint in {args.out} yet: starting from step 0", file=sys.stderr)
            _save_args(Path(args.out), args)
        except ValueError as e:
            print(f"addnorm train: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"addnorm train: error: cannot write into --out {args.out}: {describe_os_error(e)}", file=sys.stderr)
            return 2
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

    from addnorm.interrupt import sigterm_interrupts
    from addnorm.ops.backends import BackendUnavailableError

    try:
        try:
            with sigterm_interrupts():  # `timeout`, `kill`, schedulers: stop as Ctrl-C does, with the message
                result = train(model, data, cfg, callback=on_step)
        finally:
            if bar is not None:  # before any message: a message printed over a live bar shares its line
                bar.close()
    except (ValueError, BackendUnavailableError) as e:  # --resume onto another model; ADDNORM_BACKEND=triton on CPU
        print(f"addnorm train: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing the log or a checkpoint: disk full, permissions, ...
        print(
            f"addnorm train: error: cannot write into --out {args.out}: {describe_os_error(e)} ({e})", file=sys.stderr
        )
        return 2
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", 2)  # 15 from sigterm_interrupts: exit 143, as a shell reports SIGTERM
        every = f"every {cfg.checkpoint_every} steps" if cfg.checkpoint_every else "only at the end"
        where = (
            f"the last checkpoint in {args.out} (written {every}; --set checkpoint_every=N to change)"
            if args.out
            else "nothing (no --out, nothing saved)"
        )
        what = "interrupted (SIGTERM)" if signum == 15 else "interrupted"
        print(f"\naddnorm train: {what}; --resume would continue from {where}", file=sys.stderr)
        return 128 + signum
    if not info.is_main:
        return 0
    summary = result.summary()
    report = {
        "preset": args.preset,
        "summary": summary,
        "data": data.describe(cfg.seq_len),
        "model": dataclasses.asdict(mcfg),
        "train": dataclasses.asdict(cfg),
        "world_size": info.world_size,
        "losses": [x if math.isfinite(x) else None for x in result.losses],
        "evals": result.evals,
        "figures": [],
    }
    if cfg.out_dir:
        from addnorm.io import atomic_write_json

        out = Path(cfg.out_dir)
        try:
            png = _plot(result, out / "loss.png", f"{args.preset}: loss vs step")
            if png:
                report["figures"].append(png)
            atomic_write_json(out / "summary.json", report)
        except OSError as e:  # the run and its checkpoint are done; only the report could not be written
            print(
                f"addnorm train: error: cannot write the report into --out {args.out}: {describe_os_error(e)}",
                file=sys.stderr,
            )
            return 2
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
        on_eval = f" ({f(s['eval_optimum'])} on the validation tokens)" if s.get("eval_optimum") is not None else ""
        print(f"  optimum        {f(s['optimum'])}{on_eval}   excess loss {f(s['excess_loss'])}")
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
        description=__doc__.replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        help="model preset, a TransformerConfig.preset name such as gpt2, llama or deepnet "
        "(default gpt2; an unknown name lists them all)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="set a model or training field (repeatable), e.g. --set n_layers=6 --set z_loss=1e-4",
    )
    p.add_argument("--steps", type=int, help="training steps (default 200)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, help="warmup steps (default 20)")
    p.add_argument("--batch-size", type=int, help="global batch size (default 16)")
    p.add_argument("--seq-len", type=int, help="sequence length (default 64)")
    p.add_argument("--seed", type=int, help="seed of model init, data order and dropout (default 0)")
    p.add_argument("--data", metavar="FILE", help="train on this text file (bytes) instead of the synthetic language")
    p.add_argument("--data-seed", type=int, help="seed of the synthetic language itself (default 0)")
    p.add_argument("--device", help="cpu or cuda (default cpu)")
    p.add_argument("--monitor", action="store_true", help="record per-layer telemetry every step into the log")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write log.jsonl, checkpoint.pt, summary.json, loss.png here; one run at a time per directory",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out DIR from DIR/checkpoint.pt, with the flags it was started with "
        "(saved in DIR/args.json; a flag given again must agree)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_training)
