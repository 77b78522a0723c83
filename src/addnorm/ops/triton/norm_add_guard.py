"""The backward's own finite-range guard for the fused norm-then-add kernels (:mod:`addnorm.ops.triton.guard_bwd`
states the rule; the cpu backend's is in :mod:`addnorm.ops.cpu.norm_add_kernels`).

``norm_add_bwd_kernel`` is unchanged. ``norm_add_fixup_kernel`` runs after it on the same stream, one program per
program of the backward and over the same rows, and reads the first column of dy per row: a row sum of N1 that is
inf or NaN (g1 = t * w1 or a sum overflowed, or N2's did and t is NaN) makes every column of dy so. Such a row whose
inputs (dh, dout2, h, w2, y, w1) are all finite is redone tile by tile through memory:

    t  = dh + N2's gradient of h, with dout2 scaled by 2^-e2       (t: the gradient reaching h, dresidual)
    dy = N1's gradient of y, with t scaled by 2^-e1                 (each factor back last, guard_bwd's rule)

A row whose N2 overflowed (its dresidual t is not finite either; without dresidual, any redone row of the chain) had a
NaN t in the backward, so its program's dw1 and db1 partial sums (of t * xhat1 and t) are NaN too: that program sums
them again, over all its rows, from the recomputed t (a different order than the backward's: those sums were not
finite). dw2 and db2 (sums of dout2 * xhat2 and dout2, no w2) are not touched. Every other program ends after one
load per row block.
"""

from __future__ import annotations

from addnorm.ops.triton.elementwise import dweight_term, round_to
from addnorm.ops.triton.guard_bwd import (
    dnorm,
    g_xhat_tile,
    input_scan,
    overflowed_rows,
    redo_stats,
    scaled_dout_exponent,
    scaled_g,
    scaled_row_sums,
    scan_start,
    scan_tile,
    size_factors,
    xhat_tile,
)
from addnorm.ops.triton.row_stats import exponent_of, jit, pow2, tl

__all__ = ["norm_add_fixup_kernel"]


@jit
def _n2_context(DO2, H, W2, MeanRow, RstdRow, N, acc_t: tl.constexpr, HAS_W2: tl.constexpr, ZC2: tl.constexpr,
                IS_RMS2: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """What t's tiles need of N2 for one row: (mean_s, rstd_s, sc, down = 2^-e2, c1, c2, up1, up2, bad), bad > 0
    where dout2, h or w2 holds an inf or NaN (guard_bwd's pass, up to its last loop)."""
    mean, rstd, sc = redo_stats(H, MeanRow, RstdRow, N, IS_RMS2, BLOCK_N)
    bad, amax, wmax = input_scan(DO2, H, W2, N, acc_t, HAS_W2, ZC2, BLOCK_N)
    e = scaled_dout_exponent(tl.max(amax, axis=0), tl.max(wmax, axis=0), HAS_W2)
    down = pow2(-e, acc_t)
    c1, c2 = scaled_row_sums(DO2, H, W2, N, down, mean, rstd, sc, acc_t, HAS_W2, ZC2, BLOCK_N)
    up1, up2 = size_factors(e + exponent_of(sc), acc_t)
    return mean, rstd, sc, down, c1, c2, up1, up2, tl.max(bad, axis=0)


@jit
def _row_context(DO2, Y, H, W2, Stats, row, M, N, acc_t: tl.constexpr, HAS_DO2: tl.constexpr,
                 IS_RMS1: tl.constexpr, IS_RMS2: tl.constexpr, HAS_W2: tl.constexpr, ZC2: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """_n2_context's values for one row (neutral ones without dout2: t = dh), then N1's (mean_s, rstd_s, sc)."""
    one = tl.load(Stats + M + row) * 0.0 + 1.0
    mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, bad = one * 0.0, one, one, one, one, one, one, one, 0
    if HAS_DO2:
        mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, bad = _n2_context(
            DO2, H, W2, Stats + 2 * M + row, Stats + 3 * M + row, N, acc_t, HAS_W2, ZC2, IS_RMS2, BLOCK_N
        )
    mean1, rstd1, sc1 = redo_stats(Y, Stats + row, Stats + M + row, N, IS_RMS1, BLOCK_N)
    return mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, bad, mean1, rstd1, sc1


@jit
def _t_tile(DH, DO2, H, W2, cols, ok, mean, rstd, sc, down, c1, c2, up1, up2, acc_t: tl.constexpr,
            HAS_DH: tl.constexpr, HAS_DO2: tl.constexpr, HAS_W2: tl.constexpr, ZC2: tl.constexpr,
            IS_RMS2: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The gradient reaching h over one tile of a row: dh + N2's gradient (from _n2_context's values)."""
    t = tl.zeros([BLOCK_N], dtype=acc_t)
    if HAS_DO2:
        g, xhat = g_xhat_tile(DO2, H, W2, cols, ok, down, mean, rstd, sc, acc_t, HAS_W2, ZC2)
        t = dnorm(g, xhat, c1, c2, rstd, up1, up2, IS_RMS2)
    if HAS_DH:
        t += tl.load(DH + cols, mask=ok, other=0.0).to(acc_t)
    return t


@jit
def norm_add_fixup_kernel(
    DH, DO2, Y, H, W1, W2, Stats, DY, DRes, Part,  # norm_add_bwd_kernel's arguments, its outputs written
    stride_dh, stride_do2, stride_y, stride_h, M, N,
    HAS_DH: tl.constexpr, HAS_DO2: tl.constexpr, STORE_DRES: tl.constexpr, IS_RMS1: tl.constexpr,
    HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, ZC1: tl.constexpr, CAST1: tl.constexpr, IS_RMS2: tl.constexpr,
    HAS_W2: tl.constexpr, ZC2: tl.constexpr,
    BLOCK_M: tl.constexpr,  # the backward's: this program's rows are its program's
    TILE: tl.constexpr,
):  # fmt: skip
    acc_t = Stats.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n2_flagged = 0
    for row_start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        bad = overflowed_rows(DY, rows, M, N, False, BLOCK_M)
        if tl.max(bad, axis=0) > 0:  # rare: a block of ordinary rows costs one load here
            if HAS_DO2:
                # N2's sums overflowed where t (dresidual, read before the redo rewrites it) is not finite too;
                # without dresidual, any redone row counts
                bad2 = bad
                if STORE_DRES:
                    bad2 = bad * overflowed_rows(DRes, rows, M, N, False, BLOCK_M)
                n2_flagged = tl.maximum(n2_flagged, tl.max(bad2, axis=0))
            _redo_block(DH, DO2, Y, H, W1, W2, Stats, DY, DRes, bad, stride_dh, stride_do2, stride_y, stride_h,
                        row_start, M, N, acc_t, HAS_DH, HAS_DO2, STORE_DRES, IS_RMS1, HAS_W1, ZC1, IS_RMS2, HAS_W2,
                        ZC2, BLOCK_M, TILE)  # fmt: skip

    if (HAS_W1 or HAS_B1) and n2_flagged > 0:  # this program's dw1 and db1 sums saw a NaN t: summed again
        for start in range(0, N, TILE):
            cols = start + tl.arange(0, TILE)
            zero = tl.zeros([TILE], dtype=acc_t)
            tl.store(Part + (0 * programs + pid) * N + cols, zero, mask=cols < N)
            tl.store(Part + (1 * programs + pid) * N + cols, zero, mask=cols < N)
        for row_start in range(pid * BLOCK_M, M, programs * BLOCK_M):
            for i in range(0, BLOCK_M):
                r = row_start + i
                if r < M:
                    row = tl.cast(r, tl.int64)
                    _dw1_row(DH + row * stride_dh, DO2 + row * stride_do2, Y + row * stride_y, H + row * stride_h,
                             W2, Stats, row, Part + (0 * programs + pid) * N, Part + (1 * programs + pid) * N, M, N,
                             acc_t, HAS_DH, HAS_DO2, IS_RMS1, HAS_W1, HAS_B1, CAST1, IS_RMS2, HAS_W2, ZC2,
                             TILE)  # fmt: skip


@jit
def _redo_block(DH, DO2, Y, H, W1, W2, Stats, DY, DRes, bad, stride_dh, stride_do2, stride_y, stride_h, row_start,
                M, N, acc_t: tl.constexpr, HAS_DH: tl.constexpr, HAS_DO2: tl.constexpr, STORE_DRES: tl.constexpr,
                IS_RMS1: tl.constexpr, HAS_W1: tl.constexpr, ZC1: tl.constexpr, IS_RMS2: tl.constexpr,
                HAS_W2: tl.constexpr, ZC2: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """The rows ``bad`` of the block of BLOCK_M rows at row_start, one by one."""
    for i in range(0, BLOCK_M):
        r = row_start + i
        if r < M:
            row = tl.cast(r, tl.int64)
            if tl.max(tl.where(tl.arange(0, BLOCK_M) == i, bad, 0), axis=0) > 0:
                _redo_row(DH + row * stride_dh, DO2 + row * stride_do2, Y + row * stride_y, H + row * stride_h, W1,
                          W2, Stats, row, DY + row * N, DRes + row * N, M, N, acc_t, HAS_DH, HAS_DO2, STORE_DRES,
                          IS_RMS1, HAS_W1, ZC1, IS_RMS2, HAS_W2, ZC2, TILE)  # fmt: skip


@jit
def _redo_row(DH, DO2, Y, H, W1, W2, Stats, row, DY, DRes, M, N, acc_t: tl.constexpr, HAS_DH: tl.constexpr,
              HAS_DO2: tl.constexpr, STORE_DRES: tl.constexpr, IS_RMS1: tl.constexpr, HAS_W1: tl.constexpr,
              ZC1: tl.constexpr, IS_RMS2: tl.constexpr, HAS_W2: tl.constexpr, ZC2: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """dy and dresidual of one flagged row (pointers at the row), the module docstring's passes."""
    mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, bad, mean1, rstd1, sc1 = _row_context(
        DO2, Y, H, W2, Stats, row, M, N, acc_t, HAS_DO2, IS_RMS1, IS_RMS2, HAS_W2, ZC2, BLOCK_N
    )
    amax, wmax, bad1 = scan_start(acc_t, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        t = _t_tile(DH, DO2, H, W2, cols, ok, mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, acc_t, HAS_DH,
                    HAS_DO2, HAS_W2, ZC2, IS_RMS2, BLOCK_N)  # fmt: skip
        y = tl.load(Y + cols, mask=ok, other=0.0).to(acc_t)
        bad1, amax, wmax = scan_tile(t, y, W1, cols, ok, bad1, amax, wmax, acc_t, HAS_W1, ZC1)
    if bad + tl.max(bad1, axis=0) == 0:  # else an inf or NaN of the inputs: the plain result stands
        e = scaled_dout_exponent(tl.max(amax, axis=0), tl.max(wmax, axis=0), HAS_W1)
        down = pow2(-e, acc_t)
        s1 = tl.zeros([BLOCK_N], dtype=acc_t)
        s2 = tl.zeros([BLOCK_N], dtype=acc_t)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            t = _t_tile(DH, DO2, H, W2, cols, ok, mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, acc_t, HAS_DH,
                        HAS_DO2, HAS_W2, ZC2, IS_RMS2, BLOCK_N)  # fmt: skip
            g = scaled_g(t, down, W1, cols, ok, acc_t, HAS_W1, ZC1)
            xhat = xhat_tile(Y, cols, ok, mean1, rstd1, sc1, acc_t)
            s1 += g * xhat
            s2 += g
        c1 = tl.sum(s1, axis=0) / N
        c2 = tl.sum(s2, axis=0) / N
        up1, up2 = size_factors(e + exponent_of(sc1), acc_t)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            t = _t_tile(DH, DO2, H, W2, cols, ok, mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, acc_t, HAS_DH,
                        HAS_DO2, HAS_W2, ZC2, IS_RMS2, BLOCK_N)  # fmt: skip
            g = scaled_g(t, down, W1, cols, ok, acc_t, HAS_W1, ZC1)
            dy = dnorm(g, xhat_tile(Y, cols, ok, mean1, rstd1, sc1, acc_t), c1, c2, rstd1, up1, up2, IS_RMS1)
            tl.store(DY + cols, round_to(dy, DY.dtype.element_ty), mask=ok)
            if STORE_DRES:
                tl.store(DRes + cols, round_to(t, DRes.dtype.element_ty), mask=ok)


@jit
def _dw1_row(DH, DO2, Y, H, W2, Stats, row, DW1, DB1, M, N, acc_t: tl.constexpr, HAS_DH: tl.constexpr,
             HAS_DO2: tl.constexpr, IS_RMS1: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
             CAST1: tl.constexpr, IS_RMS2: tl.constexpr, HAS_W2: tl.constexpr, ZC2: tl.constexpr,
             BLOCK_N: tl.constexpr):  # fmt: skip
    """One row's t * xhat1 and t added to the partial rows at DW1 and DB1 (each column by the thread that wrote it)."""
    mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, bad, mean1, rstd1, sc1 = _row_context(
        DO2, Y, H, W2, Stats, row, M, N, acc_t, HAS_DO2, IS_RMS1, IS_RMS2, HAS_W2, ZC2, BLOCK_N
    )
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        t = _t_tile(DH, DO2, H, W2, cols, ok, mean2, rstd2, sc2, down2, c1_2, c2_2, up1_2, up2_2, acc_t, HAS_DH,
                    HAS_DO2, HAS_W2, ZC2, IS_RMS2, BLOCK_N)  # fmt: skip
        if HAS_W1:
            xhat = xhat_tile(Y, cols, ok, mean1, rstd1, sc1, acc_t)
            dw = tl.load(DW1 + cols, mask=ok, other=0.0)
            tl.store(DW1 + cols, dw + dweight_term(t, xhat, CAST1, Y.dtype.element_ty), mask=ok)
        if HAS_B1:
            tl.store(DB1 + cols, tl.load(DB1 + cols, mask=ok, other=0.0) + t, mask=ok)
