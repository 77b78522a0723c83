"""What the launchers of :mod:`addnorm.ops.triton.launch` pass the kernels besides their tensors: eps and dropout's
scale as fp32 parts (Triton passes Python floats as fp32), dropout's keep threshold, row strides, contiguous weight
vectors, and the persistent scratch tensor for statistics a call does not store. Plain Python: no kernel, nothing a
test or tool swaps (those stay in launch, where the launchers look them up).
"""

from __future__ import annotations

import functools
import math
import struct

import torch
from torch import Tensor

from addnorm.ops.contract import dropout_threshold

__all__ = ["_dropout_args", "_row_stride", "_scratch", "_split", "_vec"]


def _f32(v: float) -> float:
    """v rounded to the nearest fp32 value (ties to even), as a Python float. Plain Python, not a torch.tensor
    round trip: the launchers also run on fake tensors (torch.compile traces them through the triton ops of
    :mod:`addnorm.ops.triton.compiled`), where a tensor's value cannot be read back."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:  # beyond fp32's range: inf, as a torch.float32 conversion gives
        return math.copysign(math.inf, v)


@functools.lru_cache(maxsize=64)  # a model uses a few eps values: the split is paid once each, not per call
def _split(v: float) -> tuple[float, float]:
    """A double as two fp32-representable floats whose sum recovers it to ~2^-48 (Triton passes floats as fp32)."""
    hi = _f32(v)
    return hi, _f32(v - hi)


def _dropout_args(p: float, seed: Tensor | None, dummy: Tensor) -> tuple:
    """(Seed, keep threshold, scale in three fp32 parts) for the kernels; the seed stays a device tensor."""
    if not p > 0:
        return dummy, 0, 1.0, 0.0, 0.0
    return (seed, *_dropout_scalars(p))


@functools.lru_cache(maxsize=64)
def _dropout_scalars(p: float) -> tuple[int, float, float, float]:
    s = 1.0 / (1.0 - p)  # the fp64 scale; fp32 statistics use its rounding (hi), fp64 the exact sum of the parts
    hi = _f32(s)
    mid = _f32(s - hi)
    lo = _f32(s - hi - mid)
    return dropout_threshold(p), hi, mid, lo


def _row_stride(t: Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _vec(t: Tensor | None) -> Tensor | None:
    return t.contiguous() if t is not None else None


_scratch_tensors: dict = {}


def _scratch(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A persistent one-element tensor passed for statistics a call does not store (the kernels never write it):
    under inference nothing reads mean and rstd, and allocating them costs host time on every call (~2 us each on
    a CPU; a decode step is host-bound). Persistent, so a captured CUDA graph may hold it. Not for traced calls:
    torch.compile traces on fake tensors, and those store the statistics anyway."""
    key = (device, dtype)
    t = _scratch_tensors.get(key)
    if t is None:
        t = _scratch_tensors[key] = torch.empty(1, dtype=dtype, device=device)
    return t
