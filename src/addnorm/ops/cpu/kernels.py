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
the contract's scale (:func:`addnorm.ops.contract.dropout_keep_mask`, :func:`~addnorm.ops.contract.dropout_scale`), so
the backward regenerates the mask and every backend agrees bit for bit.
"""

from __future__ import annotations

import numpy as np

from addnorm.ops.contract import MIX_M1, MIX_M2

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic, overload

    IMPORT_ERROR: str | None = None
except ImportError as _e:  # the module must still import so that unavailable_reason can say why
    numba = ir = types = None
    IMPORT_ERROR = f"numba is not installed ({_e}); `pip install numba`"

    def njit(*args, **kwargs):
        return (lambda f: f) if not args or not callable(args[0]) else args[0]

    def intrinsic(f):
        return f

    def overload(f, **kwargs):
        return lambda impl: impl

    prange = range

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
    "prange",
    "round_as",
    "store_rounded",
    "zero_of",
]

# Flags for the row reductions only: reassociation lets LLVM keep 8 partial sums in a vector register (faster, and
# no less accurate than one sequential sum). Elementwise code stays IEEE-exact so residual_out is bit-identical to
# the float oracle of addnorm.reference. No nnan/ninf: NaN and inf must propagate.
FAST = {"reassoc", "contract"}
# error_model="numpy": a float division by zero is IEEE (inf/nan), as in torch. numba's default ("python") raises
# ZeroDivisionError, which a constant row with eps=0 (rstd = 1/sqrt(0)) hit in the middle of a kernel.
JIT = dict(cache=True, nogil=True, error_model="numpy")

# numba's cache (cache=True) keys a kernel on the source of its own file only: the backward kernels of kernels_bwd.py
# inline the helpers below, and the decode entry points of fast_launch.py compile fwd_serial into themselves, so
# after editing this file delete those files' entries in __pycache__ (*.nbi, *.nbc), or they keep running the old
# code (tests/ops/test_decode_fast_path.py, which compares fast_launch with the general launch, would notice).

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


def load(a, j):
    """a[j] as a float (float32 for bf16/fp16/fp32 storage, float64 for fp64); numba-only."""
    raise NotImplementedError


def store_rounded(a, j, v):
    """a[j] = v rounded to a's storage type; numba-only."""
    raise NotImplementedError


def cast_like(v, like):
    """v converted to the float type of ``like`` (the statistics dtype); numba-only."""
    raise NotImplementedError


@overload(load, inline="always")
def _load_impl(a, j):
    if a.dtype == types.uint16:
        return lambda a, j: _bf16_to_f32(a[j])
    if a.dtype == types.int16:
        return lambda a, j: _f16_to_f32(a[j])
    return lambda a, j: a[j]


@overload(store_rounded, inline="always")
def _store_rounded_impl(a, j, v):
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


def round_as(a, v):
    """v rounded to the storage type of array ``a`` and back to v's float type; numba-only."""
    raise NotImplementedError


@overload(round_as, inline="always")
def _round_as_impl(a, v):
    if a.dtype == types.uint16:
        return lambda a, v: cast_like(_bf16_to_f32(_f32_to_bf16(np.float32(v))), v)
    if a.dtype == types.int16:
        return lambda a, v: cast_like(_f16_to_f32(_f32_to_f16(np.float32(v))), v)
    if a.dtype == types.float32:
        return lambda a, v: cast_like(np.float32(v), v)
    return lambda a, v: v


@overload(cast_like, inline="always")
def _cast_like_impl(v, like):
    if like == types.float64:
        return lambda v, like: np.float64(v)
    return lambda v, like: np.float32(v)


def zero_of(a):
    """0 in the float type of array ``a``'s elements (the statistics dtype); numba-only."""
    raise NotImplementedError


@overload(zero_of, inline="always")
def _zero_of_impl(a):
    if a.dtype == types.float64:
        return lambda a: np.float64(0.0)
    return lambda a: np.float32(0.0)


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


@njit(fastmath=FAST, **JIT)
def row_sum(h, n, zero):
    s = zero
    for j in range(n):
        s += cast_like(load(h, j), zero)
    return s


@njit(fastmath=FAST, **JIT)
def row_sum_sq_dev(h, n, mean, zero):
    s = zero
    for j in range(n):
        d = cast_like(load(h, j), zero) - mean
        s += d * d
    return s


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
def _normalize_row(h, out, W, B, n, mean, rstd, has_w, has_b, cast, zero):
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
    nf = cast_like(n, zero)
    if is_rms:
        mean = zero
        rstd = 1 / np.sqrt(row_sum_sq_dev(h, n, zero, zero) / nf + eps)
    else:
        mean = row_sum(h, n, zero) / nf
        rstd = 1 / np.sqrt(row_sum_sq_dev(h, n, mean, zero) / nf + eps)
        Mean[i] = mean
    rstd = cast_like(rstd, zero)
    Rstd[i] = rstd
    _normalize_row(h, Out[i * n : i * n + n], W, B, n, mean, rstd, has_w, has_b, cast, zero)


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
