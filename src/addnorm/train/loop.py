"""The training loop the lab and users share: AdamW, warmup + decay, clipping, z-loss, monitoring, checkpoints.

One step on a batch of inputs x and targets y (B, T):

    logits = model(x)                                          # (B, T, V)
    loss   = CE(logits, y) + z_loss * mean((log Z)^2),   log Z = logsumexp(logits, -1)
    clip the global gradient norm to ``clip``; AdamW step; schedule step

Weight decay applies to matrices only (``dim >= 2``: linear and embedding weights), never to norm gains or biases.
With ``independent_wd`` the decay per step is ``weight_decay * m(t)`` (m the schedule multiplier), not
``lr * weight_decay * m(t)`` as in torch's AdamW (Wortsman et al. 2023); it is torch's AdamW with the group's
decay set to ``weight_decay / lr``, which makes ``lr(t) * wd_group = weight_decay * m(t)`` exactly.

The run's settings and its result are in :mod:`addnorm.train.config`; checkpoints, resuming and the files in
``out_dir`` in :mod:`addnorm.train.checkpoint`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.train import distributed as D
from addnorm.train.checkpoint import (
    CHECKPOINT,
    LOG,
    clean_stale_temporaries,
    resume,
    truncate_log,
    write_checkpoint,
)
from addnorm.train.config import TrainConfig, TrainResult
from addnorm.train.schedules import lr_multiplier, make_scheduler

__all__ = ["train", "z_loss", "build_optimizer", "detect_spikes", "evaluate"]


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


def finite_weights(model: nn.Module) -> bool:
    """Every floating parameter finite (one reduction per tensor; run before a checkpoint and at the end)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.is_floating_point())


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
        res, start = resume(ckpt_path, cfg, device, raw, opt, sched)
    else:
        torch.manual_seed(cfg.seed + 1_000_003 * info.rank)  # dropout streams: distinct per rank
    if out is not None and info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        truncate_log(out / LOG, start)
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
                if not finite_weights(raw):  # this step's update overflowed: never store it as a good state
                    res.diverged = True
                    break
                write_checkpoint(ckpt_path, raw, opt, sched, step + 1, res, cfg, info)
    finally:
        if monitor is not None and hasattr(monitor, "detach"):
            monitor.detach()
    if res.diverged:
        res.final_loss = math.nan
    elif res.steps_done == cfg.steps and start < cfg.steps:  # (resuming a finished run keeps its final eval)
        res.final_loss = evaluate(model, data, cfg, info)
        res.evals.append((cfg.steps, res.final_loss))
        res.eval_optimum = reference_eval_loss(data, cfg)
        # the last update is seen by no training step: a non-finite evaluation or weights mean it diverged
        if not math.isfinite(res.final_loss) or not finite_weights(raw):
            res.diverged = True
            res.final_loss = math.nan
    finite = [v for _, v in res.evals if math.isfinite(v)]
    res.best_loss = min(finite) if finite else math.nan
    res.spikes = detect_spikes(res.losses, window=cfg.spike_window, sigma=cfg.spike_sigma)
    res.max_grad_norm = max((g for g in res.grad_norms if math.isfinite(g)), default=math.nan)
    if ckpt_path is not None and not res.diverged and res.steps_done > start:
        write_checkpoint(ckpt_path, raw, opt, sched, res.steps_done, res, cfg, info)
    return res


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate the run uses at ``step`` (for plots and checks)."""
    return cfg.lr * lr_multiplier(
        step, schedule=cfg.schedule, warmup=cfg.warmup, total=cfg.steps, min_lr_ratio=cfg.min_lr_ratio
    )
