"""The ``cpu`` backend of add + norm + quantize: one numba pass per row (the contract is in
:mod:`addnorm.ops.quant.contract`).

Per row: the residual add and the statistics (finite-range guard included) are the add + norm kernels' own row
functions (:mod:`addnorm.ops.cpu.kernels`, :mod:`addnorm.ops.cpu.stats`), so residual_out, mean and rstd are bitwise those of ``add_rms_norm(backend='cpu')``.
Then y is written once into a float32 row buffer (a few KB, which stays in L1/L2) that the amax pass and the
codes pass read.

FP8 codes are encoded from the bits (numba has no FP8 type), round to nearest even, from the float32 value already
saturated to [-QMAX, QMAX]:

    normal     |v| >= 2^(1 - BIAS): drop the low 23 - MBITS mantissa bits of v's float32 pattern with
               round-half-to-even, then rebias the exponent (BIAS = 7 for e4m3fn, 15 for e5m2)
    subnormal  |v| <  2^(1 - BIAS): k = rint(|v| * 2^(BIAS - 1 + MBITS)) (exact scaling, one rounding); the code is k,
               and k = 2^MBITS is the smallest normal's code, so a carry needs no special case
    NaN        the format's NaN code, with v's sign (as torch's conversion gives)

tests/ops/test_quant_encode.py checks it bitwise against torch's ``.to(float8_*)`` over every float32 pattern in
the formats' ranges (a stride through them).
"""

from __future__ import annotations

import numpy as np
import torch

from addnorm.ops.contract import stats_dtype

# the add + norm kernels' own row math (residual add, sums), so that residual_out and the statistics are theirs
from addnorm.ops.cpu.kernels import (
    IMPORT_ERROR,
    JIT,
    cast_like,
    load,
    njit,
    prange,
    residual_row,
    round_as,
    zero_of,
)
from addnorm.ops.cpu.launch import as_numpy, row_view, use_parallel
from addnorm.ops.cpu.stats import NOT_SCALED, guarded_row_stats, pow2_halves

try:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
except ImportError:  # numba missing: unavailable_reason says so (IMPORT_ERROR)
    ir = types = None

    def intrinsic(f):
        return f


__all__ = ["encode_fp8", "quant_forward", "unavailable_reason"]

# kind codes of the quantized dtypes, and their (BIAS, MBITS)
_KIND = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.int8: 2}


def unavailable_reason(device: torch.device, quant_dtype: torch.dtype) -> str | None:
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    return None if device.type == "cpu" else f"the cpu backend runs on CPU tensors; got {device.type}"


@njit(inline="always", **JIT)
def _encode(v, kind):
    """The code (as uint8 bits) of float32 ``v``, already saturated (or NaN), in quantized dtype ``kind``."""
    if kind == 2:  # int8: round half to even; NaN (no int8 code) -> 0
        if v != v:
            return np.uint8(0)
        return np.uint8(np.int32(np.rint(v)) & 0xFF)
    bias = 7 if kind == 0 else 15
    mbits = 3 if kind == 0 else 2
    bits = np.int64(_f32_bits(np.float32(v)))
    sign = np.uint8((bits >> 24) & 0x80)
    mag = bits & 0x7FFFFFFF
    if mag > 0x7F800000:  # NaN: e4m3fn's only NaN is S.1111.111; e5m2's quiet NaN S.11111.11 (torch's choices)
        return sign | np.uint8(0x7F)
    shift = 23 - mbits
    if mag < (127 + 1 - bias) << 23:  # below the smallest normal: a subnormal code (or 0)
        a = _f32_from_bits(np.uint32(mag))
        k = np.rint(a * np.float32(2.0 ** (bias - 1 + mbits)))
        return sign | np.uint8(np.int32(k))
    r = (mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift
    return sign | np.uint8(r - ((127 - bias) << mbits))


@intrinsic
def _f32_bits(typingctx, value):
    """float32 -> its bit pattern as uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f32_from_bits(typingctx, bits):
    """uint32 bit pattern -> float32."""
    if bits != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(**JIT)
def encode_fp8(V, Q, kind):
    """Q[j] = the code of V[j] (float32, saturated) for every j: the encoder alone, for the tests."""
    for j in range(V.shape[0]):
        Q[j] = _encode(V[j], kind)


@njit(**JIT)
def _y_row(h, X, W, B, Y, n, mean, rstd, has_w, has_b, cast):
    """Y[j] = the add + norm op's value of element j before its final rounding, as float32 (the contract's y), for
    a whole row: one pass that vectorizes, into a row buffer the amax and code loops then read (a per-element
    helper called from those loops ran ~50x slower: numba did not inline it)."""
    for j in range(n):
        y = (cast_like(load(h, j), mean) - mean) * rstd
        if cast:
            y = round_as(X, y)  # Llama's order: the normalized value rounded to x's dtype first
        if has_w:
            y = y * W[j]
        if has_b:
            y = y + B[j]
        Y[j] = np.float32(y)


@njit(**JIT)
def _y_row_scaled(h, X, W, B, Y, n, k, mean_s, r, has_w, has_b, cast):
    """:func:`_y_row` for a row the finite-range guard rescaled: xhat = (h * 2^k - mean_s) * r in float64
    (:func:`addnorm.ops.cpu.stats.guarded_row_stats`)."""
    s1, s2 = pow2_halves(k)
    for j in range(n):
        y = (np.float64(load(h, j)) * s1 * s2 - mean_s) * r
        if cast:
            y = round_as(X, y)
        if has_w:
            y = y * np.float64(W[j])
        if has_b:
            y = y + np.float64(B[j])
        Y[j] = np.float32(y)


@njit(inline="always", **JIT)
def _saturated(y, j, inv, qmax):
    v = np.float32(y[j] * inv)
    if v > qmax:
        return qmax
    if v < -qmax:
        return -qmax
    return v  # (NaN falls through both)


# One loop per format, each with its format a constant: the encoder's branches fold away and the loop vectorizes
# (with the format as a runtime argument the same loop ran ~20x slower)
@njit(**JIT)
def _codes_e4m3(y, q, lo, hi, inv, qmax):
    for j in range(lo, hi):
        q[j] = _encode(_saturated(y, j, inv, qmax), 0)


@njit(**JIT)
def _codes_e5m2(y, q, lo, hi, inv, qmax):
    for j in range(lo, hi):
        q[j] = _encode(_saturated(y, j, inv, qmax), 1)


@njit(**JIT)
def _codes_int8(y, q, lo, hi, inv, qmax):
    for j in range(lo, hi):
        q[j] = _encode(_saturated(y, j, inv, qmax), 2)


@njit(**JIT)
def _codes(y, q, lo, hi, inv, qmax, kind):
    """q[lo:hi] = the codes of y[lo:hi] * inv, saturated to [-qmax, qmax]."""
    if kind == 0:
        _codes_e4m3(y, q, lo, hi, inv, qmax)
    elif kind == 1:
        _codes_e5m2(y, q, lo, hi, inv, qmax)
    else:
        _codes_int8(y, q, lo, hi, inv, qmax)


@njit(**JIT)
def _quant_row(
    i,
    X,
    sx,
    R,
    sr,
    W,
    B,
    H,
    sh,
    Q,
    S,
    n,
    group,
    has_res,
    has_w,
    has_b,
    is_rms,
    eps,
    cast,
    static,
    inv_static,
    has_ub,
    ub,
    qmax,
    min_scale,
    kind,
    zero,
):
    # X, R: x and residual rows (strides sx, sr); W, B: weight (1 + weight when zero-centered) and bias in the
    # statistics dtype; H: residual_out rows (stride sh; may be R itself: the in-place form); Q: (M, N) codes as
    # uint8; S: (M, N // group) float32 scales (dynamic)
    h = H[i * sh : i * sh + n]
    residual_row(X[i * sx : i * sx + n], R[i * sr : i * sr + n], h, i, n, has_res, False, 0, 0, zero, zero)
    mean, rstd, k, mean_s, r = guarded_row_stats(h, n, is_rms, eps, zero)
    q = Q[i * n : i * n + n]
    y = np.empty(n, dtype=np.float32)  # the row's y: a few KB, in L1 for the two passes below
    if k == NOT_SCALED:
        _y_row(h, X[i * sx : i * sx + n], W, B, y, n, mean, rstd, has_w, has_b, cast)
    else:  # the finite-range guard rescaled the row
        _y_row_scaled(h, X[i * sx : i * sx + n], W, B, y, n, k, mean_s, r, has_w, has_b, cast)
    for g in range(n // group):
        lo = g * group
        inv = inv_static
        if not static:
            amax = np.float32(0.0)
            nan = False
            for j in range(lo, lo + group):
                a = abs(y[j])
                if a != a:
                    nan = True
                elif a > amax:
                    amax = a
            if nan:  # NaN propagates into the scale, as torch.amax does
                amax = np.float32(np.nan)
            if has_ub and amax > ub:
                amax = ub
            scale = np.float32(amax / qmax)
            if scale < min_scale:
                scale = min_scale
            S[i * (n // group) + g] = scale
            inv = np.float32(np.float32(1.0) / scale)
        _codes(y, q, lo, lo + group, inv, qmax, kind)


@njit(parallel=True, **JIT)
def _quant_parallel(
    X,
    sx,
    R,
    sr,
    W,
    B,
    H,
    sh,
    Q,
    S,
    m,
    n,
    group,
    has_res,
    has_w,
    has_b,
    is_rms,
    eps,
    cast,
    static,
    inv_static,
    has_ub,
    ub,
    qmax,
    min_scale,
    kind,
    Zero,
):
    zero = zero_of(Zero)
    eps = cast_like(eps, zero)
    inv_static, ub = np.float32(inv_static), np.float32(ub)
    qmax, min_scale = np.float32(qmax), np.float32(min_scale)
    for i in prange(m):
        _quant_row(
            i,
            X,
            sx,
            R,
            sr,
            W,
            B,
            H,
            sh,
            Q,
            S,
            n,
            group,
            has_res,
            has_w,
            has_b,
            is_rms,
            eps,
            cast,
            static,
            inv_static,
            has_ub,
            ub,
            qmax,
            min_scale,
            kind,
            zero,
        )


@njit(**JIT)
def _quant_serial(
    X,
    sx,
    R,
    sr,
    W,
    B,
    H,
    sh,
    Q,
    S,
    m,
    n,
    group,
    has_res,
    has_w,
    has_b,
    is_rms,
    eps,
    cast,
    static,
    inv_static,
    has_ub,
    ub,
    qmax,
    min_scale,
    kind,
    Zero,
):
    zero = zero_of(Zero)
    eps = cast_like(eps, zero)
    inv_static, ub = np.float32(inv_static), np.float32(ub)
    qmax, min_scale = np.float32(qmax), np.float32(min_scale)
    for i in range(m):
        _quant_row(
            i,
            X,
            sx,
            R,
            sr,
            W,
            B,
            H,
            sh,
            Q,
            S,
            n,
            group,
            has_res,
            has_w,
            has_b,
            is_rms,
            eps,
            cast,
            static,
            inv_static,
            has_ub,
            ub,
            qmax,
            min_scale,
            kind,
            zero,
        )


def quant_forward(
    x,
    residual,
    weight,
    bias,
    h_out,
    q,
    scales,
    scale,
    scale_ub,
    *,
    eps,
    is_rms,
    qmax,
    min_scale,
    group_size,
    zero_centered_weight,
    cast_before_weight,
    x_dtype,
):
    """The kernel contract of :mod:`addnorm.ops.quant.contract`; weight and bias arrive in the statistics dtype."""
    m, n = x.shape
    sd = stats_dtype(x.dtype, h_out.dtype)
    zero = np.zeros(1, dtype=np.float64 if sd == torch.float64 else np.float32)
    X, sx = row_view(x)
    R, sr = row_view(residual) if residual is not None else (X, sx)
    H, sh = row_view(h_out)
    if weight is not None and zero_centered_weight:
        weight = weight + 1
    W = weight.contiguous().numpy() if weight is not None else zero
    B = bias.contiguous().numpy() if bias is not None else zero
    Q = as_numpy(q.view(torch.uint8)).reshape(-1)
    S = scales.numpy().reshape(-1) if scales is not None else np.zeros(1, dtype=np.float32)
    static = scale is not None
    # 1 / scale in float32, as the torch backend computes it (one division, then a multiplication per element)
    inv_static = float((1.0 / scale.reshape(())).item()) if static else 0.0
    ub = float(scale_ub.reshape(()).item()) if scale_ub is not None else 0.0
    kind = _KIND[q.dtype]
    kernel = _quant_parallel if use_parallel(m * n) else _quant_serial
    with torch.no_grad():
        kernel(
            X,
            sx,
            R,
            sr,
            W,
            B,
            H,
            sh,
            Q,
            S,
            m,
            n,
            group_size,
            residual is not None,
            weight is not None,
            bias is not None,
            is_rms,
            eps,
            cast_before_weight,
            static,
            inv_static,
            scale_ub is not None,
            ub,
            qmax,
            min_scale,
            kind,
            zero,
        )
