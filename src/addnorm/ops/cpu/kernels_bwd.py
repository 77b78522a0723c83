"""The backward kernels of the ``cpu`` backend (the math, and how the rows are read, are in
:mod:`addnorm.ops.cpu.kernels`): dx and dresidual row by row, dweight and dbias reduced in a fixed number of row
chunks that depends only on M, or, for few rows, by column blocks that sum the rows in the same order. Either way
the result is bitwise the same whatever the thread count.

numba's cache (``cache=True``) checks only the source of a kernel's own file: these kernels inline the helpers of
:mod:`addnorm.ops.cpu.kernels`, so after editing those, delete this module's entries in ``__pycache__``
(``kernels_bwd.*.nbi``/``.nbc``).

Rows whose saved statistics fail the finite-range guard's test (:func:`addnorm.ops.cpu.stats.saved_row_scaling`)
take the scaled backward of :mod:`addnorm.ops.cpu.guard_bwd`; the test is one comparison per row on the others.
So does a row whose plain row sums come out inf or NaN from finite inputs (the backward overflowed fp32), with k = 0
and the saved statistics: one more test of the two sums per row.
"""

from __future__ import annotations

import math

import numpy as np

from addnorm.ops.cpu.guard_bwd import finite_inputs, scaled_bwd_sums, scaled_dw_row, scaled_dx_row
from addnorm.ops.cpu.kernels import (
    FAST,
    JIT,
    cast_like,
    keep,
    load,
    njit,
    prange,
    round_as,
    store_rounded,
    zero_of,
)
from addnorm.ops.cpu.stats import NOT_SCALED, saved_row_scaling

__all__ = ["bwd_cols_parallel", "bwd_parallel", "bwd_serial"]

# --------------------------------------------------------------------------------------------------------------
# Kernels. As in the forward's: arrays are flat 1-D views, row i of X starts at i * sx; capitalised names are arrays.
# --------------------------------------------------------------------------------------------------------------


@njit(fastmath=FAST, **JIT)
def _bwd_sums(dy, h, W, has_w, mean, rstd, n, zero):
    """sum(g) and sum(g * xhat) over one row, g = dy * w."""
    sg = zero
    sgx = zero
    for j in range(n):
        g = cast_like(load(dy, j), zero)
        if has_w:
            g = g * W[j]
        xhat = (cast_like(load(h, j), zero) - mean) * rstd
        sg += g
        sgx += g * xhat
    return sg, sgx


# The per-row loops live in small functions of their own: LLVM vectorizes each simple loop, where one long loop body
# full of flags stayed scalar (several times slower).
@njit(**JIT)
def _bwd_dx_row(
    base,
    dy,
    h,
    dro,
    dx,
    dres,
    W,
    n,
    mean,
    rstd,
    mean_g,
    proj,
    has_dro,
    has_w,
    has_dres,
    dropout,
    seed_key,
    threshold,
    scale,
    zero,
):
    # base: the element index (i * N + first column) of dy[0], for the dropout mask
    for j in range(n):
        xhat = (cast_like(load(h, j), zero) - mean) * rstd
        g = cast_like(load(dy, j), zero)
        if has_w:
            g = g * W[j]
        dh = rstd * (g - mean_g - xhat * proj)
        if has_dro:
            dh = dh + cast_like(load(dro, j), zero)
        if has_dres:
            store_rounded(dres, j, dh)
        if dropout:
            dh = dh * scale if keep(base + j, seed_key, threshold) else zero
        store_rounded(dx, j, dh)


@njit(**JIT)
def _bwd_dw_row(dy, h, dwp, dbp, n, mean, rstd, has_w, has_db, cast, zero):
    """This row's share of dweight (dy * xhat) and dbias (dy), added to its chunk's partial sums."""
    for j in range(n):
        d = cast_like(load(dy, j), zero)
        if has_w:
            xhat = (cast_like(load(h, j), zero) - mean) * rstd
            if cast:  # the forward rounded xhat to out's dtype (dout's storage type) before the weight
                xhat = round_as(dy, xhat)
            dwp[j] += d * xhat
        if has_db:
            dbp[j] += d


@njit(**JIT)
def _bwd_chunk(
    c,
    chunks,
    m,
    DY,
    sdy,
    DRO,
    sdro,
    H,
    sh,
    W,
    Mean,
    Rstd,
    DX,
    DRes,
    DWp,
    DBp,
    n,
    has_dro,
    has_w,
    has_dres,
    has_db,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    cast,
    zero,
):
    # DY: dout rows; DRO: dresidual_out rows; H: the normalized input as stored; W: effective weight (stats
    # dtype); DX, DRes: (M, N) outputs; DWp, DBp: (chunks, N) partial sums of this chunk's rows
    nf = cast_like(n, zero)
    dwp = DWp[c * n : c * n + n]
    dbp = DBp[c * n : c * n + n]
    for i in range(c * m // chunks, (c + 1) * m // chunks):
        dy = DY[i * sdy : i * sdy + n]
        h = H[i * sh : i * sh + n]
        dro = DRO[i * sdro : i * sdro + n]
        dx = DX[i * n : i * n + n]
        dres = DRes[i * n : i * n + n]
        rstd = Rstd[i]
        mean = zero if is_rms else Mean[i]
        k, mean_s, r = saved_row_scaling(h, n, is_rms, mean, rstd)
        if k == NOT_SCALED:
            sg, sgx = _bwd_sums(dy, h, W, has_w, mean, rstd, n, zero)
            if not (math.isfinite(sg) and math.isfinite(sgx)) and finite_inputs(dy, h, W, has_w, n):
                k, mean_s, r = 0, np.float64(mean), np.float64(rstd)  # the backward overflowed: float64, unscaled
        if k != NOT_SCALED:  # a row the forward's guard rescaled, or whose backward overflowed
            sg64, sgx64 = scaled_bwd_sums(dy, h, W, has_w, n, k, mean_s, r)  # (own names: sg stays fp32)
            mg = 0.0 if is_rms else sg64 / n
            scaled_dx_row(
                i * n,
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
                mg,
                sgx64 / n,
                has_dro,
                has_w,
                has_dres,
                dropout,
                seed_key,
                threshold,
                scale,
            )
            if has_w or has_db:
                scaled_dw_row(dy, h, dwp, dbp, n, k, mean_s, r, has_w, has_db, cast)
            continue
        mean_g = zero if is_rms else sg / nf
        _bwd_dx_row(
            i * n,
            dy,
            h,
            dro,
            dx,
            dres,
            W,
            n,
            mean,
            rstd,
            mean_g,
            sgx / nf,
            has_dro,
            has_w,
            has_dres,
            dropout,
            seed_key,
            threshold,
            scale,
            zero,
        )
        if has_w or has_db:
            _bwd_dw_row(dy, h, dwp, dbp, n, mean, rstd, has_w, has_db, cast, zero)


@njit(**JIT)
def _sum_chunks(P, chunks, n, Out):
    """Out[j] = sum of P[c, j] over c in order: a fixed order, so the result is deterministic."""
    for j in range(n):
        Out[j] = P[j]
    for c in range(1, chunks):
        for j in range(n):
            Out[j] += P[c * n + j]


@njit(parallel=True, **JIT)
def bwd_parallel(
    chunks,
    m,
    DY,
    sdy,
    DRO,
    sdro,
    H,
    sh,
    W,
    Mean,
    Rstd,
    DX,
    DRes,
    DWp,
    DBp,
    DW,
    DB,
    n,
    has_dro,
    has_w,
    has_dres,
    has_db,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    cast,
):
    zero = zero_of(Rstd)
    seed_key, threshold, scale = np.uint64(seed_key), np.uint64(threshold), cast_like(scale, zero)
    for c in prange(chunks):
        _bwd_chunk(
            c,
            chunks,
            m,
            DY,
            sdy,
            DRO,
            sdro,
            H,
            sh,
            W,
            Mean,
            Rstd,
            DX,
            DRes,
            DWp,
            DBp,
            n,
            has_dro,
            has_w,
            has_dres,
            has_db,
            is_rms,
            dropout,
            seed_key,
            threshold,
            scale,
            cast,
            zero,
        )
    if has_w:
        _sum_chunks(DWp, chunks, n, DW)
    if has_db:
        _sum_chunks(DBp, chunks, n, DB)


@njit(**JIT)
def bwd_serial(
    chunks,
    m,
    DY,
    sdy,
    DRO,
    sdro,
    H,
    sh,
    W,
    Mean,
    Rstd,
    DX,
    DRes,
    DWp,
    DBp,
    DW,
    DB,
    n,
    has_dro,
    has_w,
    has_dres,
    has_db,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    cast,
):
    zero = zero_of(Rstd)
    seed_key, threshold, scale = np.uint64(seed_key), np.uint64(threshold), cast_like(scale, zero)
    for c in range(chunks):
        _bwd_chunk(
            c,
            chunks,
            m,
            DY,
            sdy,
            DRO,
            sdro,
            H,
            sh,
            W,
            Mean,
            Rstd,
            DX,
            DRes,
            DWp,
            DBp,
            n,
            has_dro,
            has_w,
            has_dres,
            has_db,
            is_rms,
            dropout,
            seed_key,
            threshold,
            scale,
            cast,
            zero,
        )
    if has_w:
        _sum_chunks(DWp, chunks, n, DW)
    if has_db:
        _sum_chunks(DBp, chunks, n, DB)


@njit(parallel=True, **JIT)
def bwd_cols_parallel(
    block,
    m,
    DY,
    sdy,
    DRO,
    sdro,
    H,
    sh,
    W,
    Mean,
    Rstd,
    DX,
    DRes,
    SG,
    SGX,
    K,
    P,
    DW,
    DB,
    n,
    has_dro,
    has_w,
    has_dres,
    has_db,
    is_rms,
    dropout,
    seed_key,
    threshold,
    scale,
    cast,
):
    """Few rows (one dweight chunk): parallel over column blocks instead. The row sums come first (parallel over
    rows); then each block of columns walks every row, rows in order, so a column's dweight/dbias is summed in the
    same order as the serial one-chunk kernel: bitwise the same result."""
    zero = zero_of(Rstd)
    seed_key, threshold, scale = np.uint64(seed_key), np.uint64(threshold), cast_like(scale, zero)
    nf = cast_like(n, zero)
    # K, P: (M,) int64 and (4 * M,) float64 scratch, a rescaled row's k and (mean_s, r, mean(g), mean(g * xhat))
    for i in prange(m):
        mean = zero if is_rms else Mean[i]
        dy, h = DY[i * sdy : i * sdy + n], H[i * sh : i * sh + n]
        K[i], P[4 * i], P[4 * i + 1] = saved_row_scaling(h, n, is_rms, mean, Rstd[i])
        if K[i] == NOT_SCALED:
            SG[i], SGX[i] = _bwd_sums(dy, h, W, has_w, mean, Rstd[i], n, zero)
            if not (math.isfinite(SG[i]) and math.isfinite(SGX[i])) and finite_inputs(dy, h, W, has_w, n):
                K[i], P[4 * i], P[4 * i + 1] = 0, mean, Rstd[i]  # (as in _bwd_chunk)
        if K[i] != NOT_SCALED:
            sg, sgx = scaled_bwd_sums(dy, h, W, has_w, n, K[i], P[4 * i], P[4 * i + 1])
            P[4 * i + 2], P[4 * i + 3] = (0.0 if is_rms else sg / n), sgx / n
    for c in prange((n + block - 1) // block):
        j0 = c * block
        k = min(n, j0 + block) - j0
        w = W[j0 : j0 + k] if has_w else W
        for i in range(m):
            dy = DY[i * sdy + j0 : i * sdy + j0 + k]
            h = H[i * sh + j0 : i * sh + j0 + k]
            dro = DRO[i * sdro + j0 : i * sdro + j0 + k] if has_dro else DRO
            dres = DRes[i * n + j0 : i * n + j0 + k] if has_dres else DRes
            if K[i] != NOT_SCALED:
                dwr = DW[j0 : j0 + k] if has_w else DW
                dbr = DB[j0 : j0 + k] if has_db else DB
                q = P[4 * i : 4 * i + 4]
                dxr = DX[i * n + j0 : i * n + j0 + k]
                scaled_dx_row(
                    i * n + j0,
                    dy,
                    h,
                    dro,
                    dxr,
                    dres,
                    w,
                    k,
                    K[i],
                    q[0],
                    q[1],
                    q[2],
                    q[3],
                    has_dro,
                    has_w,
                    has_dres,
                    dropout,
                    seed_key,
                    threshold,
                    scale,
                )
                if has_w or has_db:
                    scaled_dw_row(dy, h, dwr, dbr, k, K[i], q[0], q[1], has_w, has_db, cast)
                continue
            rstd = Rstd[i]
            mean = zero if is_rms else Mean[i]
            mean_g = zero if is_rms else SG[i] / nf
            _bwd_dx_row(
                i * n + j0,
                dy,
                h,
                dro,
                DX[i * n + j0 : i * n + j0 + k],
                dres,
                w,
                k,
                mean,
                rstd,
                mean_g,
                SGX[i] / nf,
                has_dro,
                has_w,
                has_dres,
                dropout,
                seed_key,
                threshold,
                scale,
                zero,
            )
            if has_w or has_db:
                _bwd_dw_row(
                    dy,
                    h,
                    DW[j0 : j0 + k] if has_w else DW,
                    DB[j0 : j0 + k] if has_db else DB,
                    k,
                    mean,
                    rstd,
                    has_w,
                    has_db,
                    cast,
                    zero,
                )
