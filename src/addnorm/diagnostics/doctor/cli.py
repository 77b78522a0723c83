"""``addnorm doctor``: load a user's model (``FILE.py:FACTORY`` or a Hugging Face config) and run the checks of
:mod:`addnorm.diagnostics.doctor` on it.

The doctor executes the user's code by design, so it guards itself against what that code may do:

- anything the target prints goes to stderr, never to stdout, which carries only the report (``--json`` stays
  parseable however chatty the factory or ``forward`` is);
- a target that calls ``sys.exit(N)`` or ``os._exit(N)`` is a target that could not be loaded (exit 2), never a
  silent clean pass (``os._exit`` is replaced while the target runs: it would end the process with no output);
- ``--timeout SECONDS`` bounds the whole load + check (SIGALRM: POSIX main thread only; elsewhere no limit; at
  most 1e9 s, beyond which the interval timer overflows);
- Ctrl-C exits 130 with a message, like ``addnorm lab`` and ``addnorm train``.

Exit status: 1 if any finding is an error, 2 if the target could not be loaded or checked, 130 on Ctrl-C, else 0.
With ``--json`` every one of these exits prints one JSON object on stdout: ``{"findings": [...]}`` (0, 1), else
``{"findings": [], "error": MESSAGE, "status": "error" | "timeout" | "interrupted", "exit_code": 2 | 130}``, the
message also on stderr. (A command line argparse refuses, e.g. ``--timeout soon``, exits 2 with its usage message
only, before the doctor runs.)
This module imports torch only inside its functions: ``addnorm --help`` registers it without paying for torch.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from addnorm._limits import time_limit

__all__ = ["TargetError", "DoctorTimeout", "load_target", "build_hf_model", "register", "main"]

MAX_TIMEOUT_S = 1e9  # about 31 years; setitimer raises OverflowError from 1e10 s
DEFAULT_TIMEOUT_S = 600.0  # generous: building a random-init model from a large --hf-config takes minutes on a CPU


class TargetError(Exception):
    """The doctor's target could not be loaded (bad path, factory, return value); the CLI exits with 2.
    ``__cause__`` holds the user's exception, whose traceback ``--traceback`` prints."""


class DoctorTimeout(BaseException):
    """The target did not finish within --timeout. A BaseException, so that a target's ``except Exception`` (common
    in user code) cannot swallow it."""


class _HardExit(SystemExit):
    """What ``os._exit(n)`` raises while the doctor runs the target: it would end the process at once, with no
    output and the target's status (0 reads as a clean pass)."""


def _exit_text(e: SystemExit) -> str:
    if isinstance(e, _HardExit):
        return f"os._exit({e.code!r})"
    return f"sys.exit({e.code!r})" if e.code is not None else "sys.exit()"


@contextlib.contextmanager
def _no_hard_exit():
    """Turn ``os._exit`` into a catchable exit while the target runs in this process. A forked child (a DataLoader
    worker, multiprocessing) still exits for real: os._exit is how such children end."""
    real, pid = os._exit, os.getpid()

    def hard_exit(status: int = 0) -> None:
        if os.getpid() != pid:
            real(status)
        raise _HardExit(status)

    os._exit = hard_exit
    try:
        yield
    finally:
        os._exit = real


# ---- loading targets ----------------------------------------------------------------------------------------------
def load_target(target: str) -> tuple[Any, Any]:
    """Import FILE.py and call FACTORY() from ``"FILE.py:FACTORY"``; raises TargetError with a readable reason."""
    from torch import nn

    path_str, sep, factory_name = target.rpartition(":")
    if not sep or not path_str or not factory_name:
        raise TargetError(f"TARGET must look like FILE.py:FACTORY, got {target!r}")
    path = Path(path_str)
    if not path.is_file():
        raise TargetError(f"TARGET file not found: {path_str}")
    mod_name = f"_addnorm_doctor_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path_str} as a Python module")
    module = importlib.util.module_from_spec(spec)
    # resolved once: a module that calls os.chdir at import would make a relative path resolve elsewhere afterwards
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        raise TargetError(f"importing {path_str} called {_exit_text(e)}: a target that exits cannot be checked") from e
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"importing {path_str} failed: {type(e).__name__}: {e}") from e
    finally:
        if folder in sys.path:  # the module may have edited sys.path itself
            sys.path.remove(folder)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise TargetError(f"{path_str} has no attribute {factory_name!r}")
    if not callable(factory):
        raise TargetError(f"{path_str}:{factory_name} is not callable (got {type(factory).__name__})")
    try:
        result = factory()
    except SystemExit as e:
        raise TargetError(f"{factory_name}() called {_exit_text(e)}: a target that exits cannot be checked") from e
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"{factory_name}() raised {type(e).__name__}: {e}") from e
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        got = type(result).__name__ if not isinstance(result, tuple) else f"a tuple of {len(result)}"
        raise TargetError(f"{factory_name}() must return (model, example_batch) with model an nn.Module; got {got}")
    return result


def _check_model_type(model_type: str, where: str) -> None:
    """An unknown model_type named with its close matches (transformers' own error lists all ~400 types)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type in known:
        return
    close = difflib.get_close_matches(model_type, known, n=5, cutoff=0.6)
    hint = (
        f"did you mean {' or '.join(repr(c) for c in close)}?"
        if close
        else f"no model type of transformers {transformers.__version__} is close to it"
    )
    raise TargetError(f"--hf-config: {where} has model_type {model_type!r}, which transformers does not know; {hint}")


def _short(e: Exception, limit: int = 500) -> str:
    """One line: the whole message (transformers' validation errors put the cause on their second line), and the
    chained cause when the message does not already say it."""
    text = " ".join(str(e).split())
    cause = e.__cause__ or e.__context__
    cause_text = " ".join(str(cause).split()) if cause is not None else ""
    if cause_text and cause_text not in text:
        text += f" (caused by {type(cause).__name__}: {cause_text})"
    return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


def build_hf_model(config_path: str, *, batch_size: int = 2, seq_len: int = 11) -> tuple[Any, dict]:
    """A randomly initialised Hugging Face model from a local config.json (or its folder), and a random batch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local config must never trigger a download
    try:
        import transformers
    except ImportError as e:
        raise TargetError("--hf-config needs transformers: pip install 'addnorm[hf]'") from e
    import torch

    path = Path(config_path)
    if not path.exists():
        raise TargetError(f"--hf-config: {config_path} not found")
    json_file = path if path.is_file() else path / "config.json"
    try:
        data = json.loads(json_file.read_text(encoding="utf-8")) if json_file.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TargetError(f"--hf-config: cannot read {json_file}: {_short(e)}") from e
    if path.is_file() and not isinstance(data, dict):
        raise TargetError(f"--hf-config: {config_path} is not a JSON object (a Hugging Face config.json)")
    if isinstance(data, dict):
        model_type = data.get("model_type")
        if not model_type or not isinstance(model_type, str):
            raise TargetError(f"--hf-config: {json_file} has no 'model_type'")
        _check_model_type(model_type, str(json_file))
    try:
        if path.is_file():
            fields = {k: v for k, v in data.items() if k != "model_type"}
            config = transformers.AutoConfig.for_model(data["model_type"], **fields)
        else:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"--hf-config: cannot read {config_path}: {_short(e)}") from e
    if hasattr(config, "use_cache"):
        config.use_cache = False  # no KV cache objects in the block calls the doctor replays
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = transformers.AutoModel.from_config(config)
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"--hf-config: cannot build a model for {type(config).__name__}: {_short(e)}") from e
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise TargetError("--hf-config: the config has no vocab_size; use FILE.py:FACTORY for this model")
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (batch_size, seq_len), generator=g)}
    if getattr(config, "is_encoder_decoder", False):  # T5, BART, ...: the decoder needs its own inputs
        batch["decoder_input_ids"] = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return model, batch


# ---- guarding against the target ----------------------------------------------------------------------------------
def _time_limit(seconds: float):
    """Raise DoctorTimeout in the main thread after ``seconds`` of wall time (0: no limit)."""

    def expire():
        raise DoctorTimeout(seconds)

    return time_limit(seconds, expire)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send what the target writes to stdout to stderr: Python's ``print`` (sys.stdout) and, where file descriptor 1
    can be duplicated, writes to the descriptor itself (``os.write(1, ...)``, C extensions)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 (a closed stdout): Python-level redirection only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            _flush_c_stdio()  # what C code buffered goes where it was written: stderr
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask (not POSIX): nothing buffered there
        pass


def _load_and_check(args: argparse.Namespace) -> tuple[list, str]:
    """(findings, title); runs the user's code with its output sent to stderr."""
    from addnorm.diagnostics.doctor.diagnosis import diagnose, why_not_checkable

    with _stdout_to_stderr(), _no_hard_exit():  # stdout carries only the report
        if args.hf_config and args.target:
            raise TargetError("give either TARGET or --hf-config, not both")
        if args.hf_config:
            model, batch = build_hf_model(args.hf_config)
            title = f"{type(model).__name__} from {args.hf_config} (random init)"
        elif args.target:
            model, batch = load_target(args.target)
            title = f"{type(model).__name__} from {args.target}"
        else:
            raise TargetError("give TARGET (FILE.py:FACTORY) or --hf-config CONFIG.json")
        if why_not_checkable(model) is not None:  # a target the doctor cannot take: exit 2 with the reason
            raise TargetError(why_not_checkable(model))
        try:
            findings = diagnose(model, batch)
            if [f.code for f in findings] == ["values-not-checked"]:  # nothing was checked: not a clean pass
                raise TargetError(f"{findings[0].message}; {findings[0].fix}")
        except TargetError:
            raise
        except SystemExit as e:  # the model's forward/backward exited: not a clean pass
            raise TargetError(
                f"the model called {_exit_text(e)} during the example forward/backward: a target "
                "that exits cannot be checked"
            ) from e
        except Exception as e:  # noqa: BLE001 - a bug in the doctor itself should still say what happened
            raise _CheckFailed(e) from e
    return findings, title


class _CheckFailed(Exception):
    """The checks themselves raised (a doctor bug, or a model the checks cannot handle)."""


# ---- CLI ------------------------------------------------------------------------------------------------------------
def _print_human(findings: list, title: str) -> None:
    """Findings grouped by severity; the same finding in several modules (every layer, usually) printed once."""
    from addnorm.diagnostics.doctor.findings import SEVERITIES

    print(f"addnorm doctor: {title}")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    for sev in SEVERITIES:
        groups: dict[tuple, list[str]] = {}
        for f in findings:
            if f.severity == sev:
                groups.setdefault((f.code, f.message, f.fix), []).append(f.module)
        if not groups:
            continue
        print(f"\n{sev.upper()}S ({counts[sev]})" if counts[sev] > 1 else f"\n{sev.upper()} (1)")
        for (code, message, fix), modules in groups.items():
            where = (
                modules[0]
                if len(modules) == 1
                else f"{', '.join(modules[:4])}" + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
            )
            print(f"  [{code}] {where}")
            print(f"      {message}")
            if fix and fix != "none needed":
                print(f"      fix: {fix}")
    print(f"\n{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)")


def _print_traceback(err: BaseException | None) -> None:
    if err is not None:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)


def _failed(args: argparse.Namespace, status: str, message: str, code: int, lead: str = "") -> int:
    """Exit ``code`` without findings: the message on stderr, and with --json also one JSON object on stdout, so a
    caller that runs json.loads on stdout gets the reason rather than an empty string. ``status``: "error" (the
    target could not be loaded or checked), "timeout" or "interrupted"; a report of findings has no "error" key."""
    print(f"{lead}addnorm doctor: {message}", file=sys.stderr)
    if args.json:
        report = {"findings": [], "error": message, "status": status, "exit_code": code}
        print(json.dumps(report, indent=2), flush=True)
    return code


def _doctor(args: argparse.Namespace) -> int:
    hint = "" if args.traceback else " (--traceback shows where)"
    try:
        with _time_limit(args.timeout):
            findings, title = _load_and_check(args)
    except TargetError as e:
        if args.traceback:
            _print_traceback(e.__cause__)
        return _failed(args, "error", f"{e}{hint if e.__cause__ is not None else ''}", 2)
    except _CheckFailed as e:
        if args.traceback:
            _print_traceback(e.__cause__)
        cause = e.__cause__
        return _failed(args, "error", f"the checks themselves failed: {type(cause).__name__}: {cause}{hint}", 2)
    except DoctorTimeout:
        message = (
            f"the target did not finish loading and checking within --timeout {args.timeout:g} s; "
            "give a longer --timeout (0: none) or a smaller model"
        )
        return _failed(args, "timeout", message, 2)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", "interrupted", 130, lead="\n")
    if args.json:
        print(json.dumps({"findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        _print_human(findings, title)
    return 1 if any(f.severity == "error" for f in findings) else 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0 (0: no limit), got {text!r}")
    if value > MAX_TIMEOUT_S:  # the interval timer overflows above about 1e10 s on a 64-bit time_t
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:g} seconds (0: no limit), got {text!r}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check a model for Add & Norm mistakes (norm axis, skip path, placement vs depth, precision)",
        description="Static checks plus one forward/backward on FACTORY()'s (model, example_batch). What the "
        "target prints goes to stderr (stdout carries only the report). Exit status: 1 if an error was found (a "
        "forward or backward that raises is one), 2 if the target could not be loaded or checked (importing it or "
        "FACTORY() raised, it called sys.exit, or it ran past --timeout), 130 on Ctrl-C, else 0.",
    )
    p.add_argument("target", nargs="?", help="FILE.py:FACTORY, FACTORY() returning (model, example_batch)")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"findings": [...]} as JSON; when the target cannot be loaded or checked (exit 2) or on Ctrl-C '
        '(130): {"findings": [], "error": MESSAGE, "status": "error" (or "timeout", "interrupted"), "exit_code": N}',
    )
    p.add_argument(
        "--hf-config",
        metavar="CONFIG.json",
        help="build a random-init Hugging Face model from a local config.json (or its folder)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"give up when loading and checking the target takes longer (default {DEFAULT_TIMEOUT_S:g}; 0: no limit)",
    )
    p.add_argument(
        "--traceback",
        action="store_true",
        help="when the target fails to load (or the checks fail), print the Python traceback: where in "
        "your file it failed",
    )
    p.set_defaults(func=_doctor)


def main(argv: list[str] | None = None) -> int:
    """``python -m addnorm.diagnostics.doctor.cli ...``: the doctor without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="addnorm")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
