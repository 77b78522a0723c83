"""The backward's overflow guard of the Triton kernels: a row whose statistics are ordinary but whose backward
overflows the accumulation type, g = dout * w beyond it (dout ~1e30, w ~1e10 in fp32) or the row sums sum(g),
sum(g * xhat) beyond it, while dout, h and w are finite; dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) is then
finite whenever rstd is small enough. Such a row is recomputed with dout scaled by 2^-k (exact), k from the largest
|dout| and |w|, so that |dout * w| < 4 and the sums are in range, and dx multiplied by 2^k last (inf only where it
is beyond range, as the float64 gradient rounded):

    g_s = (dout * 2^-k) * w,    dx = ((g_s - mean(g_s) - xhat * mean(g_s * xhat)) * rstd) * 2^k

The kernels see such a row as a row sum that is inf or NaN (x - x != 0: one compare per row); the scaled sums run
only then. A row whose dout, h or w holds an inf or NaN keeps k = 0: it propagates as before. dweight and dbias are
the plain sums of dout * xhat and dout (no w in them): not rescaled.
"""

from __future__ import annotations

from addnorm.ops.triton.elementwise import load_weight
from addnorm.ops.triton.row_stats import exponent_of, jit, pow2, rare_path, tl

__all__ = ["not_finite", "rescaled_looped_sums", "rescaled_row_sums", "row_dout_exponent"]


@jit
def not_finite(v):
    """inf or NaN: v - v is 0 for every finite v."""
    return (v - v) != 0


@jit
def row_dout_exponent(dmax, wmax, finite, overflowed):
    """k per row: floor(log2 max|dout|) + floor(log2 max|w|) for the rows that overflowed from finite inputs, 0 for
    the others; within [0, LIM] so that each half of it is a normal power of two of the accumulation type."""
    LIM: tl.constexpr = 2044 if dmax.dtype == tl.float64 else 252
    k = tl.minimum(tl.maximum(exponent_of(dmax) + exponent_of(wmax), 0), LIM)
    return tl.where(overflowed & finite, k, 0)


@rare_path
def rescaled_row_sums(dout, w, xhat, mask, overflowed, N, HAS_W: tl.constexpr):
    """For a (rows, BLOCK_N) tile: (g_s, sum(g_s * xhat) / N, sum(g_s) / N, 2^(k // 2), 2^(k - k // 2)) with
    g_s = dout * 2^-k * w (w: a (1, BLOCK_N) row, or anything when not HAS_W), k = row_dout_exponent; rows with
    k = 0 get the plain values."""
    acc_t: tl.constexpr = dout.dtype
    zero = tl.where(mask, dout * 0.0 + xhat * 0.0, 0.0)  # NaN where dout or xhat is not finite
    dmax = tl.max(tl.where(mask, tl.abs(dout), 0.0), axis=1)
    if HAS_W:
        zero += tl.where(mask, w * 0.0, 0.0)
        wmax = tl.max(tl.where(mask, tl.abs(w), 0.0), axis=1)
    else:
        wmax = tl.zeros_like(dmax) + 1.0
    k = row_dout_exponent(dmax, wmax, tl.sum(zero, axis=1) == 0, overflowed)
    lo = k // 2
    d_s = dout * pow2(-lo, acc_t)[:, None] * pow2(lo - k, acc_t)[:, None]
    if HAS_W:
        g_s = d_s * w
    else:
        g_s = d_s
    return g_s, tl.sum(g_s * xhat, axis=1) / N, tl.sum(g_s, axis=1) / N, pow2(lo, acc_t), pow2(k - lo, acc_t)


@rare_path
def rescaled_looped_sums(
    DOut,
    H,
    W,
    N,
    mean,
    rstd,
    sc,
    HAS_WEIGHT: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The looped kernels' form, one row through memory (DOut, H: the row's first elements; sc, mean, rstd: what
    the row is normalized with): (k, sum(g_s * xhat) / N, sum(g_s) / N) with g_s = dout * 2^-k * w; k = 0 (and the
    sums not recomputed: NaN) when dout, h or w holds an inf or NaN."""
    acc_t: tl.constexpr = rstd.dtype
    dmax = tl.zeros([BLOCK_N], dtype=acc_t)
    wmax = tl.zeros([BLOCK_N], dtype=acc_t) + 1.0
    zero = tl.zeros([BLOCK_N], dtype=acc_t)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        d = tl.load(DOut + cols, mask=ok, other=0.0).to(acc_t)
        h = tl.load(H + cols, mask=ok, other=0.0).to(acc_t)
        dmax = tl.maximum(dmax, tl.abs(d))
        zero += d * 0.0 + h * 0.0
        if HAS_WEIGHT:
            w = load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
            wmax = tl.maximum(wmax, tl.where(ok, tl.abs(w), 0.0))
            zero += w * 0.0
    k = row_dout_exponent(tl.max(dmax, axis=0), tl.max(wmax, axis=0), tl.sum(zero, axis=0) == 0, True)
    s1 = tl.zeros([BLOCK_N], dtype=acc_t) + float("nan")
    s2 = s1
    if k != 0:
        lo = k // 2
        f1, f2 = pow2(-lo, acc_t), pow2(lo - k, acc_t)
        s1 = tl.zeros([BLOCK_N], dtype=acc_t)
        s2 = tl.zeros([BLOCK_N], dtype=acc_t)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            g = tl.load(DOut + cols, mask=ok, other=0.0).to(acc_t) * f1 * f2
            if HAS_WEIGHT:
                g = g * load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
            h = tl.load(H + cols, mask=ok, other=0.0).to(acc_t) * sc
            if IS_RMS:
                xhat = h * rstd
            else:
                xhat = tl.where(ok, (h - mean) * rstd, 0.0)
            s1 += g * xhat
            s2 += g
    return k, tl.sum(s1, axis=0) / N, tl.sum(s2, axis=0) / N
