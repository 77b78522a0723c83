"""The backward's own finite-range guard in the Triton kernels (the cpu backend's is :mod:`addnorm.ops.cpu.guard_bwd`).

A row whose statistics are ordinary can still overflow fp32 in its backward: g = dout * w beyond fp32 (dout ~1e30,
w ~1e10), or the row sums sum(g), sum(g * xhat) beyond it (dout ~1e37 over a row), while dout, h and w are finite and
dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) is finite because rstd is small. The backward kernels do not test
for it (each test tried in their hot loops, even one store of the row sums, cost them registers, and ptxas spilled:
tools/sm90_static.py); they are unchanged. A row sum that is inf or NaN makes every column of dh inf or NaN
(g - c2 - xhat * c1 with c1 or c2 not finite; xhat = 0 gives 0 * inf = NaN), so ``bwd_fixup_kernel``, launched after
them on the same stream (no host sync), reads one value per row of what they wrote (dresidual, or dx when there is
none; dx is dropout's, so without dresidual and with dropout the whole row is read) and redoes the rows where it is
inf or NaN, tile by tile through memory:

    e     = E(max |dout|) + max(E(max |w|), 0)          (E: the binary exponent; clamped to the normal range)
    g'    = (dout * 2^-e) * w                           (exact: a power of two; |g'| < 4, the sums far from range)
    dh    = ((g' - mean(g') - xhat * mean(g' * xhat)) * rstd_s) * 2^(e + E(sc))     (the true size last)

with xhat, rstd_s and sc as the kernels have them (sc = 1 but for a row the forward's guard rescaled: row_stats).
The factor comes last, as two powers of two: dh beyond the dtype's range is inf, never NaN. A row holding an inf or
NaN in dout, h or w keeps the plain result (that inf propagates, as float64's would); a row whose dx is beyond range
in its first column is redone too (the same infs, its finite values within a rounding of the plain ones). Every
other row costs one load (FIXUP_ROWS rows a program) and keeps its bits. dweight and dbias (sums of dout * xhat and
dout, no w) need no redo.
"""

from __future__ import annotations

import functools

from addnorm.ops.contract import DROPOUT_SEED_OFFSET
from addnorm.ops.triton.elementwise import dropout, load_weight, round_to
from addnorm.ops.triton.row_stats import exponent_of, jit, pow2, saved_rstd_fail, scaled_looped_bwd_stats_inline, tl

__all__ = [
    "FIXUP_ROWS",
    "bwd_fixup_kernel",
    "dnorm",
    "fixup_meta",
    "g_xhat_tile",
    "input_scan",
    "overflowed_rows",
    "nonfinite",
    "redo_stats",
    "scaled_dout_exponent",
    "scaled_g",
    "scaled_row_sums",
    "scan_start",
    "scan_tile",
    "size_factors",
    "xhat_tile",
]


@jit
def nonfinite(v):
    """Per element: v is inf or NaN (an int32 0/1, for max-reductions)."""
    return ((v - v) != 0).to(tl.int32)


@jit
def scaled_dout_exponent(amax_dy, amax_w, HAS_WEIGHT: tl.constexpr):
    """e with dout * 2^-e below 2 (and g' = dout * 2^-e * w below 4 when |w| >= 1), within the normal range."""
    LIM: tl.constexpr = 1022 if amax_dy.dtype == tl.float64 else 126
    e = exponent_of(amax_dy)
    if HAS_WEIGHT:
        e += tl.maximum(exponent_of(amax_w), 0)
    return tl.minimum(tl.maximum(e, -LIM), LIM)


@jit
def size_factors(t, acc_t: tl.constexpr):
    """2^t as two powers of two of the same sign of exponent (t clamped to twice the normal range): a product with
    both is inf where the true product is beyond range, and underflows only where it does."""
    LIM: tl.constexpr = 1022 if acc_t == tl.float64 else 126
    t = tl.minimum(tl.maximum(t, -2 * LIM), 2 * LIM)
    half = t >> 1  # an arithmetic shift: the floor, for negative t too
    return pow2(half, acc_t), pow2(t - half, acc_t)


@jit
def bwd_fixup_kernel(
    DOut, DResOut, H, W, Mean, Rstd, DX, DRes,
    stride_dout, stride_dres_out, stride_h, M, N, Seed, keep_threshold, scale_hi, scale_mid, scale_lo,
    HAS_DRES_OUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr, SEED_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program checks at once
):  # fmt: skip
    # program: BLOCK_M rows; the arguments are bwd_rows_kernel's but the dweight partials
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bad = overflowed_rows(DRes if STORE_DRES else DX, rows, M, N, HAS_DROPOUT and not STORE_DRES, BLOCK_M)
    if tl.max(bad, axis=0) > 0:  # rare: a program without such a row ends here
        for i in range(0, BLOCK_M):
            if tl.max(tl.where(tl.arange(0, BLOCK_M) == i, bad, 0), axis=0) > 0:
                row = tl.program_id(0).to(tl.int64) * BLOCK_M + i
                _redo_row(DOut + row * stride_dout, DResOut + row * stride_dres_out, H + row * stride_h, W,
                          Mean + row, Rstd + row, DX + row * N, DRes + row * N, row * N, N, Seed, keep_threshold,
                          scale_hi, scale_mid, scale_lo, HAS_DRES_OUT, HAS_WEIGHT, IS_RMS, ZERO_CENTERED, HAS_DROPOUT,
                          STORE_DRES, SEED_OFFSET, BLOCK_N)  # fmt: skip


@jit
def overflowed_rows(D, rows, M, N, WHOLE_ROW: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per row of ``rows`` (int32 0/1): whether the gradient the backward wrote at D (contiguous rows of N) is inf or
    NaN in its first column, or anywhere in the row (WHOLE_ROW: dx after dropout, whose first column may be a
    dropped 0). A row sum that is inf or NaN makes every column of dh so (the module docstring)."""
    ok = rows < M
    if WHOLE_ROW:
        CHECK: tl.constexpr = 16
        bad = tl.zeros([BLOCK_M], dtype=tl.int32)
        for start in range(0, N, CHECK):
            cols = start + tl.arange(0, CHECK)
            mask = ok[:, None] & (cols < N)[None, :]
            v = tl.load(D + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
            bad = tl.maximum(bad, tl.max(_inf_or_nan(v), axis=1))
    else:
        bad = _inf_or_nan(tl.load(D + rows.to(tl.int64) * N, mask=ok, other=0.0))
    return bad


@jit
def _inf_or_nan(v):
    """nonfinite of a stored gradient: fp64 as it is (a value beyond fp32's range is finite), 16-bit types in fp32
    (exact; the interpreter compares bf16 wrongly)."""
    if v.dtype == tl.float64:
        return nonfinite(v)
    else:
        return nonfinite(v.to(tl.float32))


@jit
def _redo_row(
    DOut, DResOut, H, W, MeanRow, RstdRow, DX, DRes, base, N, Seed, keep_threshold, scale_hi, scale_mid, scale_lo,
    HAS_DRES_OUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr, SEED_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The module docstring's pass over one row, tile by tile (pointers at the row; base: dx's element index of its
    first column, the dropout mask's)."""
    acc_t: tl.constexpr = RstdRow.dtype.element_ty
    mean, rstd, sc = redo_stats(H, MeanRow, RstdRow, N, IS_RMS, BLOCK_N)
    bad, amax, wmax = input_scan(DOut, H, W, N, acc_t, HAS_WEIGHT, ZERO_CENTERED, BLOCK_N)
    if tl.max(bad, axis=0) == 0:  # else an inf or NaN of the inputs: the plain result stands
        e = scaled_dout_exponent(tl.max(amax, axis=0), tl.max(wmax, axis=0), HAS_WEIGHT)
        down = pow2(-e, acc_t)
        c1, c2 = scaled_row_sums(DOut, H, W, N, down, mean, rstd, sc, acc_t, HAS_WEIGHT, ZERO_CENTERED, BLOCK_N)
        up1, up2 = size_factors(e + exponent_of(sc), acc_t)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            g, xhat = g_xhat_tile(DOut, H, W, cols, ok, down, mean, rstd, sc, acc_t, HAS_WEIGHT, ZERO_CENTERED)
            dh = dnorm(g, xhat, c1, c2, rstd, up1, up2, IS_RMS)
            if HAS_DRES_OUT:
                dh += tl.load(DResOut + cols, mask=ok, other=0.0).to(acc_t)
            if STORE_DRES:
                tl.store(DRes + cols, round_to(dh, DRes.dtype.element_ty), mask=ok)
            if HAS_DROPOUT:
                dh = dropout(dh, base + cols, Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET)
            tl.store(DX + cols, round_to(dh, DX.dtype.element_ty), mask=ok)


# The pieces of a row's redo, shared with norm_add_guard (whose N2 pass is this one's, with dout2, h and w2, and whose
# N1 pass runs them on a recomputed gradient). Triton inlines them: the kernels compile as if written out.


@jit
def redo_stats(X, MeanRow, RstdRow, N, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(mean_s, rstd_s, sc) of a row from its saved statistics: sc = 1 but for a row the forward's guard rescaled
    (row_stats), whose statistics are recomputed from X."""
    rstd = tl.load(RstdRow)
    mean = rstd * 0.0
    if not IS_RMS:
        mean = tl.load(MeanRow)
    sc = rstd * 0.0 + 1.0
    if saved_rstd_fail(rstd):
        sc, mean, rstd = scaled_looped_bwd_stats_inline(X, N, rstd, IS_RMS, BLOCK_N)
    return mean, rstd, sc


@jit
def scan_start(acc_t: tl.constexpr, BLOCK_N: tl.constexpr):
    """scan_tile's amax, wmax and bad before the first tile. In this order: a loop carries its values in the order
    their names were first bound, and another order compiles to other registers (ptxas: one more, or one fewer)."""
    return tl.zeros([BLOCK_N], dtype=acc_t), tl.zeros([BLOCK_N], dtype=acc_t), tl.zeros([BLOCK_N], dtype=tl.int32)


@jit
def scan_tile(d, x, W, cols, ok, bad, amax, wmax, acc_t: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZC: tl.constexpr):
    """One tile of the input scan, elementwise: (bad, amax, wmax) updated with the tile's d (the incoming gradient),
    x and w: bad > 0 where one is inf or NaN, amax = max |d|, wmax = max |w|."""
    bad = tl.maximum(bad, tl.maximum(nonfinite(d), nonfinite(x)))
    amax = tl.maximum(amax, tl.abs(d))
    if HAS_WEIGHT:
        w = load_weight(W, cols, ok, acc_t, ZC)
        bad = tl.maximum(bad, nonfinite(w))
        wmax = tl.maximum(wmax, tl.abs(w))
    return bad, amax, wmax


@jit
def input_scan(D, X, W, N, acc_t: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZC: tl.constexpr, BLOCK_N: tl.constexpr):
    """scan_tile over a row of D and X (pointers at the row): (bad, amax, wmax), still per column (the callers
    reduce them where they need them)."""
    amax, wmax, bad = scan_start(acc_t, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        d = tl.load(D + cols, mask=ok, other=0.0).to(acc_t)
        x = tl.load(X + cols, mask=ok, other=0.0).to(acc_t)
        bad, amax, wmax = scan_tile(d, x, W, cols, ok, bad, amax, wmax, acc_t, HAS_WEIGHT, ZC)
    return bad, amax, wmax


@jit
def scaled_g(d, down, W, cols, ok, acc_t: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZC: tl.constexpr):
    """g' = (d * 2^-e) * w over a tile (down = 2^-e)."""
    g = d * down
    if HAS_WEIGHT:
        g = g * load_weight(W, cols, ok, acc_t, ZC)
    return g


@jit
def xhat_tile(X, cols, ok, mean, rstd, sc, acc_t: tl.constexpr):
    """xhat = (x * sc - mean_s) * rstd_s over a tile, 0 past the row's end."""
    x = tl.load(X + cols, mask=ok, other=0.0).to(acc_t) * sc
    return tl.where(ok, (x - mean) * rstd, 0.0)


@jit
def g_xhat_tile(D, X, W, cols, ok, down, mean, rstd, sc, acc_t: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                ZC: tl.constexpr):  # fmt: skip
    """(g', xhat) over a tile, g' from the gradient at D."""
    g = scaled_g(tl.load(D + cols, mask=ok, other=0.0).to(acc_t), down, W, cols, ok, acc_t, HAS_WEIGHT, ZC)
    return g, xhat_tile(X, cols, ok, mean, rstd, sc, acc_t)


@jit
def scaled_row_sums(D, X, W, N, down, mean, rstd, sc, acc_t: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    ZC: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(c1, c2) = (mean(g' * xhat), mean(g')) over a row (pointers at the row)."""
    s1 = tl.zeros([BLOCK_N], dtype=acc_t)
    s2 = tl.zeros([BLOCK_N], dtype=acc_t)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        g, xhat = g_xhat_tile(D, X, W, cols, ok, down, mean, rstd, sc, acc_t, HAS_WEIGHT, ZC)
        s1 += g * xhat
        s2 += g
    return tl.sum(s1, axis=0) / N, tl.sum(s2, axis=0) / N


@jit
def dnorm(g, xhat, c1, c2, rstd, up1, up2, IS_RMS: tl.constexpr):
    """The norm's gradient over a tile from g' and the row's c1, c2; the factors 2^(e + E(sc)) last."""
    if IS_RMS:
        d = (g - xhat * c1) * rstd
    else:
        d = (g - c2 - xhat * c1) * rstd
    return d * up1 * up2  # the true size last


@functools.lru_cache(maxsize=256)  # one dict object per flag set: fast_launch keys its bound launches on it
def fixup_meta(n, has_dres_out, has_weight, is_rms, zc, has_dropout, store_dres, fp_fusion) -> dict:
    """bwd_fixup_kernel's constexprs and options: tiles of up to 1024 columns, 4 warps (it redoes rare rows only),
    FIXUP_ROWS rows a program (grid: ceil(M / FIXUP_ROWS))."""
    block_n = min(1024, max(16, 1 << max(0, (n - 1).bit_length())))
    return dict(
        HAS_DRES_OUT=has_dres_out, HAS_WEIGHT=has_weight, IS_RMS=is_rms, ZERO_CENTERED=zc, HAS_DROPOUT=has_dropout,
        STORE_DRES=store_dres, SEED_OFFSET=DROPOUT_SEED_OFFSET, BLOCK_N=block_n,
        BLOCK_M=FIXUP_ROWS, num_warps=4, enable_fp_fusion=fp_fusion,
    )  # fmt: skip


# rows a fix-up program checks with one vector load: an ordinary backward of M rows costs ceil(M / 256) programs
# that each load 256 values and end, not M programs
FIXUP_ROWS = 256
