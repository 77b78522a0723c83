"""The training loop the lab and users share: AdamW, warmup + decay, clipping, z-loss, monitoring, checkpoints.

One step on a batch of inputs x and targets y (B, T):

    logits = model(x)                                          # (B, T, V)
    loss   = CE(logits, y) + z_loss * mean((log Z)^2),   log Z = logsumexp(logits, -1)
    clip the global gradient norm to ``clip``; AdamW step; schedule step

Weight decay applies to matrices only (``dim >= 2``: linear and embedding weights), never to norm gains or biases.
With ``independent_wd`` the decay per step is ``weight_decay * m(t)`` (m the schedule multiplier), not
``lr * weight_decay * m(t)`` as in torch's AdamW (Wortsman et al. 2023); it is torch's AdamW with the group's
decay set to ``weight_decay / lr``, which makes ``lr(t) * wd_group = weight_decay * m(t)`` exactly.

Checkpoints (``checkpoint.pt`` in ``out_dir``, every ``checkpoint_every`` steps and at the end) are written with
:func:`addnorm.io.atomic_write` (a kill never leaves half a checkpoint; a temporary left by a kill is removed when
the next run starts). They hold the model, optimizer, scheduler, step, every RNG state and the curves so far; the
data position is the step (batches are a function of it). Resuming gives the same losses as an uninterrupted run.
They are loaded with ``torch.load(weights_only=True)`` (a checkpoint from elsewhere cannot run code) and validated:
a damaged one is a :class:`CheckpointError` naming the file, never a traceback from deep inside torch. A torn last
line of ``log.jsonl`` (a crash or a full disk mid-write) is dropped on resume.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.io import atomic_write, atomic_write_text
from addnorm.train import distributed as D
from addnorm.train.schedules import SCHEDULES, lr_multiplier, make_scheduler

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "z_loss",
    "build_optimizer",
    "detect_spikes",
    "evaluate",
    "CheckpointError",
    "load_checkpoint",
    "save_checkpoint",
]

CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"


@dataclass(kw_only=True)
class TrainConfig:
    """Everything about a run except the model and the data. Defaults follow Wortsman et al. 2023's setup."""

    steps: int = 200
    batch_size: int = 16  # global: split over data-parallel ranks
    seq_len: int = 64
    lr: float = 1e-3  # peak
    warmup: int = 20
    schedule: str = "cosine"  # cosine | inverse_sqrt | constant
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    independent_wd: bool = False
    clip: float | None = 1.0  # None or 0: no clipping (the norm is still measured)
    z_loss: float = 0.0
    seed: int = 0  # model init is the caller's; this seeds the data and dropout
    monitor: bool = False  # record addnorm.diagnostics.Monitor every `monitor_every` steps
    monitor_every: int = 1
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    # Steps between checkpoints (when out_dir is set; 0: only at the end). 50: at the CLI's default model a step
    # takes 0.1-0.2 s on a 2-core CPU and a checkpoint ~0.05 s (fsync included), so a kill loses at most ~10 s of
    # work for well under 1% of the run's time; both costs grow with the model alike, so the ratio holds.
    checkpoint_every: int = 50
    out_dir: str | None = None  # JSONL log + checkpoint; None: nothing written
    resume: bool = False  # continue from out_dir/checkpoint.pt when present
    diverge_factor: float = 3.0  # stop when the loss is non-finite or above this times the initial loss
    spike_window: int = 128  # (>= 2) OLMo-core's rule: a spike is > mean + spike_sigma * std of the last window values
    spike_sigma: float = 6.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        # Types first: a value from `--set lr=abc` must fail here, naming the field, not deep in a comparison.
        for name in (
            "lr",
            "min_lr_ratio",
            "beta1",
            "beta2",
            "adam_eps",
            "weight_decay",
            "z_loss",
            "diverge_factor",
            "spike_sigma",
        ) + (("clip",) if self.clip is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
                raise TypeError(f"TrainConfig.{name} must be a number, got {v!r}")
        for name in ("independent_wd", "monitor", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"TrainConfig.seed must be an int, got {self.seed!r}")
        if not 0 <= self.seed < 2**32:  # torch.manual_seed overflows beyond 64 bits; one range for lab and train
            raise ValueError(f"TrainConfig.seed must be in [0, 2**32), got {self.seed}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"TrainConfig.device must be a torch device such as 'cpu' or 'cuda', got {self.device!r}"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TrainConfig.device is {self.device!r} but torch.cuda.is_available() is False")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"TrainConfig.device is {self.device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        positive = ("steps", "batch_size", "seq_len", "eval_batches", "monitor_every")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("warmup", "eval_every", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrainConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("weight_decay", "z_loss", "min_lr_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.spike_window, int) or self.spike_window < 2:
            raise ValueError(f"TrainConfig.spike_window must be an int >= 2, got {self.spike_window!r}")
        if self.clip is not None and self.clip < 0:
            raise ValueError(f"TrainConfig.clip must be None or >= 0, got {self.clip}")
        if self.resume and not self.out_dir:
            raise ValueError("TrainConfig.resume needs out_dir (where the checkpoint is)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass(kw_only=True)
class TrainResult:
    """Curves (one value per step) and the stability summary of a run."""

    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    logz: list[float] = field(default_factory=list)  # mean output log Z of the step's batch
    step_times: list[float] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # Monitor records (with their "step")
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    optimum: float | None = None  # the best achievable expected loss, when the data knows it
    # the best achievable loss on the very validation tokens of the final evaluation (same sampling noise as it)
    eval_optimum: float | None = None
    initial_loss: float = math.nan
    final_loss: float = math.nan  # validation loss at the end (nan when diverged)
    best_loss: float = math.nan  # lowest validation loss seen
    spikes: list[int] = field(default_factory=list)
    max_grad_norm: float = math.nan
    diverged: bool = False
    steps_done: int = 0

    @property
    def excess_loss(self) -> float | None:
        """final_loss minus the best possible loss on the same validation tokens (``eval_optimum``) when the data
        can score them, else minus the expected optimum: a few thousand validation tokens carry sampling noise of
        about 0.01-0.02 nats, which would otherwise show up as a "negative excess" near convergence."""
        ref = self.eval_optimum if self.eval_optimum is not None else self.optimum
        return None if ref is None else self.final_loss - ref

    def summary(self) -> dict[str, Any]:
        """The JSON-friendly stability metrics (non-finite numbers become None)."""

        def num(x):
            return None if x is None or not math.isfinite(x) else float(x)

        times = self.step_times[1:] or self.step_times  # the first step pays one-off costs
        return {
            "steps": self.steps_done,
            "final_loss": num(self.final_loss),
            "best_loss": num(self.best_loss),
            "initial_loss": num(self.initial_loss),
            "optimum": num(self.optimum),
            "eval_optimum": num(self.eval_optimum) if self.eval_optimum is not None else None,
            "excess_loss": num(self.excess_loss) if self.excess_loss is not None else None,
            "spikes": len(self.spikes),
            "spike_steps": list(self.spikes),
            "max_grad_norm": num(self.max_grad_norm),
            "diverged": self.diverged,
            "step_time_s": num(float(np.median(times))) if times else None,
        }


# --------------------------------------------------------------------------------------------------------------
# Pieces (each tested on its own)
# --------------------------------------------------------------------------------------------------------------


def z_loss(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(mean (log Z)^2, mean log Z) over all positions, log Z = logsumexp over the vocabulary (in fp32)."""
    logz = torch.logsumexp(logits.float(), dim=-1)
    return (logz**2).mean(), logz.detach().mean()


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decay on matrices only; independent decay as ``weight_decay / lr`` (see the module docstring)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    wd = cfg.weight_decay / cfg.lr if cfg.independent_wd else cfg.weight_decay
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
    try:  # the fused kernel: one call for all tensors, ~25% less step time on tiny CPU models
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not cover
        return torch.optim.AdamW(groups, **kw)


def detect_spikes(values: list[float], *, window: int = 128, sigma: float = 6.0, min_history: int = 16) -> list[int]:
    """Indices of spikes in a loss curve by OLMo-core's rule (above mean + sigma * std of the last ``window``
    values), through :class:`addnorm.diagnostics.SpikeDetector`. Non-finite values count as spikes."""
    from addnorm.diagnostics import SpikeDetector

    detector = SpikeDetector(window=window, sigmas=sigma, min_history=min(min_history, window))
    return [i for i, v in enumerate(values) if detector.update(v)]


def _logits(model: nn.Module, x: Tensor) -> Tensor:
    out = model(x)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "logits", out)


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: TrainConfig, info: D.DistInfo | None = None) -> float:
    """Mean validation loss over ``cfg.eval_batches`` fixed batches (each rank its slice, averaged)."""
    info = info or D.current()
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=cfg.device)
    rows = D.local_slice(cfg.batch_size, info)
    for i in range(cfg.eval_batches):
        x, y = data.batch(i, cfg.batch_size, cfg.seq_len, seed=cfg.seed, split="val")
        x, y = x[rows].to(cfg.device), y[rows].to(cfg.device)
        logits = _logits(model, x)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    model.train(was_training)
    return float(D.mean_across_ranks(total / cfg.eval_batches, info))


def reference_eval_loss(data, cfg: TrainConfig) -> float | None:
    """The data's own best loss on the batches :func:`evaluate` uses (None when the data cannot score them)."""
    if not hasattr(data, "reference_loss"):
        return None
    vals = [
        data.reference_loss(*data.batch(i, cfg.batch_size, cfg.seq_len, seed=cfg.seed, split="val"))
        for i in range(cfg.eval_batches)
    ]
    return sum(vals) / len(vals)


def _jsonable(obj):
    """Monitor records may hold tensors or numpy scalars: make them JSON numbers/lists."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Tensor):
        return _jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


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
    """torch.save into a temporary file in the same directory, fsync, then os.replace (addnorm.io)."""
    atomic_write(path, lambda f: torch.save(state, f), binary=True)


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


def _make_monitor(model: nn.Module, every: int):
    from addnorm.diagnostics import Monitor

    return Monitor(model, record_every=every)


# --------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------


def train(
    model: nn.Module,
    data,
    cfg: TrainConfig,
    *,
    callback: Callable[[dict], None] | None = None,
    stop_at: int | None = None,
) -> TrainResult:
    """Train ``model`` (tokens (B, T) -> logits (B, T, V)) on ``data`` (``.batch(step, B, T, seed=, split=)``).

    Under torchrun the model is wrapped in DistributedDataParallel and each rank trains on its slice of the global
    batch. ``callback`` receives each step's log record (rank 0 only). ``stop_at`` ends the run after that many
    steps while keeping the schedule of ``cfg.steps`` (a simulated interruption; resume continues it).
    """
    info = D.init_from_env(cfg.device)
    for split in ("train", "val"):  # a split too short for seq_len fails now, not at the final evaluation
        data.batch(0, 1, cfg.seq_len, seed=cfg.seed, split=split)
    device = torch.device(cfg.device)
    model.to(device)
    raw = model
    rows = D.local_slice(cfg.batch_size, info)
    if info.enabled and not isinstance(model, nn.parallel.DistributedDataParallel):
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = build_optimizer(raw, cfg)
    sched = make_scheduler(
        opt, schedule=cfg.schedule, warmup=cfg.warmup, total=cfg.steps, min_lr_ratio=cfg.min_lr_ratio
    )
    res = TrainResult(optimum=data.optimum(cfg.seq_len) if hasattr(data, "optimum") else None)
    out = Path(cfg.out_dir) if cfg.out_dir else None
    ckpt_path = out / CHECKPOINT if out else None
    start = 0
    if out is not None and info.is_main and out.is_dir():
        clean_stale_temporaries(out)
    if ckpt_path is not None and cfg.resume and ckpt_path.exists():
        state = load_checkpoint(ckpt_path, cfg, device)
        _check_resumable(ckpt_path, state, cfg)
        try:
            raw.load_state_dict(state["model"])
        except RuntimeError as err:
            raise ValueError(
                f"resume: {ckpt_path} holds a different model (give the model settings of the run "
                f"that wrote it): {str(err).splitlines()[0]}"
            ) from None
        try:
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"])
            res = TrainResult(**state["result"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
            raise CheckpointError(ckpt_path, f"cannot restore it: {type(err).__name__}: {err}") from None
        start = state["step"]
    else:
        torch.manual_seed(cfg.seed + 1_000_003 * info.rank)  # dropout streams: distinct per rank
    if out is not None and info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        _truncate_log(out / LOG, start)
    monitor = _make_monitor(raw, cfg.monitor_every) if cfg.monitor else None
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    model.train()
    try:
        for step in range(start, end):
            t0 = time.perf_counter()
            x, y = data.batch(step, cfg.batch_size, cfg.seq_len, seed=cfg.seed, split="train")
            x, y = x[rows].to(device), y[rows].to(device)
            logits = _logits(model, x)
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            zl, logz = z_loss(logits)
            loss = ce + cfg.z_loss * zl if cfg.z_loss else ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            record = None
            if monitor is not None:
                record = monitor.step(loss=ce)  # None on steps that record_every skips
            gnorm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.clip if cfg.clip else float("inf"))
            lr = opt.param_groups[0]["lr"]
            ce_all = float(D.mean_across_ranks(ce.detach(), info))
            logz_all = float(D.mean_across_ranks(logz, info))
            if step == 0:
                res.initial_loss = ce_all
            if not math.isfinite(ce_all) or ce_all > cfg.diverge_factor * res.initial_loss:
                res.diverged = True
            else:
                opt.step()
                sched.step()
            dt = time.perf_counter() - t0
            res.losses.append(ce_all)
            res.lrs.append(lr)
            res.grad_norms.append(float(gnorm))
            res.logz.append(logz_all)
            res.step_times.append(dt)
            res.steps_done = step + 1
            entry = {"step": step, "loss": ce_all, "lr": lr, "grad_norm": float(gnorm), "logz": logz_all, "time_s": dt}
            if record is not None:
                rec = _jsonable(dict(record) if isinstance(record, dict) else {"record": record})
                rec["step"] = step
                res.records.append(rec)
                entry["monitor"] = rec
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps and not res.diverged:
                res.evals.append((step + 1, evaluate(model, data, cfg, info)))
                entry["val_loss"] = res.evals[-1][1]
            if info.is_main:
                if out is not None:
                    with open(out / LOG, "a") as f:
                        f.write(json.dumps(_jsonable(entry)) + "\n")
                if callback is not None:
                    callback(entry)
            if res.diverged:
                break
            if ckpt_path is not None and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                _checkpoint(ckpt_path, raw, opt, sched, step + 1, res, cfg, info)
    finally:
        if monitor is not None and hasattr(monitor, "detach"):
            monitor.detach()
    if res.diverged:
        res.final_loss = math.nan
    elif res.steps_done == cfg.steps and start < cfg.steps:  # (resuming a finished run keeps its final eval)
        res.final_loss = evaluate(model, data, cfg, info)
        res.evals.append((cfg.steps, res.final_loss))
        res.eval_optimum = reference_eval_loss(data, cfg)
    finite = [v for _, v in res.evals if math.isfinite(v)]
    res.best_loss = min(finite) if finite else math.nan
    res.spikes = detect_spikes(res.losses, window=cfg.spike_window, sigma=cfg.spike_sigma)
    res.max_grad_norm = max((g for g in res.grad_norms if math.isfinite(g)), default=math.nan)
    if ckpt_path is not None and not res.diverged and res.steps_done > start:
        _checkpoint(ckpt_path, raw, opt, sched, res.steps_done, res, cfg, info)
    return res


def _checkpoint(
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


def _truncate_log(path: Path, start: int) -> None:
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


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate the run uses at ``step`` (for plots and checks)."""
    return cfg.lr * lr_multiplier(
        step, schedule=cfg.schedule, warmup=cfg.warmup, total=cfg.steps, min_lr_ratio=cfg.min_lr_ratio
    )
