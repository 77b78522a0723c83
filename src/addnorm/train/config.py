"""What goes into a training run and what comes out: :class:`TrainConfig` (everything about a run except the model
and the data) and :class:`TrainResult` (its curves and stability summary). :func:`addnorm.train.loop.train` runs
one; :func:`addnorm.train.batched.train_batched` runs several as one batched computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from addnorm.train.schedules import SCHEDULES

__all__ = ["TrainConfig", "TrainResult"]


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
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"TrainConfig.{name} must be a number, got {v!r}")
            if math.isnan(v):  # a number to Python, not to a training run: say what is wanted
                raise ValueError(f"TrainConfig.{name} must be a finite number, got nan")
            # inf is meaningless everywhere but diverge_factor (inf: never stop a run early)
            if math.isinf(v) and name != "diverge_factor":
                raise ValueError(f"TrainConfig.{name} must be a finite number, got {v!r}")
        for name in ("independent_wd", "monitor", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"TrainConfig.seed must be an int, got {self.seed!r}")
        # The lab's --seed is < 2**32 and its experiments train with seed + k (k < 1000), so 2**32 is too tight;
        # torch.manual_seed takes < 2**64, and the loop adds 1_000_003 * rank: 2**63 leaves room for any rank.
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"TrainConfig.seed must be in [0, 2**63), got {self.seed}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"TrainConfig.device must be a torch device such as 'cpu' or 'cuda', got {self.device!r}"
            ) from None
        if device.type not in ("cpu", "cuda", "mps"):  # meta computes nothing; other backends are untested
            raise ValueError(
                f"TrainConfig.device (--device) must be cpu, cuda (or mps where available), got {self.device!r}"
            )
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"TrainConfig.device is {self.device!r} but torch.backends.mps.is_available() is False")
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
        if not self.adam_eps > 0:  # eps 0 divides 0 by 0 for a parameter whose gradient is 0: NaN weights
            raise ValueError(f"TrainConfig.adam_eps must be > 0, got {self.adam_eps}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
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
