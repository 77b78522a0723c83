"""CPU backend: fused residual add + LayerNorm/RMSNorm in numba, parallel over rows.

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

A row is at most a few hundred KB, so it stays in L1/L2 while it is read several times: the forward streams x
and residual in once, writes residual_out, then reads that row back from cache for the statistics (two passes,
mean then squared deviations: no E[h^2] - E[h]^2 cancellation) and for the output. Everything in between lives in
registers; DRAM sees each input read once and each output written once, which is the whole game on a CPU.

Half types never exist as numpy/numba floats here: bf16 travels as uint16 bits and fp16 as int16 bits, converted
in registers (bf16 by bit operations with round-to-nearest-even, fp16 by LLVM's half type, F16C on x86).

dweight and dbias are reduced in a fixed number of row chunks that depends only on M (never on the thread
count): each chunk sums its rows in order, then the chunk partials are summed in order. The result is bitwise
identical whatever the number of threads, and run to run.

Dropout keeps element (i, j) by the contract's keep-function of (seed, i * N + j) and scales kept elements by
the contract's scale (:func:`addnorm.reference.dropout_keep_mask`, :func:`~addnorm.reference.dropout_scale`), so
the backward regenerates the mask and every backend agrees bit for bit.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np
import torch

from addnorm import reference as _ref
from addnorm.ops.contract import stats_dtype

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic, overload

    _IMPORT_ERROR: str | None = None
except ImportError as _e:  # the module must still import so that unavailable_reason can say why
    numba = ir = types = None
    _IMPORT_ERROR = f"numba is not installed ({_e}); `pip install numba`"

    def njit(*args, **kwargs):
        return (lambda f: f) if not args or not callable(args[0]) else args[0]

    def intrinsic(f):
        return f

    def overload(f, **kwargs):
        return lambda impl: impl

    prange = range

__all__ = ["unavailable_reason", "forward", "backward", "forward_into"]

# Flags for the row reductions only: reassociation lets LLVM keep 8 partial sums in a vector register (faster, and
# no less accurate than one sequential sum). Elementwise code stays IEEE-exact so residual_out is bit-identical to
# the reference. No nnan/ninf: NaN and inf must propagate.
_FAST = {"reassoc", "contract"}
# error_model="numpy": a float division by zero is IEEE (inf/nan), as in torch. numba's default ("python") raises
# ZeroDivisionError, which a constant row with eps=0 (rstd = 1/sqrt(0)) hit in the middle of a kernel.
_JIT = dict(cache=True, nogil=True, error_model="numpy")

# --------------------------------------------------------------------------------------------------------------
# Register-level dtype conversions
# --------------------------------------------------------------------------------------------------------------


@intrinsic
def _bf16_to_f32(typingctx, bits):
    """bf16 bits (uint16) -> float32: a bf16 is the high half of a float32."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_bf16(typingctx, value):
    """float32 -> bf16 bits, round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0 (as torch does)."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.lshr(builder.add(u, builder.add(lsb, ir.Constant(i32, 0x7FFF))), ir.Constant(i32, 16))
        isnan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.trunc(builder.select(isnan, ir.Constant(i32, 0x7FC0), rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _f16_to_f32(typingctx, bits):
    """fp16 bits (int16) -> float32, exact."""
    if bits != types.int16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_f16(typingctx, value):
    """float32 -> fp16 bits, round to nearest even (overflow to inf)."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


def _load(a, j):
    """a[j] as a float (float32 for bf16/fp16/fp32 storage, float64 for fp64); numba-only."""
    raise NotImplementedError


def _store(a, j, v):
    """a[j] = v rounded to a's storage type; numba-only."""
    raise NotImplementedError


def _cast(v, like):
    """v converted to the float type of ``like`` (the statistics dtype); numba-only."""
    raise NotImplementedError


@overload(_load, inline="always")
def _load_impl(a, j):
    if a.dtype == types.uint16:
        return lambda a, j: _bf16_to_f32(a[j])
    if a.dtype == types.int16:
        return lambda a, j: _f16_to_f32(a[j])
    return lambda a, j: a[j]


@overload(_store, inline="always")
def _store_impl(a, j, v):
    if a.dtype == types.uint16:

        def store_bf16(a, j, v):
            a[j] = _f32_to_bf16(np.float32(v))  # fp64 goes through fp32 first, as torch's cast does

        return store_bf16
    if a.dtype == types.int16:

        def store_f16(a, j, v):
            a[j] = _f32_to_f16(np.float32(v))

        return store_f16

    def store_float(a, j, v):
        a[j] = v

    return store_float


def _round_as(a, v):
    """v rounded to the storage type of array ``a`` and back to v's float type; numba-only."""
    raise NotImplementedError


@overload(_round_as, inline="always")
def _round_as_impl(a, v):
    if a.dtype == types.uint16:
        return lambda a, v: _cast(_bf16_to_f32(_f32_to_bf16(np.float32(v))), v)
    if a.dtype == types.int16:
        return lambda a, v: _cast(_f16_to_f32(_f32_to_f16(np.float32(v))), v)
    if a.dtype == types.float32:
        return lambda a, v: _cast(np.float32(v), v)
    return lambda a, v: v


@overload(_cast, inline="always")
def _cast_impl(v, like):
    if like == types.float64:
        return lambda v, like: np.float64(v)
    return lambda v, like: np.float32(v)


def _zero_of(a):
    """0 in the float type of array ``a``'s elements (the statistics dtype); numba-only."""
    raise NotImplementedError


@overload(_zero_of, inline="always")
def _zero_of_impl(a):
    if a.dtype == types.float64:
        return lambda a: np.float64(0.0)
    return lambda a: np.float32(0.0)


# --------------------------------------------------------------------------------------------------------------
# Dropout: the contract's keep-function (addnorm.reference), in uint64 arithmetic masked to 32 bits
# --------------------------------------------------------------------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)
_MIX_M1 = np.uint64(_ref.MIX_M1)
_MIX_M2 = np.uint64(_ref.MIX_M2)


@njit(inline="always", **_JIT)
def _mix32(z):
    z = z ^ (z >> np.uint64(16))
    z = (z * _MIX_M1) & _M32
    z = z ^ (z >> np.uint64(15))
    z = (z * _MIX_M2) & _M32
    return z ^ (z >> np.uint64(16))


@njit(inline="always", **_JIT)
def _keep(idx, seed_key, threshold):
    """True iff element ``idx`` (= i * N + j) survives: the hash's top 24 bits are >= threshold."""
    k = np.uint64(idx)
    z = _mix32((k & _M32) ^ _mix32((k >> np.uint64(32)) ^ seed_key))
    return (z >> np.uint64(8)) >= threshold


def _dropout_args(seed, p: float, sd: torch.dtype) -> tuple[int, int, float]:
    """(the seed's key mix32(seed + offset), keep threshold, scale) as plain Python numbers."""
    seed_key = _ref.mix32((int(seed) + _ref.DROPOUT_SEED_OFFSET) & 0xFFFFFFFF)
    return seed_key, _ref.dropout_threshold(p), _ref.dropout_scale(p, sd)


# --------------------------------------------------------------------------------------------------------------
# Kernels. Arrays are flat 1-D views; row i of X starts at i * sx (row strides allow strided rows without a copy).
# Capitalised names are arrays, as in Triton's pointer arguments.
# --------------------------------------------------------------------------------------------------------------


@njit(fastmath=_FAST, **_JIT)
def _sum(h, n, zero):
    s = zero
    for j in range(n):
        s += _cast(_load(h, j), zero)
    return s


@njit(fastmath=_FAST, **_JIT)
def _sum_sq_dev(h, n, mean, zero):
    s = zero
    for j in range(n):
        d = _cast(_load(h, j), zero) - mean
        s += d * d
    return s


@njit(**_JIT)
def _residual_row(x, r, h, i, n, has_res, dropout, seed_key, threshold, scale, zero):
    """h = dropout(x) + r for row i, rounded to h's storage type."""
    for j in range(n):
        v = _cast(_load(x, j), zero)
        if dropout:
            v = v * scale if _keep(i * n + j, seed_key, threshold) else zero
        if has_res:
            v = v + _cast(_load(r, j), zero)
        _store(h, j, v)


@njit(**_JIT)
def _normalize_row(h, out, W, B, n, mean, rstd, has_w, has_b, cast, zero):
    for j in range(n):
        y = (_cast(_load(h, j), zero) - mean) * rstd
        if cast:
            y = _round_as(out, y)
        if has_w:
            y = y * W[j]
        if has_b:
            y = y + B[j]
        _store(out, j, y)


@njit(**_JIT)
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
        _residual_row(
            X[i * sx : i * sx + n], R[i * sr : i * sr + n], h, i, n, has_res, dropout, seed_key, threshold, scale, zero
        )
    nf = _cast(n, zero)
    if is_rms:
        mean = zero
        rstd = 1 / np.sqrt(_sum_sq_dev(h, n, zero, zero) / nf + eps)
    else:
        mean = _sum(h, n, zero) / nf
        rstd = 1 / np.sqrt(_sum_sq_dev(h, n, mean, zero) / nf + eps)
        Mean[i] = mean
    rstd = _cast(rstd, zero)
    Rstd[i] = rstd
    _normalize_row(h, Out[i * n : i * n + n], W, B, n, mean, rstd, has_w, has_b, cast, zero)


# Two drivers over the same row function: prange for large inputs, a plain loop for small ones, where the ~10-60
# microseconds of waking a thread pool would dominate. Two functions, not one compiled twice: numba's cache keys
# entries by function, not by the parallel flag.
@njit(parallel=True, **_JIT)
def _fwd_parallel(
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
    zero = _zero_of(Rstd)
    seed_key, threshold = np.uint64(seed_key), np.uint64(threshold)
    scale, eps = _cast(scale, zero), _cast(eps, zero)
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


@njit(**_JIT)
def _fwd_serial(
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
    zero = _zero_of(Rstd)  # the scalars arrive as python floats and ints (cheap to pass), typed here
    seed_key, threshold = np.uint64(seed_key), np.uint64(threshold)
    scale, eps = _cast(scale, zero), _cast(eps, zero)
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


@njit(fastmath=_FAST, **_JIT)
def _bwd_sums(dy, h, W, has_w, mean, rstd, n, zero):
    """sum(g) and sum(g * xhat) over one row, g = dy * w."""
    sg = zero
    sgx = zero
    for j in range(n):
        g = _cast(_load(dy, j), zero)
        if has_w:
            g = g * W[j]
        xhat = (_cast(_load(h, j), zero) - mean) * rstd
        sg += g
        sgx += g * xhat
    return sg, sgx


# The per-row loops live in small functions of their own: LLVM vectorizes each simple loop, where one long loop body
# full of flags stayed scalar (several times slower).
@njit(**_JIT)
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
        xhat = (_cast(_load(h, j), zero) - mean) * rstd
        g = _cast(_load(dy, j), zero)
        if has_w:
            g = g * W[j]
        dh = rstd * (g - mean_g - xhat * proj)
        if has_dro:
            dh = dh + _cast(_load(dro, j), zero)
        if has_dres:
            _store(dres, j, dh)
        if dropout:
            dh = dh * scale if _keep(base + j, seed_key, threshold) else zero
        _store(dx, j, dh)


@njit(**_JIT)
def _bwd_dw_row(dy, h, dwp, dbp, n, mean, rstd, has_w, has_db, cast, zero):
    """This row's share of dweight (dy * xhat) and dbias (dy), added to its chunk's partial sums."""
    for j in range(n):
        d = _cast(_load(dy, j), zero)
        if has_w:
            xhat = (_cast(_load(h, j), zero) - mean) * rstd
            if cast:  # the forward rounded xhat to out's dtype (dout's storage type) before the weight
                xhat = _round_as(dy, xhat)
            dwp[j] += d * xhat
        if has_db:
            dbp[j] += d


@njit(**_JIT)
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
    nf = _cast(n, zero)
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
        sg, sgx = _bwd_sums(dy, h, W, has_w, mean, rstd, n, zero)
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


@njit(**_JIT)
def _sum_chunks(P, chunks, n, Out):
    """Out[j] = sum of P[c, j] over c in order: a fixed order, so the result is deterministic."""
    for j in range(n):
        Out[j] = P[j]
    for c in range(1, chunks):
        for j in range(n):
            Out[j] += P[c * n + j]


@njit(parallel=True, **_JIT)
def _bwd_parallel(
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
    zero = _zero_of(Rstd)
    seed_key, threshold, scale = np.uint64(seed_key), np.uint64(threshold), _cast(scale, zero)
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


@njit(**_JIT)
def _bwd_serial(
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
    zero = _zero_of(Rstd)
    seed_key, threshold, scale = np.uint64(seed_key), np.uint64(threshold), _cast(scale, zero)
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


@njit(parallel=True, **_JIT)
def _bwd_cols_parallel(
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
    zero = _zero_of(Rstd)
    seed_key, threshold, scale = np.uint64(seed_key), np.uint64(threshold), _cast(scale, zero)
    nf = _cast(n, zero)
    for i in prange(m):
        mean = zero if is_rms else Mean[i]
        SG[i], SGX[i] = _bwd_sums(DY[i * sdy : i * sdy + n], H[i * sh : i * sh + n], W, has_w, mean, Rstd[i], n, zero)
    for c in prange((n + block - 1) // block):
        j0 = c * block
        k = min(n, j0 + block) - j0
        w = W[j0 : j0 + k] if has_w else W
        for i in range(m):
            dy = DY[i * sdy + j0 : i * sdy + j0 + k]
            h = H[i * sh + j0 : i * sh + j0 + k]
            dro = DRO[i * sdro + j0 : i * sdro + j0 + k] if has_dro else DRO
            dres = DRes[i * n + j0 : i * n + j0 + k] if has_dres else DRes
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


# --------------------------------------------------------------------------------------------------------------
# Launchers: flat numpy views, allocation, dtype handling, thread count
# --------------------------------------------------------------------------------------------------------------

# Below this many elements (e.g. 64 rows of 4096) a call runs on the calling thread: waking the thread pool costs
# ~10 us on an idle machine and whole scheduler ticks on a busy one, more than a few hundred KB of work takes.
PARALLEL_MIN_ELEMENTS = 1 << 18
# Column block of the backward's column split (few rows): enough work per task to pay for its scheduling.
COLS_BLOCK_MIN = 512
# Rows per dweight/dbias chunk (at least) and the most chunks; the chunking depends on M only (determinism).
_CHUNK_ROWS = 32
_MAX_CHUNKS = 64

# bf16/fp16 have no numpy/numba float type: the kernels see their bits (uint16 = bf16, int16 = fp16).
_BITS_VIEW = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}

_state = threading.local()  # the thread count last given to numba on this thread (numba's setting is per thread)
_parallel_lock = threading.Lock()  # numba's workqueue layer aborts on concurrent parallel launches; omp/tbb don't
# GNU OpenMP (numba's usual threading layer here, as torch's) does not survive fork(): a child that launches a
# parallel region after its parent did is terminated by numba. Such children (DataLoader workers, fork-based
# multiprocessing) run the serial kernels instead.
_pool = {"started": False, "forked": False}


def _after_fork_in_child() -> None:
    _pool["forked"] = _pool["started"]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _use_parallel(elements: int) -> bool:
    if elements < PARALLEL_MIN_ELEMENTS or _pool["forked"] or _threads() < 2:
        return False
    _pool["started"] = True
    return True


def _threads() -> int:
    """torch's thread count (capped by numba's pool), applied to numba only when it changed: setting costs ~us."""
    torch_threads = torch.get_num_threads()
    want = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))
    if getattr(_state, "threads", None) != want:
        numba.set_num_threads(want)
        _state.threads = want
        # starting numba's OpenMP pool resets the process-wide OpenMP thread count, which torch shares: put
        # torch's setting back (otherwise torch.set_num_threads(1) silently became 2 after the first call)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
    return want


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise()
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 1 << 21
_HUGE_MIN_BYTES = 1 << 23


def _empty(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, with large outputs hinted to be backed by 2 MB pages before anything touches them.

    A fresh 128 MB output otherwise takes 32K page faults, each zeroing 4 KB: on a VM that costs several times the
    kernel itself. The hint (what torch does for every allocation under THP_MEM_ALLOC_ENABLE=1) covers only the
    whole huge pages inside this tensor; it is advice, so a failure changes nothing.
    """
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if _madvise is not None and nbytes >= _HUGE_MIN_BYTES:
        start = (t.data_ptr() + _HUGE_PAGE - 1) & -_HUGE_PAGE
        end = (t.data_ptr() + nbytes) & -_HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)
    return t


def _np(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array sharing its memory, half types as their bits."""
    bits = _BITS_VIEW.get(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()


def _rows(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """(flat numpy view spanning the rows of 2-D ``t``, row stride), without copying row-strided input."""
    m, n = t.shape
    rs, cs = t.stride()
    if cs != 1:
        t, rs = t.contiguous(), n
    if t.requires_grad:
        t = t.detach()
    if rs == n or m == 1:
        return _np(t).reshape(-1), n
    return _np(t.as_strided(((m - 1) * rs + n,), (1,))), rs


def _vector(t: torch.Tensor | None, dtype: torch.dtype, plus_one: bool, dummy: np.ndarray) -> np.ndarray:
    if t is None:
        return dummy
    if t.requires_grad:
        t = t.detach()
    if t.dtype != dtype:  # (skipping no-op calls: each costs a dispatcher round trip, visible at decode sizes)
        t = t.to(dtype)
    if plus_one:
        t = t + 1  # zero-centered weight: the stored parameter is w - 1
    return (t if t.is_contiguous() else t.contiguous()).numpy()


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the numba kernels can run on ``device``, else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # called on every op
    if kind != "cpu":
        return f"the cpu backend runs on CPU tensors; got {kind}"
    return None


def forward(
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    is_rms,
    dropout_p,
    seed,
    residual_dtype,
    zero_centered_weight,
    store_residual_out,
    cast_before_weight=False,
    out_dtype=None,
    store_stats=True,
):
    """Kernel contract forward (see :mod:`addnorm.ops.add_norm`): (out, residual_out | None, mean | None,
    rstd | None)."""
    m, n = x.shape
    sd = stats_dtype(x.dtype, residual_dtype)
    out = _empty((m, n), out_dtype or x.dtype)
    res_out = _empty((m, n), residual_dtype) if store_residual_out else None
    mean = None if is_rms or not store_stats else torch.empty(m, dtype=sd)
    rstd = torch.empty(m, dtype=sd) if store_stats else None
    if m > 0:
        forward_into(
            out,
            res_out,
            mean,
            rstd,
            x,
            residual,
            weight,
            bias,
            eps=eps,
            is_rms=is_rms,
            dropout_p=dropout_p,
            seed=seed,
            zero_centered_weight=zero_centered_weight,
            cast_before_weight=cast_before_weight,
        )
    return out, res_out, mean, rstd


def forward_into(
    out,
    res_out,
    mean,
    rstd,
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    is_rms,
    dropout_p,
    seed,
    zero_centered_weight,
    cast_before_weight=False,
):
    """The forward kernel writing into given outputs (out and res_out contiguous; res_out None: normalize x; mean
    None for RMSNorm; mean and rstd None: statistics not kept). ``forward`` allocates and calls this; benchmarks
    call it to time the kernel without the cost of faulting in fresh output pages."""
    m, n = x.shape
    if rstd is None:  # the numba kernels write the (M,) statistics row by row: give them scratch
        rstd = torch.empty(m, dtype=stats_dtype(x.dtype, (res_out if res_out is not None else x).dtype))
        mean = None if is_rms else torch.empty_like(rstd)
    sd = rstd.dtype
    X, sx = _rows(x)
    store = res_out is not None
    if store:
        H, sh = _np(res_out).reshape(-1), n
    else:
        H, sh = X, sx  # nothing stored: the kernel normalizes x
    R, sr = H, sh  # placeholder of a type the kernel is compiled for anyway
    if residual is not None:
        if residual.dtype not in ((res_out if store else x).dtype, sd):
            residual = residual.to(sd)  # exact (or the reference's own rounding of an fp64 residual)
        R, sr = _rows(residual)
    Rstd = rstd.numpy()
    Mean = Rstd if is_rms else mean.numpy()
    W = _vector(weight, sd, zero_centered_weight, Rstd)
    B = _vector(bias, sd, False, Rstd)
    dropout = dropout_p > 0.0
    seed_key, threshold, scale = _dropout_args(seed, dropout_p, sd) if dropout else (0, 0, 1.0)
    args = (
        X,
        sx,
        R,
        sr,
        W,
        B,
        _np(out).reshape(-1),
        H,
        sh,
        Mean,
        Rstd,
        m,
        n,
        residual is not None,
        weight is not None,
        bias is not None and not is_rms,
        store,
        is_rms,
        dropout,
        seed_key,
        threshold,
        scale,
        float(eps),
        bool(cast_before_weight),
    )
    if _use_parallel(m * n):
        with _parallel_lock:
            _fwd_parallel(*args)
    else:
        _fwd_serial(*args)


def _chunks(m: int) -> int:
    return max(1, min(_MAX_CHUNKS, m // _CHUNK_ROWS))


def backward(
    dout,
    dresidual_out,
    h,
    weight,
    mean,
    rstd,
    *,
    is_rms,
    dropout_p,
    seed,
    zero_centered_weight,
    x_dtype,
    residual_dtype,
    bias_dtype,
    cast_before_weight=False,
):
    """Kernel contract backward: (dx, dresidual | None, dweight | None, dbias | None)."""
    m, n = dout.shape
    sd = rstd.dtype
    dx = _empty((m, n), x_dtype)
    dres = _empty((m, n), residual_dtype) if residual_dtype is not None else None
    chunks = _chunks(m)
    dw = torch.zeros(n, dtype=sd) if weight is not None else None
    db = torch.zeros(n, dtype=sd) if bias_dtype is not None else None
    if m > 0:
        DY, sdy = _rows(dout)
        H, sh = _rows(h)
        DRO, sdro = (H, sh) if dresidual_out is None else _rows(dresidual_out)
        Rstd = _np(rstd.detach().contiguous())
        Mean = Rstd if mean is None else _np(mean.detach().to(sd).contiguous())
        W = _vector(weight, sd, zero_centered_weight, Rstd)
        DX = _np(dx).reshape(-1)
        DRes = H if dres is None else _np(dres).reshape(-1)
        dwp = torch.zeros((chunks, n), dtype=sd) if dw is not None else None
        dbp = torch.zeros((chunks, n), dtype=sd) if db is not None else None
        DWp, DW = (Rstd, Rstd) if dw is None else (dwp.numpy().reshape(-1), dw.numpy())
        DBp, DB = (Rstd, Rstd) if db is None else (dbp.numpy().reshape(-1), db.numpy())
        dropout = dropout_p > 0.0
        seed_key, threshold, scale = _dropout_args(seed, dropout_p, sd) if dropout else (0, 0, 1.0)
        args = (
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
            dresidual_out is not None,
            weight is not None,
            dres is not None,
            db is not None,
            is_rms,
            dropout,
            seed_key,
            threshold,
            scale,
            bool(cast_before_weight),
        )
        if chunks > 1 and _use_parallel(m * n):
            with _parallel_lock:
                _bwd_parallel(*args)
        elif _use_parallel(m * n):  # too few rows to split: split the columns
            block = max(COLS_BLOCK_MIN, -(-n // (4 * _threads())))
            sg, sgx = np.empty(m, Rstd.dtype), np.empty(m, Rstd.dtype)
            with _parallel_lock:
                _bwd_cols_parallel(
                    block, m, DY, sdy, DRO, sdro, H, sh, W, Mean, Rstd, DX, DRes, sg, sgx, DW, DB, *args[17:]
                )
        else:
            _bwd_serial(*args)
    dweight = dw.to(weight.dtype) if dw is not None else None
    dbias = db.to(bias_dtype) if db is not None else None
    return dx, dres, dweight, dbias
