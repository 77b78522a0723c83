"""Anomaly detection for training runs: spikes in a scalar series, the first non-finite module, the first layer
whose residual stream jumped.

- :class:`SpikeDetector`: a value is a spike when it exceeds mean + ``sigmas`` * std of the last ``window`` values
  (OLMo-core's rule: 6 sigma over the last 128 values), or is not finite.
- :class:`NonFiniteSentinel`: hooks on every module; names the first module whose forward output, or whose output
  gradient / parameter gradient in backward, holds a NaN or Inf.
- :func:`localize_jump`: over a :class:`~addnorm.diagnostics.Monitor` history, the first (step, layer) whose value
  jumped by ``factor`` against that layer's own recent median; the layer where a bisection should start.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["SpikeDetector", "NonFiniteSentinel", "Jump", "localize_jump"]


class SpikeDetector:
    """Flag values above mean + sigmas * std of the last ``window`` values (for loss and grad-norm series).

    ``update(value)`` returns True for a spike. Spikes and non-finite values are flagged but not added to the
    window, so one spike does not widen the band that should catch the next; everything else is added. Fewer than
    ``min_history`` values in the window: nothing is flagged except non-finite values.
    """

    def __init__(self, window: int = 128, sigmas: float = 6.0, min_history: int = 16) -> None:
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2, got {window!r}")
        if not sigmas > 0:
            raise ValueError(f"sigmas must be > 0, got {sigmas!r}")
        if not isinstance(min_history, int) or not 2 <= min_history <= window:
            raise ValueError(f"min_history must be an int in [2, window={window}], got {min_history!r}")
        self.window, self.sigmas, self.min_history = window, float(sigmas), min_history
        self.values: deque[float] = deque(maxlen=window)
        self.spikes: list[int] = []  # indices (count of update calls before it) of flagged values
        self._count = 0

    def threshold(self) -> float | None:
        """The current spike threshold, or None while the window holds fewer than ``min_history`` values."""
        n = len(self.values)
        if n < self.min_history:
            return None
        mean = math.fsum(self.values) / n
        var = math.fsum((v - mean) ** 2 for v in self.values) / (n - 1)
        # A perfectly flat series has std 0; a relative floor keeps float noise from counting as a spike.
        std = max(math.sqrt(var), 1e-6 * abs(mean), 1e-12)
        return mean + self.sigmas * std

    def update(self, value: Tensor | float) -> bool:
        """Add one value; True when it is a spike (or NaN/Inf)."""
        v = float(value.detach()) if isinstance(value, Tensor) else float(value)
        idx = self._count
        self._count += 1
        if not math.isfinite(v):
            self.spikes.append(idx)
            return True
        limit = self.threshold()
        if limit is not None and v > limit:
            self.spikes.append(idx)
            return True
        self.values.append(v)
        return False


def _nonfinite(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.is_floating_point() and value.numel() > 0 and not bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    return False


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class NonFiniteSentinel:
    """Name the first module that produced a NaN/Inf, in forward and in backward.

    Forward: a forward hook on every module checks its outputs; hooks fire when a module finishes, children before
    their parent, so the first hit is the innermost module where the value first went bad.

    Backward: gradient hooks on every module's outputs and inputs (tensors that require grad) and parameters. A
    module *produced* a non-finite gradient when the gradient of one of its inputs or parameters is non-finite
    while the gradient arriving at its outputs was finite; a module that only passes a bad gradient on is not
    blamed. A gradient that is already non-finite when it enters the model (a NaN loss) is reported as ``"<loss>"``.

    ``first`` is ``(phase, module_path)`` of the earliest event ("forward" or "backward"; the root module is
    ``"<root>"``); ``first_forward`` / ``first_backward`` keep one per phase. Every check syncs with the device:
    this is a debugging tool, attach it to find a NaN, not for every step of a long run.
    """

    ROOT = "<root>"
    LOSS = "<loss>"

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._handles: list = []
        self._active = False
        self.reset()
        self.attach()

    def reset(self) -> None:
        """Forget what was seen (keep the hooks)."""
        self.first: tuple[str, str] | None = None
        self.first_forward: str | None = None
        self.first_backward: str | None = None
        self._bad_output_grad: set[str] = set()

    def _hit(self, phase: str, path: str) -> None:
        if phase == "forward" and self.first_forward is None:
            self.first_forward = path
        elif phase == "backward" and self.first_backward is None:
            self.first_backward = path
        else:
            return
        if self.first is None:
            self.first = (phase, path)

    def attach(self) -> NonFiniteSentinel:
        """Install the hooks (done by the constructor; call again after ``detach`` to re-arm)."""
        if self._active:
            return self
        self._active = True
        for name, module in self.model.named_modules():
            path = name or self.ROOT
            self._handles.append(module.register_forward_hook(self._forward_hook(path), with_kwargs=True))
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._produced_hook(path)))
        return self

    def _watch(self, tensors: list[Tensor], hook) -> None:
        for t in tensors:
            if t.requires_grad and t.is_floating_point():
                try:
                    t.register_hook(hook)  # lives as long as the tensor; the hook checks _active after detach
                except RuntimeError:  # e.g. a tensor that cannot take hooks; it just goes unwatched
                    pass

    def _forward_hook(self, path: str):
        def hook(module, args, kwargs, output):
            if not self._active:
                return
            if self.first_forward is None and _nonfinite(output):
                self._hit("forward", path)
            if torch.is_grad_enabled():
                self._watch(_tensors(output), self._output_grad_hook(path))
                self._watch(_tensors(args) + _tensors(kwargs), self._produced_hook(path))

        return hook

    def _output_grad_hook(self, path: str):
        def hook(grad):
            if self._active and self.first_backward is None and _nonfinite(grad):
                if path == self.ROOT:
                    self._hit("backward", self.LOSS)
                self._bad_output_grad.add(path)

        return hook

    def _produced_hook(self, path: str):
        # Gradient of an input or a parameter of the module at ``path``.
        def hook(grad):
            if self._active and self.first_backward is None and path not in self._bad_output_grad and _nonfinite(grad):
                self._hit("backward", path)

        return hook

    def detach(self) -> None:
        """Remove the module and parameter hooks; per-tensor hooks still alive turn into no-ops."""
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> NonFiniteSentinel:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()


@dataclass(kw_only=True)
class Jump:
    """Where a per-layer series first jumped: record index, training step, layer index and name, the values."""

    record: int
    step: int
    layer: int
    name: str
    value: float
    reference: float


def localize_jump(
    history: Sequence[dict], key: str = "residual_rms", factor: float = 3.0, *, window: int = 8, min_history: int = 3
) -> Jump | None:
    """The first layer whose ``key`` jumped against its own history, or None.

    For each record in order and each layer in order, the reference is the median of that layer's previous
    ``window`` values (at least ``min_history`` of them); a value is a jump when it exceeds ``factor`` times the
    reference, or is not finite. Layers are scanned shallow to deep within a step: a jump in the residual stream
    propagates to every later layer, so the shallowest one is where it started.
    """
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    if window < 1 or min_history < 1 or min_history > window:
        raise ValueError(f"need 1 <= min_history <= window, got min_history={min_history}, window={window}")
    past: dict[int, deque] = {}
    for r, rec in enumerate(history):
        layers = rec.get("layers")
        if layers is None:
            raise ValueError(f"history[{r}] has no 'layers' list (records come from Monitor.step)")
        for i, entry in enumerate(layers):
            v = entry.get(key)
            if v is None:
                continue
            seen = past.setdefault(i, deque(maxlen=window))
            if len(seen) >= min_history:
                ref = sorted(seen)[len(seen) // 2]
                if not math.isfinite(v) or v > factor * ref:
                    return Jump(
                        record=r,
                        step=rec.get("step", r),
                        layer=i,
                        name=entry.get("name", str(i)),
                        value=float(v),
                        reference=float(ref),
                    )
            if math.isfinite(v):
                seen.append(float(v))
    return None
