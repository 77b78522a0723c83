"""Checkpoints of a training run and the files of its ``out_dir``.

Checkpoints (``checkpoint.pt`` in ``out_dir``, every ``checkpoint_every`` steps and at the end) are written with
:func:`addnorm.io.atomic_write` (a kill never leaves half a checkpoint; a temporary left by a kill is removed when
the next run starts). They hold the model, optimizer, scheduler, step, every RNG state and the curves so far; the
data position is the step (batches are a function of it). Resuming gives the same losses as an uninterrupted run.
They are loaded with ``torch.load(weights_only=True)`` (a checkpoint from elsewhere cannot run code) and validated:
a damaged one is a :class:`CheckpointError` naming the file, never a traceback from deep inside torch. A torn last
line of ``log.jsonl`` (a crash or a full disk mid-write) is dropped on resume.

A resumed run must use the settings of the run that wrote the checkpoint (``_RESUME_MUST_MATCH``), else it is an error.
"""

from __future__ import annotations

import io
import json
import random
import re
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from addnorm.io import atomic_write, atomic_write_text
from addnorm.train import distributed as D
from addnorm.train.config import TrainConfig, TrainResult

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"


def _rng_state() -> dict:
    """Every RNG's state as tensors, ints and tuples only: what ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save into memory, then the bytes into a temporary file in the same directory, fsync, os.replace
    (addnorm.io). Serialising first keeps a full disk an OSError (ENOSPC) from our own write: inside torch.save
    it surfaced as an opaque ``inline_container.cc`` RuntimeError."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(path, lambda f: f.write(buffer.getbuffer()), binary=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: ``PATH is not a readable checkpoint (why)``."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} is not a readable checkpoint ({why})")


# key -> the type its value must have, checked before anything is restored from it
_CHECKPOINT_KEYS = {
    "model": dict,
    "optimizer": dict,
    "scheduler": dict,
    "step": int,
    "rng": dict,
    "result": dict,
    "config": dict,
}


def load_checkpoint(path: Path, cfg: TrainConfig, device: torch.device | str = "cpu") -> dict:
    """The checkpoint at ``path``, validated against the run ``cfg`` describes; CheckpointError when the file is
    empty, truncated, not a torch checkpoint, holds something that is not plain data (``weights_only=True``
    refuses to run code), lacks a part, or stands at a step beyond the run."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(path, f"cannot read it: {e.strerror or e}") from None
    if size == 0:
        raise CheckpointError(path, "the file is empty")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, OSError, ...
        text = str(e)
        if "Unsupported global" in text:  # a class or function reference: what a pickle runs code through
            name = re.search(r"GLOBAL (\S+)", text)
            raise CheckpointError(
                path,
                "it holds objects other than tensors and plain data"
                f"{f' ({name.group(1)})' if name else ''}, which torch.load(weights_only=True) "
                "refuses: loading them could run code",
            ) from None
        # torch's weights-only message is a page long; its one informative line follows "WeightsUnpickler error:"
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        first = detail.group(1) if detail else (text.strip().splitlines() or [""])[0]
        first = first.strip().split(". ")[0][:200]  # the first sentence: the rest is advice for torch.load callers
        raise CheckpointError(path, f"torch.load failed: {type(e).__name__}: {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"it holds a {type(state).__name__}, not a training state")
    missing = [k for k in _CHECKPOINT_KEYS if k not in state]
    if missing:
        raise CheckpointError(path, f"missing {', '.join(missing)}")
    for key, kind in _CHECKPOINT_KEYS.items():
        if not isinstance(state[key], kind) or (kind is int and isinstance(state[key], bool)):
            raise CheckpointError(path, f"{key!r} is a {type(state[key]).__name__}, not a {kind.__name__}")
    step = state["step"]
    if not 0 <= step <= cfg.steps:
        raise CheckpointError(path, f"step {step} is outside this run of {cfg.steps} steps")
    losses = state["result"].get("losses")
    if not isinstance(losses, list) or len(losses) != step:
        raise CheckpointError(path, f"its loss curve does not have one value per step up to step {step}")
    unknown = set(state["result"]) - {f.name for f in fields(TrainResult)}
    if unknown:
        raise CheckpointError(path, f"unknown result fields {sorted(unknown)}")
    if not all(k in state["rng"] for k in ("torch", "python", "numpy")):
        raise CheckpointError(path, "its RNG states are incomplete")
    return state


def clean_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporaries a kill during a write leaves in ``out`` (the old ``.checkpoint.pt.tmp-<pid>`` and
    addnorm.io's ``.NAME.<random>.tmp``). Only one run writes into an --out at a time (two would interleave their
    log and checkpoints anyway), so any temporary found at the start of a run is stale."""
    removed = []
    for name in (CHECKPOINT, LOG):
        for tmp in [*out.glob(f".{name}.tmp-*"), *out.glob(f".{name}.*.tmp")]:
            try:
                tmp.unlink()
                removed.append(tmp)
            except FileNotFoundError:
                pass
    return removed


def resume(path: Path, cfg: TrainConfig, device: torch.device, raw: nn.Module, opt, sched) -> tuple[TrainResult, int]:
    """Restore the model ``raw``, the optimizer, the scheduler and every RNG from the checkpoint at ``path`` (validated
    against ``cfg``); returns the run's result so far and the step to continue from."""
    state = load_checkpoint(path, cfg, device)
    _check_resumable(path, state, cfg)
    try:
        raw.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ValueError(
            f"resume: {path} holds a different model (give the model settings of the run "
            f"that wrote it): {str(err).splitlines()[0]}"
        ) from None
    try:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        res = TrainResult(**state["result"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise CheckpointError(path, f"cannot restore it: {type(err).__name__}: {err}") from None
    return res, state["step"]


def write_checkpoint(
    path: Path, raw: nn.Module, opt, sched, step: int, res: TrainResult, cfg: TrainConfig, info: D.DistInfo
) -> None:
    if info.is_main:
        result = asdict(res)
        save_checkpoint(
            path,
            {
                "model": raw.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "step": step,
                "rng": _rng_state(),
                "result": result,
                "config": asdict(cfg),
            },
        )
    D.barrier(info)


# TrainConfig fields that shape the run's trajectory: a resumed run must use the checkpoint's values, or it would
# silently continue another run (a different schedule length, learning rate or data order).
_RESUME_MUST_MATCH = (
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "schedule",
    "min_lr_ratio",
    "beta1",
    "beta2",
    "adam_eps",
    "weight_decay",
    "independent_wd",
    "clip",
    "z_loss",
    "seed",
)


def _check_resumable(path: Path, state: dict, cfg: TrainConfig) -> None:
    saved = state.get("config") or {}
    diff = [
        f"{k}={getattr(cfg, k)!r} (checkpoint: {saved[k]!r})"
        for k in _RESUME_MUST_MATCH
        if k in saved and saved[k] != getattr(cfg, k)
    ]
    if diff:
        raise ValueError(
            f"resume: {path} was written by a run with other settings: {', '.join(diff)}; resume "
            "with the original settings, or train into a new directory"
        )


def truncate_log(path: Path, start: int) -> None:
    """Keep the log lines of steps before ``start`` (a resumed run rewrites what came after its checkpoint).

    A last line that is not a complete JSON record is what a crash or a full disk leaves mid-write: it is dropped.
    A damaged line before the last is not something a crash does, and is an error naming the file and line."""
    if not path.exists():
        return
    if start == 0:
        path.unlink()
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["step"]
        except (ValueError, TypeError, KeyError):
            if i == len(lines) - 1:
                break  # torn by the crash that the run resumes from
            raise ValueError(f"resume: {path} line {i + 1} is not a log record: {line[:80]!r}") from None
        if isinstance(step, int) and step < start:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))
