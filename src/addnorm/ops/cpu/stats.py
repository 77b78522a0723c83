"""The row statistics of the ``cpu`` backend's numba kernels, and the finite-range guard (the rule is the contract's:
:mod:`addnorm.ops.contract`, the section on the guard).

:func:`guarded_row_stats` is what a forward kernel calls for one row: the plain statistics (two passes, mean then
squared deviations, in the statistics dtype), one scalar test on them (:func:`row_is_ordinary`), and only for a row
that fails it the scaled pass (:func:`scaled_moments`, in float64). :func:`saved_row_scaling` is the backward's
side: the same test on the saved statistics, and the scaled moments again from h. Any kernel that normalizes a row
(the add + norm kernels, the quantized ones) calls these and gets the same statistics, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from addnorm.ops.contract import GUARD_LIMITS
from addnorm.ops.cpu.convert import FAST, JIT, cast_like, load, njit, overload, types
from addnorm.ops.cpu.torch_order import row_sum_sq

__all__ = [
    "NOT_SCALED",
    "guarded_row_stats",
    "pow2_halves",
    "row_is_ordinary",
    "row_stats",
    "row_sum",
    "row_sum_sq_dev",
    "saved_row_scaling",
    "scaled_moments",
]

# k of a row the plain statistics serve (the scaled pass was not run, or could not help: a non-finite or zero row)
NOT_SCALED = -(1 << 20)
# eps * 4^k above this: var_s (< 4) is negligible beside it, and 1 / sqrt(eps) * 2^-k is r (float64 eps * 4^k could
# overflow for fp64 statistics)
_EPS_DOMINATES = 2.0**60

_LIMITS32 = tuple(np.float32(v) for v in GUARD_LIMITS[torch.float32])
_LIMITS64 = tuple(np.float64(v) for v in GUARD_LIMITS[torch.float64])


# LayerNorm's two sums: reassociated, so LLVM keeps 16-lane partial sums (no less accurate than a sequential sum).
# F.layer_norm sums in its own one-pass order, which no two-pass formula reproduces; PyTorch's order for these sums
# (torch_order) measured 6-9% slower for bf16 LayerNorm (benchmarks/results/torch_order.md), for no user-visible gain.
@njit(fastmath=FAST, **JIT)
def row_sum(h, n, zero):
    s = zero
    for j in range(n):
        s += cast_like(load(h, j), zero)
    return s


@njit(fastmath=FAST, **JIT)
def row_sum_sq_dev(h, n, mean, zero):
    s = zero
    for j in range(n):
        d = cast_like(load(h, j), zero) - mean
        s += d * d
    return s


@njit(**JIT)
def row_stats(h, n, is_rms, eps, zero):
    """(mean, rstd) of row h by the plain two-pass formulas in the statistics dtype (zero's type; mean 0 for
    RMSNorm). RMSNorm's sum of squares is added in PyTorch's order (:mod:`addnorm.ops.cpu.torch_order`), so its
    rstd is ``torch.rsqrt(h.float().pow(2).mean(-1) + eps)`` bit for bit, the formula every RMSNorm reference
    (Hugging Face's, FlashInfer's, vLLM's) and ATen's own RMSNorm kernel compute. Right for ordinary rows only: see
    :func:`guarded_row_stats`."""
    nf = cast_like(n, zero)
    if is_rms:
        mean = zero
        rstd = 1 / np.sqrt(row_sum_sq(h, n, zero) / nf + eps)
    else:
        mean = row_sum(h, n, zero) / nf
        rstd = 1 / np.sqrt(row_sum_sq_dev(h, n, mean, zero) / nf + eps)
    return mean, cast_like(rstd, zero)


def _guard_limits(rstd):
    """(RSTD_MIN, RSTD_MAX, TINY) of the contract in rstd's float type; numba-only."""
    raise NotImplementedError


@overload(_guard_limits, inline="always")
def _guard_limits_impl(rstd):
    if rstd == types.float64:
        return lambda rstd: _LIMITS64
    return lambda rstd: _LIMITS32


@njit(inline="always", **JIT)
def row_is_ordinary(mean, rstd):
    """The contract's one scalar test: the plain statistics serve this row (NaN fails it)."""
    lo, hi, tiny = _guard_limits(rstd)
    am = abs(mean)
    return lo <= rstd <= hi and not (am > 0 and am < tiny)


@njit(inline="always", **JIT)
def pow2_halves(k):
    """2^k as two float64 factors, each in range even where 2^k alone is not (k up to 1075 for fp64 rows)."""
    return math.ldexp(1.0, k // 2), math.ldexp(1.0, k - k // 2)


@njit(**JIT)
def scaled_moments(h, n, is_rms):
    """(k, mean_s, var_s) of row h multiplied by 2^k, k from max |h| (the contract's guard_scale_exponent), in
    float64; k is NOT_SCALED when a value is non-finite or every value is 0 (nothing to rescue)."""
    a = 0.0
    finite = True
    for j in range(n):
        v = abs(np.float64(load(h, j)))
        finite = finite and v < math.inf  # (NaN fails too)
        if v > a:
            a = v
    if not finite or a == 0.0:
        return NOT_SCALED, 0.0, 0.0
    k = 1 - math.frexp(a)[1]
    s1, s2 = pow2_halves(k)
    nf = np.float64(n)
    mean_s = 0.0
    if not is_rms:
        for j in range(n):
            mean_s += np.float64(load(h, j)) * s1 * s2
        mean_s /= nf
    var_s = 0.0
    for j in range(n):
        d = np.float64(load(h, j)) * s1 * s2 - mean_s
        var_s += d * d
    return k, mean_s, var_s / nf


@njit(**JIT)
def guarded_row_stats(h, n, is_rms, eps, zero):
    """(mean, rstd, k, mean_s, r) of row h: mean and rstd in the statistics dtype (what is saved for the
    backward); k NOT_SCALED when the plain statistics serve the row (normalize with mean and rstd), else the row is
    normalized in float64 as xhat = (h * 2^k - mean_s) * r (rstd itself may then be inf or subnormal)."""
    mean, rstd = row_stats(h, n, is_rms, eps, zero)
    if row_is_ordinary(mean, rstd):
        return mean, rstd, NOT_SCALED, 0.0, 0.0
    k, mean_s, var_s = scaled_moments(h, n, is_rms)
    if k == NOT_SCALED:
        return mean, rstd, NOT_SCALED, 0.0, 0.0
    s1, s2 = pow2_halves(k)
    e = np.float64(eps) * s1 * s1 * s2 * s2
    if e <= _EPS_DOMINATES:
        r = 1.0 / math.sqrt(var_s + e)
    else:
        r = 1.0 / math.sqrt(np.float64(eps)) / s1 / s2
    return cast_like(mean_s / s1 / s2, zero), cast_like(r * s1 * s2, zero), k, mean_s, r


@njit(**JIT)
def saved_row_scaling(h, n, is_rms, mean, rstd):
    """The backward's side of the guard, from the saved statistics: (k, mean_s, r) as the forward's
    :func:`guarded_row_stats` gave them (k NOT_SCALED: use mean and rstd as they are). eps is not known here: r is
    1 / sqrt(var_s) when that reproduces the saved rstd (eps negligible, or 0: an inf rstd), else rstd * 2^-k."""
    if row_is_ordinary(mean, rstd):
        return NOT_SCALED, 0.0, 0.0
    k, mean_s, var_s = scaled_moments(h, n, is_rms)
    if k == NOT_SCALED:
        return NOT_SCALED, 0.0, 0.0
    s1, s2 = pow2_halves(k)
    r = 1.0 / math.sqrt(var_s)
    if cast_like(r * s1 * s2, rstd) != rstd:
        r = np.float64(rstd) / s1 / s2
    return k, mean_s, r
