"""The numba kernels of the fused norm-then-add ops (:mod:`addnorm.ops.norm_add`) on the ``cpu`` backend:
``h = residual + N1(y)`` and, optionally, ``out2 = N2(h)``, forward and backward, one pass over each row.

The math (one row of length N; statistics in the statistics dtype s: fp32, fp64 for fp64):

    forward     mean1, rstd1 = guarded_row_stats(y)             (RMSNorm: mean1 = 0)
                n1    = round_y((y - mean1) * rstd1 * w1 + b1)  (w1 is 1 + weight1 when zero-centered; cast1
                                                                 rounds (y - mean1) * rstd1 to y's dtype first)
                h     = round_h(n1 + residual)                  (the add in s, rounded once to h's dtype: what
                                                                 torch's ``residual + n1`` computes)
                mean2, rstd2 = guarded_row_stats(h);  out2 = round_h((h - mean2) * rstd2 * w2 + b2)   (only with N2)

    backward    t   = dh + rstd2 * (g2 - mean(g2) - xhat2 * mean(g2 * xhat2)),   g2 = dout2 * w2   (t = dh without N2)
                dy  = rstd1 * (g1 - mean(g1) - xhat1 * mean(g1 * xhat1)),       g1 = t * w1
                dresidual = t;   dw1 = sum_rows t * xhat1,  db1 = sum_rows t;  dw2 = sum_rows dout2 * xhat2, ...

Both roundings of the forward (n1 to y's dtype, h to its own) pass the gradient straight through: t is rounded
only where it is stored (dresidual). Each row is read from DRAM once and stays in cache for the passes over it:
the forward reads y and residual and writes h (and out2), the fewest bytes the op can move. Large bf16 calls take
:mod:`addnorm.ops.cpu.bf16_pairs` instead (the launch chooses): the same forward, two bf16 values per 32-bit word,
the same bits.

Statistics are the unfused kernels' :func:`~addnorm.ops.cpu.stats.guarded_row_stats` for both norms, so a row
gets the unfused kernels' bits, and a row beyond the plain statistics' range the finite-range guard's scaled pass
(:func:`~addnorm.ops.cpu.kernels.normalize_row_scaled`; backward: :mod:`addnorm.ops.cpu.guard_bwd`). dweight and
dbias are reduced in row chunks whose number depends on M only (as the unfused backward does): bitwise the same
whatever the thread count.

numba's cache keys a kernel on its own file's source: after editing this module or :mod:`addnorm.ops.cpu.kernels`
(or :mod:`~addnorm.ops.cpu.stats`, :mod:`~addnorm.ops.cpu.guard_bwd`), delete the ``__pycache__`` entries
(*.nbi, *.nbc) of this module and of
:mod:`addnorm.ops.cpu.norm_add_fast_launch` (which compiles these kernels into itself), or they keep running the old
code (tests/ops/test_norm_add_fused.py's fast-path test compares the two launches bit for bit).
"""

from __future__ import annotations

import numpy as np

from addnorm.ops.cpu.convert import FAST, JIT, cast_like, load, njit, prange, round_as, store_rounded, zero_of
from addnorm.ops.cpu.guard_bwd import finite_inputs, scaled_bwd_sums, scaled_dw_row, scaled_dx_row
from addnorm.ops.cpu.kernels import normalize_row, normalize_row_scaled
from addnorm.ops.cpu.stats import NOT_SCALED, guarded_row_stats, pow2_halves, saved_row_scaling

__all__ = ["bwd_parallel", "bwd_serial", "fwd_parallel", "fwd_serial"]

# Flags arrive as one tuple of bools (numba types it once), in this order:
#   (is_rms1, has_w1, has_b1, cast1, has_norm2, is_rms2, has_w2, has_b2, cast2)


@njit(inline="always")
def _norm_add_loop(y, r, h, W, B, n, mean, rstd, has_w, has_b, cast, zero):
    for j in range(n):
        v = (cast_like(load(y, j), zero) - mean) * rstd
        if cast:
            v = round_as(y, v)
        if has_w:
            v = v * cast_like(load(W, j), zero)
        if has_b:
            v = v + cast_like(load(B, j), zero)
        store_rounded(h, j, round_as(y, v) + cast_like(load(r, j), zero))


@njit(**JIT)
def _norm_add_row(y, r, h, W, B, n, mean, rstd, has_w, has_b, cast, zero):
    # the flags as constants in each branch: LLVM vectorizes a loop without branches inside, not one with them
    if cast:
        if has_w and has_b:
            _norm_add_loop(y, r, h, W, B, n, mean, rstd, True, True, True, zero)
        elif has_w:
            _norm_add_loop(y, r, h, W, B, n, mean, rstd, True, False, True, zero)
        else:
            _norm_add_loop(y, r, h, W, B, n, mean, rstd, False, True, True, zero)
    elif has_w and has_b:
        _norm_add_loop(y, r, h, W, B, n, mean, rstd, True, True, False, zero)
    elif has_w:
        _norm_add_loop(y, r, h, W, B, n, mean, rstd, True, False, False, zero)
    elif has_b:
        _norm_add_loop(y, r, h, W, B, n, mean, rstd, False, True, False, zero)
    else:
        _norm_add_loop(y, r, h, W, B, n, mean, rstd, False, False, False, zero)


@njit(**JIT)
def _norm_add_row_inplace(y, h, W, B, n, mean, rstd, has_w, has_b, cast, zero):
    # h is the residual's row, read and written: one array, so that LLVM sees one pointer (passed as two arrays, it
    # cannot prove them free of overlap and leaves the loop unvectorized)
    if cast:
        if has_w and has_b:
            _norm_add_loop(y, h, h, W, B, n, mean, rstd, True, True, True, zero)
        elif has_w:
            _norm_add_loop(y, h, h, W, B, n, mean, rstd, True, False, True, zero)
        else:
            _norm_add_loop(y, h, h, W, B, n, mean, rstd, False, True, True, zero)
    elif has_w and has_b:
        _norm_add_loop(y, h, h, W, B, n, mean, rstd, True, True, False, zero)
    elif has_w:
        _norm_add_loop(y, h, h, W, B, n, mean, rstd, True, False, False, zero)
    elif has_b:
        _norm_add_loop(y, h, h, W, B, n, mean, rstd, False, True, False, zero)
    else:
        _norm_add_loop(y, h, h, W, B, n, mean, rstd, False, False, False, zero)


@njit(**JIT)
def _norm_add_row_scaled(y, r, h, W, B, n, k, mean_s, rs, has_w, has_b, cast, zero):
    """The norm-add loop of a row the guard rescaled (:func:`addnorm.ops.cpu.stats.guarded_row_stats`): N1 in
    float64 as xhat = (y * 2^k - mean_s) * rs, rounded to y's dtype, then the add as on ordinary rows (r may be h:
    each element is read before it is written). Rare rows: no unswitching for speed here."""
    s1, s2 = pow2_halves(k)
    for j in range(n):
        v = (np.float64(load(y, j)) * s1 * s2 - mean_s) * rs
        if cast:
            v = round_as(y, v)
        if has_w:
            v = v * np.float64(load(W, j))
        if has_b:
            v = v + np.float64(load(B, j))
        store_rounded(h, j, cast_like(round_as(y, v), zero) + cast_like(load(r, j), zero))


@njit(**JIT)
def _fwd_row(i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, Stats, n, flags, in_place, eps1, eps2, zero):
    # Y: y rows (stride sy); R: residual rows; H: h rows (may be R itself: in place); O2: N2(h) rows (may be Y
    # itself: in place, written after the row of y is read); in_place: H is R; W*, B*: effective weights and biases in
    # the statistics dtype, or as stored in y's half dtype (the decode launch: a half value widens to fp32 exactly,
    # so either gives the same bits); Stats: (4, M) mean1, rstd1, mean2, rstd2
    is_rms1, has_w1, has_b1, cast1, has_norm2, is_rms2, has_w2, has_b2, cast2 = flags
    m = Stats.shape[0] // 4
    y = Y[i * sy : i * sy + n]
    r = R[i * sr : i * sr + n]
    h = H[i * sh : i * sh + n]
    mean1, rstd1, k1, mean_s1, r1 = guarded_row_stats(y, n, is_rms1, eps1, zero)
    Stats[i], Stats[m + i] = mean1, rstd1
    if k1 != NOT_SCALED:  # a row the finite-range guard rescaled
        _norm_add_row_scaled(y, r, h, W1, B1, n, k1, mean_s1, r1, has_w1, has_b1, cast1, zero)
    elif in_place:
        _norm_add_row_inplace(y, h, W1, B1, n, mean1, rstd1, has_w1, has_b1, cast1, zero)
    else:
        _norm_add_row(y, r, h, W1, B1, n, mean1, rstd1, has_w1, has_b1, cast1, zero)
    if has_norm2:  # h is still in cache: its statistics and N2 cost no DRAM reads
        mean2, rstd2, k2, mean_s2, r2 = guarded_row_stats(h, n, is_rms2, eps2, zero)
        Stats[2 * m + i], Stats[3 * m + i] = mean2, rstd2
        o2 = O2[i * so2 : i * so2 + n]
        if k2 != NOT_SCALED:
            normalize_row_scaled(h, o2, W2, B2, n, k2, mean_s2, r2, has_w2, has_b2, cast2)
        else:
            normalize_row(h, o2, W2, B2, n, mean2, rstd2, has_w2, has_b2, cast2, zero)


# Two drivers over one row function: prange for large inputs, a plain loop where waking the pool costs more.
@njit(parallel=True, **JIT)
def fwd_parallel(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, Stats, m, n, flags, in_place, eps1, eps2):
    zero = zero_of(Stats)
    eps1, eps2 = cast_like(eps1, zero), cast_like(eps2, zero)
    for i in prange(m):
        _fwd_row(i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, Stats, n, flags, in_place, eps1, eps2, zero)


@njit(**JIT)
def fwd_serial(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, Stats, m, n, flags, in_place, eps1, eps2):
    zero = zero_of(Stats)
    eps1, eps2 = cast_like(eps1, zero), cast_like(eps2, zero)
    for i in range(m):
        _fwd_row(i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, Stats, n, flags, in_place, eps1, eps2, zero)


# --------------------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------------------


@njit(fastmath=FAST, **JIT)
def _sums(g_src, x, W, has_w, mean, rstd, n, zero):
    """sum(g) and sum(g * xhat) over one row, g = g_src * w, xhat = (x - mean) * rstd."""
    sg = zero
    sgx = zero
    for j in range(n):
        g = cast_like(load(g_src, j), zero)
        if has_w:
            g = g * W[j]
        sg += g
        sgx += g * ((cast_like(load(x, j), zero) - mean) * rstd)
    return sg, sgx


@njit(**JIT)
def _n2_grad_row(do2, dh, h, t, W2, dw2, db2, n, mean, rstd, mean_g, proj, has_dh, has_w, has_b, cast, zero):
    """t = N2's backward of dout2 (+ dh): the gradient reaching h; this row's share of dw2 and db2."""
    for j in range(n):
        d = cast_like(load(do2, j), zero)
        xhat = (cast_like(load(h, j), zero) - mean) * rstd
        g = d * W2[j] if has_w else d
        v = rstd * (g - mean_g - xhat * proj)
        if has_dh:
            v = v + cast_like(load(dh, j), zero)
        t[j] = v
        if has_w:
            dw2[j] += d * (round_as(do2, xhat) if cast else xhat)  # dout2 is stored in out2's (h's) dtype
        if has_b:
            db2[j] += d


@njit(**JIT)
def _n1_grad_row(t, y, dy, dres, W1, dw1, db1, n, mean, rstd, mean_g, proj, has_dres, has_w, has_b, cast, zero):
    """dy from t (the gradient of N1's output: it reached h through the add), dresidual = t; dw1, db1 shares."""
    for j in range(n):
        d = t[j]
        xhat = (cast_like(load(y, j), zero) - mean) * rstd
        g = d * W1[j] if has_w else d
        store_rounded(dy, j, rstd * (g - mean_g - xhat * proj))
        if has_dres:
            store_rounded(dres, j, d)
        if has_w:
            dw1[j] += d * (round_as(y, xhat) if cast else xhat)  # the forward rounded xhat to y's dtype
        if has_b:
            db1[j] += d


@njit(**JIT)
def _n1_grad_row_scaled(t, y, dres, dw1, db1, n, k, mean_s, r, has_dres, has_w, has_b, cast):
    """dresidual = t and the dw1, db1 shares of a row the guard rescaled (dy is the guard's scaled_dx_row): xhat
    in float64 in the scaled units, rounded to y's dtype where the forward rounded it."""
    s1, s2 = pow2_halves(k)
    for j in range(n):
        d = t[j]
        if has_dres:
            store_rounded(dres, j, d)
        if has_w:
            xhat = (np.float64(load(y, j)) * s1 * s2 - mean_s) * r
            if cast:
                xhat = round_as(y, xhat)
            dw1[j] += cast_like(d * xhat, dw1[j])
        if has_b:
            db1[j] += d


@njit(**JIT)
def _bwd_chunk(c, chunks, m, DH, sdh, DO2, sdo2, Y, sy, H, sh, W1, W2, Stats, DY, DRes, Part, n, flags, grads):
    # DH: gradient of h (rows, stride sdh); DO2: gradient of out2; Y, H: y and h as stored; Stats: (4, M);
    # DY, DRes: (M, N) outputs; Part: (4, chunks, N) partial sums of dw1, db1, dw2, db2, this chunk's row c
    is_rms1, has_w1, has_b1, cast1, has_norm2, is_rms2, has_w2, has_b2, cast2 = flags
    has_dh, has_do2, has_dres = grads
    zero = zero_of(Stats)
    nf = cast_like(n, zero)
    t = np.zeros(n, dtype=Stats.dtype)  # the row's gradient of h, in the statistics dtype
    dw1, db1 = Part[(0 * chunks + c) * n :][:n], Part[(1 * chunks + c) * n :][:n]
    dw2, db2 = Part[(2 * chunks + c) * n :][:n], Part[(3 * chunks + c) * n :][:n]
    for i in range(c * m // chunks, (c + 1) * m // chunks):
        y = Y[i * sy : i * sy + n]
        dh = DH[i * sdh : i * sdh + n]
        if has_norm2 and has_do2:
            do2 = DO2[i * sdo2 : i * sdo2 + n]
            h = H[i * sh : i * sh + n]
            mean2, rstd2 = Stats[2 * m + i], Stats[3 * m + i]
            k2, mean_s2, r2 = saved_row_scaling(h, n, is_rms2, zero if is_rms2 else mean2, rstd2)
            if k2 == NOT_SCALED:
                sg, sgx = _sums(do2, h, W2, has_w2, mean2, rstd2, n, zero)
                if not (np.isfinite(sg) and np.isfinite(sgx)) and finite_inputs(do2, h, W2, has_w2, n):
                    k2, mean_s2, r2 = 0, np.float64(mean2), np.float64(rstd2)  # N2's backward overflowed
            if k2 != NOT_SCALED:  # a row the forward's guard rescaled (or k2 = 0): t in float64, rounded to t's dtype
                sg64, sgx64 = scaled_bwd_sums(do2, h, W2, has_w2, n, k2, mean_s2, r2)
                mg = 0.0 if is_rms2 else sg64 / n
                # the guard's dx row with t as dx and dh as the added gradient; no dresidual here, no dropout
                scaled_dx_row(
                    0,
                    do2,
                    h,
                    dh,
                    t,
                    t,
                    W2,
                    n,
                    k2,
                    mean_s2,
                    r2,
                    mg,
                    sgx64 / n,
                    has_dh,
                    has_w2,
                    False,
                    False,
                    np.uint64(0),
                    np.uint64(0),
                    1.0,
                )
                if has_w2 or has_b2:
                    scaled_dw_row(do2, h, dw2, db2, n, k2, mean_s2, r2, has_w2, has_b2, cast2)
            else:
                mean_g = zero if is_rms2 else sg / nf
                _n2_grad_row(do2, dh, h, t, W2, dw2, db2, n, mean2, rstd2, mean_g, sgx / nf, has_dh, has_w2, has_b2, cast2, zero)  # fmt: skip
        elif has_dh:
            for j in range(n):
                t[j] = cast_like(load(dh, j), zero)
        mean1, rstd1 = Stats[i], Stats[m + i]
        dy, dres = DY[i * n : i * n + n], DRes[i * n : i * n + n]
        k1, mean_s1, r1 = saved_row_scaling(y, n, is_rms1, zero if is_rms1 else mean1, rstd1)
        if k1 == NOT_SCALED:
            sg, sgx = _sums(t, y, W1, has_w1, mean1, rstd1, n, zero)
            if not (np.isfinite(sg) and np.isfinite(sgx)) and finite_inputs(t, y, W1, has_w1, n):
                k1, mean_s1, r1 = 0, np.float64(mean1), np.float64(rstd1)  # N1's backward overflowed
        if k1 != NOT_SCALED:
            sg64, sgx64 = scaled_bwd_sums(t, y, W1, has_w1, n, k1, mean_s1, r1)
            mg = 0.0 if is_rms1 else sg64 / n
            # dy only (dresidual = t and the weight shares: _n1_grad_row_scaled), no dropout
            scaled_dx_row(
                0,
                t,
                y,
                t,
                dy,
                dy,
                W1,
                n,
                k1,
                mean_s1,
                r1,
                mg,
                sgx64 / n,
                False,
                has_w1,
                False,
                False,
                np.uint64(0),
                np.uint64(0),
                1.0,
            )
            _n1_grad_row_scaled(t, y, dres, dw1, db1, n, k1, mean_s1, r1, has_dres, has_w1, has_b1, cast1)
            continue
        mean_g = zero if is_rms1 else sg / nf
        _n1_grad_row(t, y, dy, dres, W1, dw1, db1, n, mean1, rstd1, mean_g, sgx / nf, has_dres, has_w1, has_b1, cast1, zero)  # fmt: skip


@njit(**JIT)
def _sum_chunks(Part, k, chunks, n, Out):
    """Out = the sum over chunks, in order, of Part[k] (deterministic: a fixed order)."""
    for j in range(n):
        Out[j] = Part[k * chunks * n + j]
    for c in range(1, chunks):
        base = (k * chunks + c) * n
        for j in range(n):
            Out[j] += Part[base + j]


@njit(**JIT)
def _reduce(Part, Red, chunks, n, flags):
    is_rms1, has_w1, has_b1, cast1, has_norm2, is_rms2, has_w2, has_b2, cast2 = flags
    for k, on in enumerate((has_w1, has_b1, has_w2 and has_norm2, has_b2 and has_norm2)):
        if on:
            _sum_chunks(Part, k, chunks, n, Red[k * n : k * n + n])


@njit(parallel=True, **JIT)
def bwd_parallel(chunks, m, DH, sdh, DO2, sdo2, Y, sy, H, sh, W1, W2, Stats, DY, DRes, Part, Red, n, flags, grads):
    for c in prange(chunks):
        _bwd_chunk(c, chunks, m, DH, sdh, DO2, sdo2, Y, sy, H, sh, W1, W2, Stats, DY, DRes, Part, n, flags, grads)
    _reduce(Part, Red, chunks, n, flags)


@njit(**JIT)
def bwd_serial(chunks, m, DH, sdh, DO2, sdo2, Y, sy, H, sh, W1, W2, Stats, DY, DRes, Part, Red, n, flags, grads):
    for c in range(chunks):
        _bwd_chunk(c, chunks, m, DH, sdh, DO2, sdo2, Y, sy, H, sh, W1, W2, Stats, DY, DRes, Part, n, flags, grads)
    _reduce(Part, Red, chunks, n, flags)
