"""The Triton kernels of the fused norm-then-add ops (:mod:`addnorm.ops.norm_add`), launched by
:mod:`addnorm.ops.triton.norm_add_launch`. A whole row lives in registers (rows up to ``MAX_N`` wide), so each is read
from memory once and written once:

    forward   mean1, rstd1 = row_stats(y)                       (fp32 statistics, fp64 for fp64; RMSNorm: mean 0)
              n1   = round_y((y - mean1) * rstd1 * w1 + b1)     (CAST1: the normalized value rounded to y's dtype
                                                                 before the weight; ZC1: 1 + w1)
              h    = round_h(n1 + residual)                     (stored; the second norm sees h as stored)
              out2 = round_h((h - mean2) * rstd2 * w2 + b2),  mean2, rstd2 = row_stats(h)     (HAS_NORM2)

    backward  t  = dh + rstd2 * (g2 - mean(g2) - xhat2 * mean(g2 * xhat2)),  g2 = dout2 * w2   (without N2: dh)
              dy = rstd1 * (g1 - mean(g1) - xhat1 * mean(g1 * xhat1)),       g1 = t * w1;   dresidual = t
              dw1 = sum_rows t * xhat1, db1 = sum_rows t, dw2, db2 likewise: per-program partial rows, then summed

The statistics are one function, :func:`row_stats` (the place for any change to how a row's mean and rstd are
computed), with the arithmetic of the unfused kernels and their finite-range guard (the scaled passes of
:mod:`addnorm.ops.triton.row_stats`, forward and backward, for rows beyond the plain statistics' range only). A
program's rows are a block of ``BLOCK_M`` rows chosen from
N alone, so a row's bits do not depend on the batch. No atomics: the gradients are reproducible bit for bit.
"""

from __future__ import annotations

from addnorm.ops.triton.kernels import affine, dweight_term, jit, load_weight, round_to, rsqrt, tl
from addnorm.ops.triton.row_stats import plain_stats_fail, saved_rstd_fail, scaled_rows_bwd, scaled_rows_fwd

__all__ = ["norm_add_bwd_kernel", "norm_add_fwd_kernel", "row_stats"]


@jit
def row_stats(h, mask, row_ok, N, eps, IS_RMS: tl.constexpr):
    """(mean, d, rstd_x, rstd) of a block of rows h (zero outside ``mask``): xhat = d * rstd_x; mean and rstd are
    the statistics to save. Two passes over registers (no E[h^2] - E[h]^2 cancellation); RMSNorm's mean is 0. A row
    beyond the plain statistics' range takes the finite-range guard's scaled pass (addnorm.ops.triton.row_stats:
    d and rstd_x in the scaled units); the other rows keep the plain arithmetic and its bits."""
    if IS_RMS:
        d = h
        v = tl.sum(h * h, axis=1) / N + eps
        mean = tl.zeros_like(v)
    else:
        mean = tl.sum(h, axis=1) / N
        d = tl.where(mask, h - mean[:, None], 0.0)
        v = tl.sum(d * d, axis=1) / N + eps
    rstd = rsqrt(v)
    rstd_x = rstd
    bad = plain_stats_fail(v) & row_ok
    if tl.max(bad.to(tl.int32), axis=0) > 0:  # rare
        d, rstd_x, mean, rstd = scaled_rows_fwd(h, mask, N, eps, bad, IS_RMS)
    return mean, d, rstd_x, rstd


@jit
def norm_add_fwd_kernel(
    Y,  # (M, N) the branch's output, row stride stride_y
    R,  # (M, N) the residual, row stride stride_r
    W1,  # (N,) first norm's weight (when HAS_W1)
    B1,  # (N,) first norm's bias (when HAS_B1)
    W2,  # (N,) second norm's weight (when HAS_W2)
    B2,  # (N,) second norm's bias (when HAS_B2)
    H,  # (M, N) h = residual + N1(y), row stride stride_h (R itself in place)
    O2,  # (M, N) N2(h) in h's dtype, row stride stride_o2 (when HAS_NORM2; Y itself in place)
    Stats,  # (4, M) mean1, rstd1, mean2, rstd2; its element type is the accumulation type
    stride_y,
    stride_r,
    stride_h,
    stride_o2,
    M,
    N,
    eps1_hi,  # each eps as an fp32 pair (hi + lo): fp64 statistics keep its full precision
    eps1_lo,
    eps2_hi,
    eps2_lo,
    IS_RMS1: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_B1: tl.constexpr,
    ZC1: tl.constexpr,
    CAST1: tl.constexpr,
    HAS_NORM2: tl.constexpr,
    IS_RMS2: tl.constexpr,
    HAS_W2: tl.constexpr,
    HAS_B2: tl.constexpr,
    ZC2: tl.constexpr,
    CAST2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Stats.dtype.element_ty
    y_t = Y.dtype.element_ty
    h_t = H.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]  # int64: M * N may exceed 2^31
    y = tl.load(Y + rows64 * stride_y + cols[None, :], mask=mask, other=0.0).to(acc_t)
    r = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(acc_t)
    eps1 = tl.cast(eps1_hi, acc_t) + tl.cast(eps1_lo, acc_t)
    mean1, d1, rstd_x1, rstd1 = row_stats(y, mask, row_ok, N, eps1, IS_RMS1)
    n1 = affine(d1 * rstd_x1[:, None], W1, B1, cols, col_ok, acc_t, y_t, HAS_W1, HAS_B1, ZC1, CAST1)
    hs = round_to(round_to(n1, y_t).to(acc_t) + r, h_t)  # Hugging Face's two roundings
    tl.store(H + rows64 * stride_h + cols[None, :], hs, mask=mask)
    tl.store(Stats + rows, mean1, mask=row_ok)
    tl.store(Stats + M + rows, rstd1, mask=row_ok)
    if HAS_NORM2:
        h = tl.where(mask, hs.to(acc_t), 0.0)
        eps2 = tl.cast(eps2_hi, acc_t) + tl.cast(eps2_lo, acc_t)
        mean2, d2, rstd_x2, rstd2 = row_stats(h, mask, row_ok, N, eps2, IS_RMS2)
        o2 = affine(d2 * rstd_x2[:, None], W2, B2, cols, col_ok, acc_t, h_t, HAS_W2, HAS_B2, ZC2, CAST2)
        tl.store(O2 + rows64 * stride_o2 + cols[None, :], round_to(o2, h_t), mask=mask)
        tl.store(Stats + 2 * M + rows, mean2, mask=row_ok)
        tl.store(Stats + 3 * M + rows, rstd2, mask=row_ok)


@jit
def _norm_grad(
    dout,
    x,
    W,
    cols,
    col_ok,
    mean,
    rstd,
    mask,
    row_ok,
    N,
    acc_t: tl.constexpr,
    HAS_W: tl.constexpr,
    ZC: tl.constexpr,
    IS_RMS: tl.constexpr,
):
    """(d input, xhat) of one norm's backward for a block of rows: rstd * (g - mean(g) - xhat * mean(g * xhat)).
    A row the forward's guard rescaled (its saved rstd out of range) takes the guard's scaled pass: xhat and rstd
    in the scaled units, times the scale last (addnorm.ops.triton.row_stats)."""
    bad = saved_rstd_fail(rstd) & row_ok
    rescale = tl.max(bad.to(tl.int32), axis=0) > 0
    sc = tl.zeros_like(rstd) + 1.0
    if rescale:  # rare
        xhat, rstd, sc = scaled_rows_bwd(x, mask, N, mean, rstd, bad, IS_RMS)
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_W:
        g = dout * load_weight(W, cols, col_ok, acc_t, ZC)[None, :]
    else:
        g = dout
    c1 = tl.sum(g * xhat, axis=1)[:, None] / N
    if IS_RMS:
        dx = (g - xhat * c1) * rstd[:, None]
    else:
        dx = (g - tl.sum(g, axis=1)[:, None] / N - xhat * c1) * rstd[:, None]
    if rescale:
        dx = dx * sc[:, None]  # the true size last: inf only where dx is beyond range, never inf * 0
    return dx, xhat


@jit
def norm_add_bwd_kernel(
    DH,  # (M, N) gradient of h, row stride stride_dh (when HAS_DH)
    DO2,  # (M, N) gradient of out2, row stride stride_do2 (when HAS_DO2)
    Y,  # (M, N) y, row stride stride_y
    H,  # (M, N) h as stored, row stride stride_h (when HAS_DO2)
    W1,  # (N,) first norm's weight (when HAS_W1)
    W2,  # (N,) second norm's weight (when HAS_W2)
    Stats,  # (4, M) mean1, rstd1, mean2, rstd2
    DY,  # (M, N) gradient of y, contiguous
    DRes,  # (M, N) gradient of the residual, contiguous (when STORE_DRES)
    Part,  # (4, programs, N) partial sums of dw1, db1, dw2, db2 in the accumulation dtype
    stride_dh,
    stride_do2,
    stride_y,
    stride_h,
    M,
    N,
    HAS_DH: tl.constexpr,
    HAS_DO2: tl.constexpr,
    STORE_DRES: tl.constexpr,
    IS_RMS1: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_B1: tl.constexpr,
    ZC1: tl.constexpr,
    CAST1: tl.constexpr,
    IS_RMS2: tl.constexpr,
    HAS_W2: tl.constexpr,
    HAS_B2: tl.constexpr,
    ZC2: tl.constexpr,
    CAST2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Stats.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dw1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)
    db1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)
    dw2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)
    db2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)
    # persistent: this program takes row blocks pid, pid + programs, ... in a fixed order (deterministic)
    for row_start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        t = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)  # the gradient reaching h
        if HAS_DO2:
            do2 = tl.load(DO2 + rows64 * stride_do2 + cols[None, :], mask=mask, other=0.0).to(acc_t)
            h = tl.load(H + rows64 * stride_h + cols[None, :], mask=mask, other=0.0).to(acc_t)
            mean2 = tl.load(Stats + 2 * M + rows, mask=row_ok, other=0.0)
            rstd2 = tl.load(Stats + 3 * M + rows, mask=row_ok, other=1.0)  # 1: no NaN from masked rows
            t, xhat2 = _norm_grad(do2, h, W2, cols, col_ok, mean2, rstd2, mask, row_ok, N, acc_t, HAS_W2, ZC2, IS_RMS2)
            if HAS_W2:
                dw2 += dweight_term(do2, xhat2, CAST2, DO2.dtype.element_ty)  # dout2 is in out2's (h's) dtype
            if HAS_B2:
                db2 += do2
        if HAS_DH:
            t += tl.load(DH + rows64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(acc_t)
        y = tl.load(Y + rows64 * stride_y + cols[None, :], mask=mask, other=0.0).to(acc_t)
        mean1 = tl.load(Stats + rows, mask=row_ok, other=0.0)
        rstd1 = tl.load(Stats + M + rows, mask=row_ok, other=1.0)  # 1: no NaN from masked rows
        dy, xhat1 = _norm_grad(t, y, W1, cols, col_ok, mean1, rstd1, mask, row_ok, N, acc_t, HAS_W1, ZC1, IS_RMS1)
        if HAS_W1:
            dw1 += dweight_term(t, xhat1, CAST1, Y.dtype.element_ty)  # the forward rounded xhat1 to y's dtype
        if HAS_B1:
            db1 += t
        tl.store(DY + rows64 * N + cols[None, :], round_to(dy, DY.dtype.element_ty), mask=mask)
        if STORE_DRES:
            tl.store(DRes + rows64 * N + cols[None, :], round_to(t, DRes.dtype.element_ty), mask=mask)
    if HAS_W1:
        tl.store(Part + (0 * programs + pid) * N + cols, tl.sum(dw1, axis=0), mask=col_ok)
    if HAS_B1:
        tl.store(Part + (1 * programs + pid) * N + cols, tl.sum(db1, axis=0), mask=col_ok)
    if HAS_W2:
        tl.store(Part + (2 * programs + pid) * N + cols, tl.sum(dw2, axis=0), mask=col_ok)
    if HAS_B2:
        tl.store(Part + (3 * programs + pid) * N + cols, tl.sum(db2, axis=0), mask=col_ok)
