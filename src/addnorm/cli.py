"""The ``addnorm`` command line. Each subcommand lives with the code it drives; this file only assembles them.

A subcommand module exposes ``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import sys

import addnorm  # cheap: the package imports torch only when a public function is first used

# command -> (the module whose register(subparsers) adds it, its line in `addnorm --help`). Only the module of the
# command being run is imported: `addnorm --version` and `addnorm --help` must answer in a fraction of a second,
# and importing torch (which the packages behind these modules do) alone takes ~3 s.
COMMANDS: dict[str, tuple[str, str]] = {
    "lab": ("addnorm.lab.cli", "run the stability lab experiments and write an HTML/Markdown/JSON report"),
    "train": ("addnorm.train.cli", "train one model configuration and report loss curves and stability metrics"),
    "doctor": (
        "addnorm.diagnostics.doctor.cli",
        "check a model for Add & Norm mistakes (norm axis, skip path, placement vs depth, precision)",
    ),
    "survey": (
        "addnorm.integrations.survey.cli",
        "where every transformers architecture puts its norms, measured from the running model",
    ),
}


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None


def collect_info() -> dict:
    """Versions, devices and which backends can run here (and why not the others)."""
    import os

    import torch

    from addnorm.ops.backends import available_backends

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    info = {
        "addnorm": addnorm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "numpy": _version("numpy"),
        "transformers": _version("transformers"),
        "matplotlib": _version("matplotlib"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "backend_env": os.environ.get("ADDNORM_BACKEND"),
        "backends": {d: available_backends(d) for d in devices},
    }
    from addnorm.ops.backends import resolve_backend

    info["auto"] = {}
    for d in devices:
        try:
            info["auto"][d] = resolve_backend("auto", torch.device(d))
        except Exception as err:  # noqa: BLE001 - a bad ADDNORM_BACKEND is what `info` must show, not die on
            info["auto"][d] = f"error: {err}"
    return info


def _info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"addnorm {info['addnorm']}  (python {info['python']}, {info['platform']})")
    for key in ("torch", "triton", "numba", "numpy", "transformers", "matplotlib"):
        print(f"  {key:<13}{info[key] or 'not installed'}")
    print(f"  {'cpu':<13}{info['cpu_count']} cores, torch uses {info['torch_threads']} threads")
    print(f"  {'cuda':<13}{info['cuda_device'] or 'no CUDA device'}")
    if info["backend_env"]:
        print(f"  ADDNORM_BACKEND={info['backend_env']}")
    for device, backends in info["backends"].items():
        print(f"backends for {device} tensors (auto -> {info['auto'][device]}):")
        for name, reason in backends.items():
            print(f"  {name:<10}{'available' if reason is None else 'unavailable: ' + reason}")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with ``command``'s own parser registered from its module (every command, for "all"); the other
    commands are listed by name and summary only."""
    parser = argparse.ArgumentParser(
        prog="addnorm",
        description="addnorm: residual connections and normalization for Transformers, done right and fast.",
    )
    parser.add_argument("--version", action="version", version=f"addnorm {addnorm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "info",
        help="versions, devices and which backends run here (and why not the others)",
        description="Print the versions of addnorm and its dependencies, the CPU and CUDA devices, and for each "
        "device which kernel backends can run here (and why not the others) and what backend='auto' "
        "picks. --json prints the same as one JSON object (keys: addnorm, python, platform, torch, "
        "triton, numba, numpy, transformers, matplotlib, cpu_count, torch_threads, cuda, cuda_device, "
        "backend_env, backends, auto).",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_info)
    for name, (module, summary) in COMMANDS.items():
        if command in (name, "all"):
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the top-level options take no value, so the first word that is not an option names the command
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # stdout closed early (`addnorm lab --list | head`): the reader has what it wanted, so no traceback. Point
        # stdout at devnull so the interpreter's final flush does not raise again; 141 = 128 + SIGPIPE, as a shell
        # reports a command a pipe ended.
        import os

        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
