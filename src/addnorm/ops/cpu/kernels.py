"""The numba kernels of the ``cpu`` backend: fused residual add + LayerNorm/RMSNorm, parallel over rows. Here the
register-level pieces both directions share (dtype conversions, the dropout hash) and the forward kernels;
:mod:`addnorm.ops.cpu.kernels_bwd` holds the backward kernels, :mod:`addnorm.ops.cpu.launch` allocates, sets the
thread count and launches them.

The math (one row h of length N; statistics in fp32, fp64 when x or the residual stream is fp64):

    forward     h     = dropout(x) + residual, rounded once to residual_dtype and stored (residual_out)
                mean  = sum(h) / N                          (LayerNorm only)
                rstd  = 1 / sqrt(sum((h - mean)^2) / N + eps)   (RMSNorm: 1 / sqrt(sum(h^2) / N + eps))
                out   = (h - mean) * rstd * w + b           (w is 1 + weight when zero_centered_weight;
                                                             cast_before_weight rounds (h - mean) * rstd to
                                                             out's dtype before w and b: Llama's order)

    backward    xhat  = (h - mean) * rstd,   g = dout * w
                dh    = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dresidual_out   (RMSNorm: no mean(g))
                dresidual = dh,   dx = dh * keep * scale   (scale: 1/(1-p) rounded to the stats dtype)
                dweight = sum over rows of dout * xhat (* round(xhat) with cast_before_weight),   dbias = sum of dout

    guard       a row whose mean and rstd fail the contract's test (:mod:`addnorm.ops.contract`: rstd outside
                [2^-50, 2^50] in fp32, or a subnormal mean) is normalized again from h * 2^k in float64
                (:func:`addnorm.ops.cpu.stats.guarded_row_stats`); its backward is :mod:`addnorm.ops.cpu.guard_bwd`

A row is at most a few hundred KB, so it stays in L1/L2 while it is read several times: the forward streams x
and residual in once, writes residual_out, then reads that row back from cache for the statistics (two passes,
mean then squared deviations: no E[h^2] - E[h]^2 cancellation) and for the output. Everything in between lives in
registers; DRAM sees each input read once and each output written once, which is the whole game on a CPU.

Half types never exist as numpy/numba floats here: bf16 travels as uint16 bits and fp16 as int16 bits, converted
in registers (:mod:`addnorm.ops.cpu.convert`). The row statistics, and the finite-range guard that recomputes a row
whose plain statistics overflow or underflow, are :mod:`addnorm.ops.cpu.stats`.

dweight and dbias are reduced in a fixed number of row chunks that depends only on M (never on the thread
count): each chunk sums its rows in order, then the chunk partials are summed in order. The result is bitwise
identical whatever the number of threads, and run to run.

Dropout keeps element (i, j) by the contract's keep-function of (seed, i * N + j) and scales kept elements by
the contract's scale (:func:`addnorm.ops.contract.dropout_keep_mask`, :func:`~addnorm.ops.contract.dropout_scale`), so
the backward regenerates the mask and every backend agrees bit for bit.
"""

from __future__ import annotations

import numpy as np

from addnorm.ops.contract import MIX_M1, MIX_M2
from addnorm.ops.cpu.convert import (
    FAST,
    IMPORT_ERROR,
    JIT,
    cast_like,
    load,
    njit,
    numba,
    prange,
    round_as,
    store_rounded,
    zero_of,
)
from addnorm.ops.cpu.stats import NOT_SCALED, guarded_row_stats, pow2_halves

# (the conversions are re-exported: the other kernel files import them from here)
__all__ = [
    "FAST",
    "IMPORT_ERROR",
    "JIT",
    "cast_like",
    "fwd_parallel",
    "fwd_serial",
    "keep",
    "load",
    "njit",
    "numba",
    "prange",
    "residual_row",
    "round_as",
    "store_rounded",
    "zero_of",
]

# --------------------------------------------------------------------------------------------------------------
# Dropout: the contract's keep-function (addnorm.ops.contract), in uint64 arithmetic masked to 32 bits
# --------------------------------------------------------------------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)
_MIX_M1 = np.uint64(MIX_M1)
_MIX_M2 = np.uint64(MIX_M2)


@njit(inline="always", **JIT)
def _mix32(z):
    z = z ^ (z >> np.uint64(16))
    z = (z * _MIX_M1) & _M32
    z = z ^ (z >> np.uint64(15))
    z = (z * _MIX_M2) & _M32
    return z ^ (z >> np.uint64(16))


@njit(inline="always", **JIT)
def keep(idx, seed_key, threshold):
    """True iff element ``idx`` (= i * N + j) survives: the hash's top 24 bits are >= threshold."""
    k = np.uint64(idx)
    z = _mix32((k & _M32) ^ _mix32((k >> np.uint64(32)) ^ seed_key))
    return (z >> np.uint64(8)) >= threshold


# --------------------------------------------------------------------------------------------------------------
# Kernels. Arrays are flat 1-D views; row i of X starts at i * sx (row strides allow strided rows without a copy).
# Capitalised names are arrays, as in Triton's pointer arguments.
# --------------------------------------------------------------------------------------------------------------


@njit(**JIT)
def residual_row(x, r, h, i, n, has_res, dropout, seed_key, threshold, scale, zero):
    """h = dropout(x) + r for row i, rounded to h's storage type."""
    for j in range(n):
        v = cast_like(load(x, j), zero)
        if dropout:
            v = v * scale if keep(i * n + j, seed_key, threshold) else zero
        if has_res:
            v = v + cast_like(load(r, j), zero)
        store_rounded(h, j, v)


@njit(inline="always")
def _normalize_loop(h, out, W, B, n, mean, rstd, has_w, has_b, cast, zero):
    # W and B: in the statistics dtype, or in x's half dtype (the decode launch of fast_launch.py passes the weight
    # as stored): a half value widens to fp32 exactly, so either gives the same bits
    for j in range(n):
        y = (cast_like(load(h, j), zero) - mean) * rstd
        if cast:
            y = round_as(out, y)
        if has_w:
            y = y * cast_like(load(W, j), zero)
        if has_b:
            y = y + cast_like(load(B, j), zero)
        store_rounded(out, j, y)


@njit(**JIT)
def normalize_row(h, out, W, B, n, mean, rstd, has_w, has_b, cast, zero):
    # The same loop with the flags as constants in each branch: LLVM does not unswitch a loop on three flags, and
    # with the branches inside it does not vectorize it (5x slower, measured at 8 x 4096 bf16). Same arithmetic.
    if cast:
        if has_w and has_b:
            _normalize_loop(h, out, W, B, n, mean, rstd, True, True, True, zero)
        elif has_w:
            _normalize_loop(h, out, W, B, n, mean, rstd, True, False, True, zero)
        elif has_b:
            _normalize_loop(h, out, W, B, n, mean, rstd, False, True, True, zero)
        else:
            _normalize_loop(h, out, W, B, n, mean, rstd, False, False, True, zero)
    elif has_w and has_b:
        _normalize_loop(h, out, W, B, n, mean, rstd, True, True, False, zero)
    elif has_w:
        _normalize_loop(h, out, W, B, n, mean, rstd, True, False, False, zero)
    elif has_b:
        _normalize_loop(h, out, W, B, n, mean, rstd, False, True, False, zero)
    else:
        _normalize_loop(h, out, W, B, n, mean, rstd, False, False, False, zero)


@njit(**JIT)
def normalize_row_scaled(h, out, W, B, n, k, mean_s, r, has_w, has_b, cast):
    """The normalize loop of a row the guard rescaled (:func:`addnorm.ops.cpu.stats.guarded_row_stats`): xhat =
    (h * 2^k - mean_s) * r, the weight and bias applied, all in float64, rounded once to out's type. Rare rows: no
    unswitching for speed here."""
    s1, s2 = pow2_halves(k)
    for j in range(n):
        y = (np.float64(load(h, j)) * s1 * s2 - mean_s) * r
        if cast:
            y = round_as(out, y)
        if has_w:
            y = y * np.float64(load(W, j))
        if has_b:
            y = y + np.float64(load(B, j))
        store_rounded(out, j, y)


@njit(**JIT)
def _fwd_row(
    i,
    X,
    sx,
    R,
    sr,
    W,
    B,
    Out,
    H,
    sh,
    Mean,
    Rstd,
    n,
    has_res,
    has_w,
    has_b,
    store,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    eps,
    cast,
    zero,
):
    # X: x rows; R: residual rows (stride sr); W, B: weight, bias in the statistics dtype; Out: (M, N) output;
    # H: residual_out rows (stride sh; H is X itself when nothing is stored); Mean, Rstd: (M,) statistics
    h = H[i * sh : i * sh + n]
    if store:  # rounded once; everything below normalizes the stored value
        residual_row(
            X[i * sx : i * sx + n], R[i * sr : i * sr + n], h, i, n, has_res, dropout, seed_key, threshold, scale, zero
        )
    mean, rstd, k, mean_s, r = guarded_row_stats(h, n, is_rms, eps, zero)
    if not is_rms:
        Mean[i] = mean
    Rstd[i] = rstd
    if k == NOT_SCALED:
        normalize_row(h, Out[i * n : i * n + n], W, B, n, mean, rstd, has_w, has_b, cast, zero)
    else:  # the guard's scaled pass: a row the plain statistics would get wrong
        normalize_row_scaled(h, Out[i * n : i * n + n], W, B, n, k, mean_s, r, has_w, has_b, cast)


# Two drivers over the same row function: prange for large inputs, a plain loop for small ones, where the ~10-60
# microseconds of waking a thread pool would dominate. Two functions, not one compiled twice: numba's cache keys
# entries by function, not by the parallel flag.
@njit(parallel=True, **JIT)
def fwd_parallel(
    X,
    sx,
    R,
    sr,
    W,
    B,
    Out,
    H,
    sh,
    Mean,
    Rstd,
    m,
    n,
    has_res,
    has_w,
    has_b,
    store,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    eps,
    cast,
):
    zero = zero_of(Rstd)
    seed_key, threshold = np.uint64(seed_key), np.uint64(threshold)
    scale, eps = cast_like(scale, zero), cast_like(eps, zero)
    for i in prange(m):
        _fwd_row(
            i,
            X,
            sx,
            R,
            sr,
            W,
            B,
            Out,
            H,
            sh,
            Mean,
            Rstd,
            n,
            has_res,
            has_w,
            has_b,
            store,
            is_rms,
            dropout,
            seed_key,
            threshold,
            scale,
            eps,
            cast,
            zero,
        )


@njit(**JIT)
def fwd_serial(
    X,
    sx,
    R,
    sr,
    W,
    B,
    Out,
    H,
    sh,
    Mean,
    Rstd,
    m,
    n,
    has_res,
    has_w,
    has_b,
    store,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    eps,
    cast,
):
    zero = zero_of(Rstd)  # the scalars arrive as python floats and ints (cheap to pass), typed here
    seed_key, threshold = np.uint64(seed_key), np.uint64(threshold)
    scale, eps = cast_like(scale, zero), cast_like(eps, zero)
    for i in range(m):
        _fwd_row(
            i,
            X,
            sx,
            R,
            sr,
            W,
            B,
            Out,
            H,
            sh,
            Mean,
            Rstd,
            n,
            has_res,
            has_w,
            has_b,
            store,
            is_rms,
            dropout,
            seed_key,
            threshold,
            scale,
            eps,
            cast,
            zero,
        )
