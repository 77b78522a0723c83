"""The Triton kernels of the ``triton`` backend (:mod:`addnorm.ops.triton.launch` launches them, with the block
sizes of :mod:`addnorm.ops.triton.plan`).

The math, per row h of length N (statistics in ``acc``: fp32, or fp64 when x or the residual stream is fp64):

    forward   r    = keep * x * scale + residual          # keep(seed, i * N + j), scale ~ 1/(1-p): the contract's
                                                          # keep-function and scale (addnorm.ops.contract), not stored
              h    = round(r, residual_dtype)             # stored as residual_out; normalized exactly as stored
              LayerNorm: mean = sum(h) / N,  var = sum((h - mean)^2) / N   (two passes over registers, or
                         Welford-Chan merging of per-tile (mean, M2) when the row is looped: no E[h^2] - E[h]^2)
              RMSNorm:   mean = 0,           var = sum(h^2) / N
              rstd = 1 / sqrt(var + eps);  xhat = (h - mean) * rstd;  out = xhat * w + b   (w -> 1 + w: Gemma)
              (CAST_BEFORE_WEIGHT, Llama's order: xhat is rounded to out's dtype before the weight and bias)
              out is written in its own dtype (x's by default)

    backward  g  = dout * w
              dh = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))   (RMSNorm: without the mean_j(g) term)
              dresidual = dh + dresidual_out;   dx = dresidual * keep * scale
              dw = sum_i dout * xhat,  db = sum_i dout                (two-stage: fp32 partial rows, then a sum)
              (CAST_BEFORE_WEIGHT: dw sums dout * round(xhat); the rounding's gradient is the identity)

Rows whose backward overflows fp32 although their statistics are ordinary (g = dout * w, or a row sum, beyond it)
are redone after the backward kernels by :mod:`addnorm.ops.triton.guard_bwd` (the kernels here do not change).

Rows whose plain statistics leave the accumulation type's range (sum(h^2) overflowing, or underflowing where eps
does not dominate) are redone with h scaled by a power of two: the guard and the scaled pass are
:mod:`addnorm.ops.triton.row_stats`, whose docstring also says what the saved mean and rstd hold for such rows.

No atomics anywhere, so gradients are bitwise reproducible. Inputs may have strided rows (last-dim stride 1).
"""

from __future__ import annotations

from addnorm.ops.triton.elementwise import (  # re-exported: team_kernels and quant import them from here
    affine,
    dropout,
    dweight_term,
    jit,
    load_weight,
    round_to,
    tl,
    triton,
)
from addnorm.ops.triton.row_stats import (
    merge_init,
    merge_result,
    merge_tile,
    normalize_row,
    plain_stats_fail,
    redo_row,
    rsqrt,
    saved_rstd_fail,
    scaled_looped_bwd_stats,
    scaled_looped_stats,
    scaled_rows_bwd,
)

__all__ = ["affine", "dropout", "dweight_term", "jit", "load_weight", "round_to", "rsqrt", "tl", "triton"]

# --------------------------------------------------------------------------------------------------------------
# Forward kernels
# --------------------------------------------------------------------------------------------------------------


@jit
def fwd_rows_kernel(
    X,  # (M, N) input, row stride stride_x
    R,  # (M, N) residual (when HAS_RESIDUAL)
    W,  # (N,) weight (when HAS_WEIGHT)
    B,  # (N,) bias (when HAS_BIAS)
    Out,  # (M, N) normalized output, x's dtype, contiguous
    ResOut,  # (M, N) residual_out in residual_dtype, contiguous (when STORE_RESIDUAL_OUT)
    Mean,  # (M,) stats dtype (LayerNorm, when STORE_STATS)
    Rstd,  # (M,) stats dtype (when STORE_STATS; else any tensor): its element type is the kernel's accumulation type
    stride_x,
    stride_r,
    M,
    N,
    eps_hi,  # eps arrives as an fp32 pair (hi + lo) so fp64 statistics keep full precision
    eps_lo,
    Seed,  # () int64 dropout seed on the device (when HAS_DROPOUT): read here, so CUDA graphs replay fresh draws
    keep_threshold,
    scale_hi,  # the dropout scale as three fp32 parts: their fp64 sum is the fp64 scale exactly
    scale_mid,
    scale_lo,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    SEED_OFFSET: tl.constexpr,  # addnorm.ops.contract.DROPOUT_SEED_OFFSET (the plans pass it)
    STORE_STATS: tl.constexpr,  # off under inference: no (M,) statistics to allocate per call
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Rstd.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]  # int64: M * N may exceed 2^31
    h = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(acc_t)
    if HAS_DROPOUT:
        h = dropout(h, rows64 * N + cols[None, :], Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET)
    if HAS_RESIDUAL:
        h += tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(acc_t)
    if STORE_RESIDUAL_OUT:
        stored = round_to(h, ResOut.dtype.element_ty)
        tl.store(ResOut + rows64 * N + cols[None, :], stored, mask=mask)
        h = stored.to(acc_t)  # normalize the sum exactly as stored
    eps = tl.cast(eps_hi, acc_t) + tl.cast(eps_lo, acc_t)
    if IS_RMS:
        d = h
        mean = tl.zeros([BLOCK_M], dtype=acc_t)
    else:
        mean = tl.sum(h, axis=1) / N
        d = tl.where(mask, h - mean[:, None], 0.0)  # second pass over registers: no cancellation
    v = tl.sum(d * d, axis=1) / N + eps
    rstd = rsqrt(v)
    if STORE_STATS:
        if not IS_RMS:
            tl.store(Mean + rows, mean, mask=row_ok)
        tl.store(Rstd + rows, rstd, mask=row_ok)
    bad = plain_stats_fail(v) & row_ok
    out_ok = mask
    if not STORE_RESIDUAL_OUT:  # out may be x (in place): leave the rows to redo unwritten, x still holds them
        out_ok = mask & (bad.to(tl.int32) == 0)[:, None]
    y = affine(d * rstd[:, None], W, B, cols, cols < N, acc_t, Out.dtype.element_ty, HAS_WEIGHT, HAS_BIAS,
               ZERO_CENTERED, CAST_BEFORE_WEIGHT)  # fmt: skip
    tl.store(Out + rows64 * N + cols[None, :], round_to(y, Out.dtype.element_ty), mask=out_ok)
    # rows beyond the plain statistics' range (row_stats): redone one by one through memory in small tiles, last,
    # where nothing of the plain path is live, so that they add no registers to it (rare)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.debug_barrier()  # residual_out, out and the statistics were written by other threads of this program
        TILE: tl.constexpr = BLOCK_N if BLOCK_N < 512 else 512
        for i in range(BLOCK_M):
            if tl.max(tl.where(tl.arange(0, BLOCK_M) == i, bad.to(tl.int32), 0), axis=0) > 0:
                row = tl.program_id(0).to(tl.int64) * BLOCK_M + i
                src = ResOut + row * N if STORE_RESIDUAL_OUT else X + row * stride_x
                redo_row(src, Out + row * N, W, B, Mean + row, Rstd + row, N, eps, acc_t, IS_RMS, STORE_STATS,
                         HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, CAST_BEFORE_WEIGHT, TILE)  # fmt: skip


@jit
def fwd_looped_kernel(
    X,  # (M, N) input, row stride stride_x
    R,  # (M, N) residual (when HAS_RESIDUAL)
    W,  # (N,) weight
    B,  # (N,) bias
    Out,  # (M, N) output, contiguous
    ResOut,  # (M, N) residual_out, contiguous (when STORE_RESIDUAL_OUT)
    Mean,  # (M,) (LayerNorm, when STORE_STATS)
    Rstd,  # (M,) (when STORE_STATS; else any tensor): its element type is the kernel's accumulation type
    stride_x,
    stride_r,
    M,
    N,
    eps_hi,
    eps_lo,
    Seed,  # () int64 dropout seed on the device (when HAS_DROPOUT): read here, so CUDA graphs replay fresh draws
    keep_threshold,
    scale_hi,  # the dropout scale as three fp32 parts: their fp64 sum is the fp64 scale exactly
    scale_mid,
    scale_lo,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    SEED_OFFSET: tl.constexpr,  # addnorm.ops.contract.DROPOUT_SEED_OFFSET (the plans pass it)
    STORE_STATS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Rstd.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    r_row = R + row * stride_r
    res_row = ResOut + row * N
    # pass 1: residual_out, and statistics merged tile by tile (Chan et al.: exact two-pass stats per tile)
    mean, m2, count, sumsq = merge_init(acc_t, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        # what pass 2 reads again (residual_out, or x when nothing is stored) is marked to stay in L2; what it does
        # not need is not: a row of up to N * 4 bytes x 2 is then re-read from L2, not DRAM
        if STORE_RESIDUAL_OUT:
            h = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(acc_t)
        else:
            h = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(acc_t)
        if HAS_DROPOUT:
            h = dropout(h, row * N + cols, Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET)
        if HAS_RESIDUAL:
            h += tl.load(r_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(acc_t)
        if STORE_RESIDUAL_OUT:
            stored = round_to(h, ResOut.dtype.element_ty)
            tl.store(res_row + cols, stored, mask=ok, eviction_policy="evict_last")
            h = stored.to(acc_t)
        mean, m2, count, sumsq = merge_tile(h, ok, start, N, mean, m2, count, sumsq, IS_RMS, BLOCK_N)
    eps = tl.cast(eps_hi, acc_t) + tl.cast(eps_lo, acc_t)
    mean_s, var = merge_result(mean, m2, sumsq, N, IS_RMS)
    v = var + eps
    rstd = rsqrt(v)
    sc = tl.full([], 1.0, acc_t)
    mean_saved = mean_s
    rstd_saved = rstd
    # residual_out was written by other threads of this program; make it visible before reading it back
    tl.debug_barrier()
    if plain_stats_fail(v):  # beyond the plain statistics' range (row_stats): a scaled pass, rare
        sc, mean_s, rstd, mean_saved, rstd_saved = scaled_looped_stats(
            res_row if STORE_RESIDUAL_OUT else x_row, N, eps, IS_RMS, BLOCK_N
        )
    if STORE_STATS:
        if not IS_RMS:
            tl.store(Mean + row, mean_saved)
        tl.store(Rstd + row, rstd_saved)
    # pass 2: normalize
    normalize_row(res_row if STORE_RESIDUAL_OUT else x_row, Out + row * N, W, B, N, sc, mean_s, rstd, acc_t,
                  HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, CAST_BEFORE_WEIGHT, BLOCK_N)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Backward kernels: dx and dresidual in one kernel; dw/db as fp32 partial rows reduced by a second stage
# --------------------------------------------------------------------------------------------------------------


@jit
def bwd_rows_kernel(
    DOut,  # (M, N) gradient of out, row stride stride_dout
    DResOut,  # (M, N) gradient of residual_out (when HAS_DRES_OUT)
    H,  # (M, N) residual_out as stored (or x), row stride stride_h
    W,  # (N,) weight (when HAS_WEIGHT)
    Mean,  # (M,) (LayerNorm)
    Rstd,  # (M,); its element type is the accumulation type
    DX,  # (M, N) gradient of x, contiguous
    DRes,  # (M, N) gradient of residual, contiguous (when STORE_DRES)
    DWPart,  # (programs, N) partial sums of dout * xhat, accumulation dtype
    DBPart,  # (programs, N) partial sums of dout
    stride_dout,
    stride_dres_out,
    stride_h,
    M,
    N,
    Seed,  # () int64 dropout seed on the device (when HAS_DROPOUT): read here, so CUDA graphs replay fresh draws
    keep_threshold,
    scale_hi,  # the dropout scale as three fp32 parts: their fp64 sum is the fp64 scale exactly
    scale_mid,
    scale_lo,
    HAS_DRES_OUT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DB: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_DRES: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    SEED_OFFSET: tl.constexpr,  # addnorm.ops.contract.DROPOUT_SEED_OFFSET (the plans pass it)
    RELOAD_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Rstd.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT and not RELOAD_W:
        w = load_weight(W, cols, col_ok, acc_t, ZERO_CENTERED)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_t)
    # persistent: this program takes row blocks pid, pid + programs, ... in a fixed order (deterministic)
    for row_start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        h = tl.load(H + rows64 * stride_h + cols[None, :], mask=mask, other=0.0).to(acc_t)
        dy = tl.load(DOut + rows64 * stride_dout + cols[None, :], mask=mask, other=0.0).to(acc_t)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=1.0)
        if IS_RMS:
            mean = rstd * 0.0
        else:
            mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        bad = saved_rstd_fail(rstd) & row_ok
        rescale = tl.max(bad.to(tl.int32), axis=0) > 0
        sc = tl.full([BLOCK_M, 1], 1.0, acc_t)
        if rescale:  # a row the forward normalized with the scaled pass (row_stats): rare
            xhat, rstd, sc_m = scaled_rows_bwd(h, mask, N, mean, rstd, bad, IS_RMS)
            sc = sc_m[:, None]
        elif IS_RMS:
            xhat = h * rstd[:, None]
        else:
            xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        rstd = rstd[:, None]
        if HAS_WEIGHT:
            if RELOAD_W:  # fewer live registers in wide rows (see Tuning.reload_weight_above)
                w = load_weight(W, cols, col_ok, acc_t, ZERO_CENTERED)
            g = dy * w[None, :]
            dw_acc += dweight_term(dy, xhat, CAST_BEFORE_WEIGHT, DOut.dtype.element_ty)  # dout is in out's dtype
        else:
            g = dy
        if HAS_DB:
            db_acc += dy
        c1 = tl.sum(g * xhat, axis=1)[:, None] / N
        if IS_RMS:
            dh = (g - xhat * c1) * rstd
        else:
            c2 = tl.sum(g, axis=1)[:, None] / N
            dh = (g - c2 - xhat * c1) * rstd
        if rescale:
            dh = dh * sc  # the true size last: inf only where dh is beyond range, never inf * 0
        # this tail repeats in bwd_tiles_kernel on purpose: as a shared helper taking precomputed offsets it cost
        # sm_90 up to 18 registers a thread (half the programs per SM for LayerNorm at N = 1024, 2048)
        if HAS_DRES_OUT:
            dh += tl.load(DResOut + rows64 * stride_dres_out + cols[None, :], mask=mask, other=0.0).to(acc_t)
        if STORE_DRES:
            tl.store(DRes + rows64 * N + cols[None, :], round_to(dh, DRes.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            dh = dropout(
                dh, rows64 * N + cols[None, :], Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET
            )
        tl.store(DX + rows64 * N + cols[None, :], round_to(dh, DX.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(DWPart + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if HAS_DB:
        tl.store(DBPart + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


@jit
def bwd_row_sums_kernel(
    DOut,  # (M, N) gradient of out
    H,  # (M, N) residual_out as stored (or x)
    W,  # (N,) weight (when HAS_WEIGHT)
    Mean,  # (M,) (LayerNorm)
    Rstd,  # (M,)
    C1,  # (M,) out: mean_j(g * xhat)
    C2,  # (M,) out: mean_j(g) (LayerNorm)
    Eff,  # (3, stride_eff) out: the (mean, rstd, sc) bwd_tiles_kernel normalizes with (sc = 1 but for scaled rows)
    stride_dout,
    stride_h,
    stride_eff,
    N,
    HAS_WEIGHT: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Rstd.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(Rstd + row)
    if IS_RMS:
        mean = tl.zeros_like(rstd)
    else:
        mean = tl.load(Mean + row)
    sc = tl.full([], 1.0, acc_t)
    if saved_rstd_fail(rstd):  # a row the forward normalized with the scaled pass (row_stats): rare
        TILE: tl.constexpr = BLOCK_N if BLOCK_N < 512 else 512  # small tiles: few registers for the rare path
        sc, mean, rstd = scaled_looped_bwd_stats(H + row * stride_h, N, rstd, IS_RMS, TILE)
    tl.store(Eff + row, mean)
    tl.store(Eff + stride_eff + row, rstd)
    tl.store(Eff + 2 * stride_eff + row, sc)
    s1 = tl.zeros([BLOCK_N], dtype=acc_t)
    s2 = tl.zeros([BLOCK_N], dtype=acc_t)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        h = tl.load(H + row * stride_h + cols, mask=ok, other=0.0).to(acc_t)
        g = tl.load(DOut + row * stride_dout + cols, mask=ok, other=0.0).to(acc_t)
        if HAS_WEIGHT:
            g = g * load_weight(W, cols, ok, acc_t, ZERO_CENTERED)  # 1 + 0 outside the row, but g is 0 there
        h = h * sc
        if IS_RMS:
            xhat = h * rstd
        else:
            xhat = tl.where(ok, (h - mean) * rstd, 0.0)
            s2 += g
        s1 += g * xhat
    tl.store(C1 + row, tl.sum(s1, axis=0) / N)
    if not IS_RMS:
        tl.store(C2 + row, tl.sum(s2, axis=0) / N)


@jit
def bwd_tiles_kernel(
    DOut,  # (M, N) gradient of out
    DResOut,  # (M, N) gradient of residual_out (when HAS_DRES_OUT)
    H,  # (M, N) residual_out as stored (or x)
    W,  # (N,) weight
    Mean,  # (M,) the mean, rstd and sc to normalize with, from bwd_row_sums_kernel (its Eff)
    Rstd,  # (M,)
    C1,  # (M,) mean_j(g * xhat) from bwd_row_sums_kernel
    C2,  # (M,) mean_j(g)
    Sc,  # (M,) the power of two h is scaled by (1 but for rows beyond the plain statistics' range: row_stats)
    DX,  # (M, N) contiguous
    DRes,  # (M, N) contiguous (when STORE_DRES)
    DWPart,  # (row groups, N)
    DBPart,  # (row groups, N)
    stride_dout,
    stride_dres_out,
    stride_h,
    M,
    N,
    Seed,  # () int64 dropout seed on the device (when HAS_DROPOUT): read here, so CUDA graphs replay fresh draws
    keep_threshold,
    scale_hi,  # the dropout scale as three fp32 parts: their fp64 sum is the fp64 scale exactly
    scale_mid,
    scale_lo,
    HAS_DRES_OUT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DB: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_DRES: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    SEED_OFFSET: tl.constexpr,  # addnorm.ops.contract.DROPOUT_SEED_OFFSET (the plans pass it)
    BLOCK_N: tl.constexpr,
):
    # program (tile, group): columns of one tile, rows group, group + groups, ...; dw/db stay in registers
    acc_t = Rstd.dtype.element_ty
    group = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    if HAS_WEIGHT:
        w = load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
    dw_acc = tl.zeros([BLOCK_N], dtype=acc_t)
    db_acc = tl.zeros([BLOCK_N], dtype=acc_t)
    for r in range(group, M, tl.num_programs(1)):
        row = tl.cast(r, tl.int64)
        h = tl.load(H + row * stride_h + cols, mask=ok, other=0.0).to(acc_t)
        dy = tl.load(DOut + row * stride_dout + cols, mask=ok, other=0.0).to(acc_t)
        rstd = tl.load(Rstd + row)
        c1 = tl.load(C1 + row)
        sc = tl.load(Sc + row)
        if sc != 1.0:
            h = h * sc
        if IS_RMS:
            xhat = h * rstd
        else:
            xhat = tl.where(ok, (h - tl.load(Mean + row)) * rstd, 0.0)
        if HAS_WEIGHT:
            g = dy * w
            dw_acc += dweight_term(dy, xhat, CAST_BEFORE_WEIGHT, DOut.dtype.element_ty)
        else:
            g = dy
        if HAS_DB:
            db_acc += dy
        if IS_RMS:
            dh = (g - xhat * c1) * rstd
        else:
            dh = (g - tl.load(C2 + row) - xhat * c1) * rstd
        if sc != 1.0:
            dh = dh * sc  # the true size last (row_stats)
        if HAS_DRES_OUT:
            dh += tl.load(DResOut + row * stride_dres_out + cols, mask=ok, other=0.0).to(acc_t)
        if STORE_DRES:
            tl.store(DRes + row * N + cols, round_to(dh, DRes.dtype.element_ty), mask=ok)
        if HAS_DROPOUT:
            dh = dropout(dh, row * N + cols, Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET)
        tl.store(DX + row * N + cols, round_to(dh, DX.dtype.element_ty), mask=ok)
    if HAS_WEIGHT:
        tl.store(DWPart + group * N + cols, dw_acc, mask=ok)
    if HAS_DB:
        tl.store(DBPart + group * N + cols, db_acc, mask=ok)
