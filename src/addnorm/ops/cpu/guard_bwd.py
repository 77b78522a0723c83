"""The backward of a row the finite-range guard rescaled (the rule is the contract's: :mod:`addnorm.ops.contract`).

For a row whose saved statistics fail the guard's test, :func:`addnorm.ops.cpu.stats.saved_row_scaling` gives the
forward's scale 2^k, the scaled mean and r = rstd * 2^-k. The gradient is computed in float64 in those units,

    xhat = (h * 2^k - mean_s) * r,   g = dout * w
    dh   = (r * (g - mean(g) - xhat * mean(g * xhat))) * 2^k        (RMSNorm: no mean(g))

and rounded once to the output dtype: the factor 2^k comes last, so a gradient beyond the dtype's range is inf (as
the float64 gradient rounded to it), never NaN. dweight and dbias are the usual row sums of dout * xhat and dout.
The kernels of :mod:`addnorm.ops.cpu.kernels_bwd` call these for such rows only.

The same float64 pass, with k = 0 and the saved statistics as they are, rescues a row whose statistics are ordinary
but whose backward overflows the statistics dtype: g = dout * w beyond fp32 (dout ~1e30, w ~1e10), or the row sums
sum(g), sum(g * xhat) beyond it (a large dout over many columns), while dout, h and w are finite; dx = rstd * (...)
is then finite in float64 whenever rstd is small enough. The kernels see it as plain row sums that are inf or NaN
(:func:`finite_inputs` tells an overflow from an inf or NaN that was in the inputs: that one propagates as before),
so an ordinary row pays one test of two scalars.
"""

from __future__ import annotations

import math

import numpy as np

from addnorm.ops.cpu.convert import JIT, cast_like, load, njit, round_as, store_rounded
from addnorm.ops.cpu.kernels import keep
from addnorm.ops.cpu.stats import pow2_halves

__all__ = ["finite_inputs", "scaled_bwd_sums", "scaled_dw_row", "scaled_dx_row"]


@njit(**JIT)
def finite_inputs(dy, h, W, has_w, n):
    """Whether the row's dout, h and (with has_w) the weight are all finite: a backward whose plain sums are inf or
    NaN then overflowed, and the float64 pass gives its answer."""
    for j in range(n):
        if not (math.isfinite(load(dy, j)) and math.isfinite(load(h, j))):
            return False
        if has_w and not math.isfinite(W[j]):
            return False
    return True


@njit(**JIT)
def scaled_bwd_sums(dy, h, W, has_w, n, k, mean_s, r):
    """sum(g) and sum(g * xhat) over the row, in float64 (xhat in the scaled units above)."""
    s1, s2 = pow2_halves(k)
    sg = 0.0
    sgx = 0.0
    for j in range(n):
        g = np.float64(load(dy, j))
        if has_w:
            g = g * np.float64(W[j])
        xhat = (np.float64(load(h, j)) * s1 * s2 - mean_s) * r
        sg += g
        sgx += g * xhat
    return sg, sgx


@njit(**JIT)
def scaled_dx_row(
    base,
    dy,
    h,
    dro,
    dx,
    dres,
    W,
    n,
    k,
    mean_s,
    r,
    mean_g,
    proj,
    has_dro,
    has_w,
    has_dres,
    dropout,
    seed_key,
    threshold,
    scale,
):
    """dx (and dresidual) of n columns of the row; base is the element index of dy[0] (the dropout mask)."""
    s1, s2 = pow2_halves(k)
    for j in range(n):
        xhat = (np.float64(load(h, j)) * s1 * s2 - mean_s) * r
        g = np.float64(load(dy, j))
        if has_w:
            g = g * np.float64(W[j])
        dh = r * (g - mean_g - xhat * proj) * s1 * s2
        if has_dro:
            dh = dh + np.float64(load(dro, j))
        if has_dres:
            store_rounded(dres, j, dh)
        if dropout:
            dh = dh * np.float64(scale) if keep(base + j, seed_key, threshold) else 0.0
        store_rounded(dx, j, dh)


@njit(**JIT)
def scaled_dw_row(dy, h, dwp, dbp, n, k, mean_s, r, has_w, has_db, cast):
    """This row's share of dweight (dout * xhat) and dbias (dout), added to the partial sums dwp, dbp."""
    s1, s2 = pow2_halves(k)
    for j in range(n):
        d = np.float64(load(dy, j))
        if has_w:
            xhat = (np.float64(load(h, j)) * s1 * s2 - mean_s) * r
            if cast:  # the forward rounded xhat to out's dtype (dout's storage type) before the weight
                xhat = round_as(dy, xhat)
            dwp[j] += cast_like(d * xhat, dwp[j])
        if has_db:
            dbp[j] += cast_like(d, dbp[j])
