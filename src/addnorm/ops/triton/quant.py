"""The ``triton`` backend of add + norm + quantize: one program per row, the row in registers (the contract is in
:mod:`addnorm.ops.quant.contract`).

The row math (residual add rounded to residual_dtype and stored, two-pass statistics, the weight and bias) is the
add + norm kernels' (``round_to`` and ``affine`` of :mod:`addnorm.ops.triton.elementwise`; the statistics with
the guard and scaled pass of :mod:`addnorm.ops.triton.row_stats` for rows beyond fp32's range); a quantization mode
added here as kernels of its own, so the add + norm kernels stay as they are. Then:

    static     v = y * inv_scale
    dynamic    amax per group (the whole row for per token; a power-of-two group by a reshape of the row, any
               other group by one masked max per group), NaN counted apart so that it propagates (a GPU max drops
               NaN); scale = max(min(amax, ub) / QMAX, MIN_SCALE); v = y * (1 / scale)
    codes      saturate to [-QMAX, QMAX], then: on sm_89+ GPUs the hardware conversion (cvt.rn.satfinite), in
               Triton's interpreter a bit-level encoder (the interpreter converts float32 -> e4m3 wrongly: 7.96875 ->
               4.0, 500 -> 256, NaN -> 384 measured with Triton 3.9), int8 by round-half-even on the float32 value.

Below sm_89 the GPU has no FP8 conversion: FP8 output is unavailable there (int8 runs anywhere).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    from addnorm.ops.triton.elementwise import affine, round_to
    from addnorm.ops.triton.row_stats import plain_stats_fail, rsqrt, scaled_rows_fwd

    jit = triton.jit
except ImportError:
    triton = None
    tl = SimpleNamespace(constexpr=None)
    jit = lambda fn: fn  # noqa: E731

__all__ = ["quant_forward", "unavailable_reason"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_KIND = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.int8: 2}
# round-half-even to an integer by adding and subtracting 1.5 * 2^23 (exact for |v| < 2^22); a constexpr, as
# compiled kernels may read no other globals
_RNE_MAGIC = tl.constexpr(12582912.0) if triton is not None else 12582912.0


def unavailable_reason(device: torch.device, quant_dtype: torch.dtype) -> str | None:
    if triton is None:
        return "triton is not installed: pip install 'addnorm[triton]'"
    if device.type == "cpu":
        if not _INTERPRETED:
            return "CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter); use backend='cpu'"
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the triton backend runs on CUDA GPUs (or CPU tensors in the interpreter); got {device.type}"
    if quant_dtype != torch.int8 and not _INTERPRETED and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"FP8 conversion needs an sm_89+ GPU (Ada, Hopper or newer); this one is sm_{major}{minor}"
    return None


@jit
def _encode(v, KIND: tl.constexpr, BITWISE: tl.constexpr):
    """Codes (uint8 bits) of float32 ``v``, already saturated (or NaN)."""
    if KIND == 2:
        k = tl.where(v != v, 0.0, v)
        k = (k + _RNE_MAGIC) - _RNE_MAGIC
        return (k.to(tl.int32) & 0xFF).to(tl.uint8)
    elif not BITWISE:
        if KIND == 0:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        BIAS: tl.constexpr = 7 if KIND == 0 else 15
        MBITS: tl.constexpr = 3 if KIND == 0 else 2
        SHIFT: tl.constexpr = 23 - MBITS
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MBITS)
        # below the smallest normal: k = rint(|v| * 2^(BIAS - 1 + MBITS)), the subnormal code (2^MBITS: min normal)
        small = mag < ((128 - BIAS) << 23)
        a = tl.where(small, mag, 0).to(tl.float32, bitcast=True) * (2.0 ** (BIAS - 1 + MBITS))  # (no NaN*2^k)
        sub = ((a + _RNE_MAGIC) - _RNE_MAGIC).to(tl.uint32)
        code = tl.where(small, sub, normal)
        code = tl.where(mag > 0x7F800000, 0x7F, code)
        return (code | sign).to(tl.uint8)


@jit
def _div(a, b, BITWISE: tl.constexpr):
    """a / b rounded once (the contract's divisions): a GPU's plain fp32 division is approximate."""
    if BITWISE:
        return a / b  # the interpreter divides in numpy float32: correctly rounded
    else:
        return tl.math.div_rn(a, b)


@jit
def _codes(y, inv, qmax, KIND: tl.constexpr, BITWISE: tl.constexpr):
    v = y * inv
    v = tl.where(v > qmax, qmax, tl.where(v < -qmax, -qmax, v))  # saturate; NaN falls through both
    return _encode(v, KIND, BITWISE)


@jit
def _scale(amax, nans, ub, qmax, min_scale, HAS_UB: tl.constexpr, BITWISE: tl.constexpr):
    amax = tl.where(nans > 0, float("nan"), amax)
    if HAS_UB:
        amax = tl.where(amax > ub, ub, amax)
    s = _div(amax, qmax, BITWISE)
    return tl.where(s < min_scale, min_scale, s)


@jit
def encode_kernel(V, Q, n, qmax, KIND: tl.constexpr, BITWISE: tl.constexpr, BLOCK: tl.constexpr):
    """Q = the codes of float32 V saturated: the encoder alone, for the tests."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(V + offs, mask=ok, other=0.0)
    tl.store(Q + offs, _codes(v, 1.0, qmax, KIND, BITWISE), mask=ok)


@jit
def quant_rows_kernel(
    X,  # (M, N) input, row stride stride_x
    R,  # (M, N) residual (when HAS_RESIDUAL), row stride stride_r
    W,  # (N,) weight in the statistics dtype (when HAS_WEIGHT)
    B,  # (N,) bias in the statistics dtype (when HAS_BIAS)
    H,  # (M, N) residual_out, row stride stride_h (may be R: the in-place form)
    Q,  # (M, N) codes as uint8, contiguous
    S,  # (M, N // GROUP) float32 scales (dynamic), contiguous
    Scale,  # () float32 static scale (when STATIC)
    Ub,  # () float32 upper bound of amax (when HAS_UB)
    Acc,  # any tensor of the statistics dtype: its element type is the accumulation type
    stride_x,
    stride_r,
    stride_h,
    N,
    eps_hi,
    eps_lo,
    qmax,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    X_T: tl.constexpr,  # x's dtype, to which CAST_BEFORE_WEIGHT rounds
    STATIC: tl.constexpr,
    HAS_UB: tl.constexpr,
    GROUP: tl.constexpr,
    PER_TOKEN: tl.constexpr,  # GROUP is the whole row: one scale per row
    POW2_GROUP: tl.constexpr,  # GROUP a power of two dividing BLOCK_N and N: a reshape finds the amax
    KIND: tl.constexpr,
    BITWISE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_t = Acc.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    h = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(acc_t)
    if HAS_RESIDUAL:
        h += tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(acc_t)
    stored = round_to(h, H.dtype.element_ty)
    tl.store(H + row * stride_h + cols, stored, mask=ok)
    h = stored.to(acc_t)  # normalize the sum exactly as stored
    eps = tl.cast(eps_hi, acc_t) + tl.cast(eps_lo, acc_t)
    if IS_RMS:
        d = h
    else:
        mean = tl.sum(h, axis=0) / N
        d = tl.where(ok, h - mean, 0.0)
    v = tl.sum(d * d, axis=0) / N + eps
    rstd = rsqrt(v)
    if plain_stats_fail(v):  # beyond the plain statistics' range: the scaled pass of row_stats, rare
        d2, rstd2, _, _ = scaled_rows_fwd(h[None, :], ok[None, :], N, eps, plain_stats_fail(v)[None], IS_RMS)
        d = tl.reshape(d2, (BLOCK_N,))
        rstd = tl.sum(rstd2, axis=0)
    y = affine(d * rstd, W, B, cols, ok, acc_t, X_T, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, CAST_BEFORE_WEIGHT)
    y = y.to(tl.float32)
    if STATIC:
        inv = _div(1.0, tl.load(Scale), BITWISE)
        q = _codes(y, inv, qmax, KIND, BITWISE)
    elif PER_TOKEN:  # (any N). A constexpr, not `GROUP == N`: compiled, a runtime test compiles every branch
        a = tl.where(ok, tl.abs(y), 0.0)
        nans = tl.sum((a != a).to(tl.int32), axis=0)
        s = _scale(
            tl.max(tl.where(a != a, 0.0, a), axis=0),
            nans,
            tl.load(Ub) if HAS_UB else 0.0,
            qmax,
            min_scale,
            HAS_UB,
            BITWISE,
        )
        tl.store(S + row, s)
        q = _codes(y, _div(1.0, s, BITWISE), qmax, KIND, BITWISE)
    elif POW2_GROUP:
        NG: tl.constexpr = BLOCK_N // GROUP
        a = tl.reshape(tl.where(ok, tl.abs(y), 0.0), (NG, GROUP))
        nans = tl.sum((a != a).to(tl.int32), axis=1)
        s = _scale(
            tl.max(tl.where(a != a, 0.0, a), axis=1),
            nans,
            tl.load(Ub) if HAS_UB else 0.0,
            qmax,
            min_scale,
            HAS_UB,
            BITWISE,
        )
        g = tl.arange(0, NG)
        tl.store(S + row * (N // GROUP) + g, s, mask=g < N // GROUP)
        inv = tl.reshape(tl.broadcast_to(_div(1.0, s, BITWISE)[:, None], (NG, GROUP)), (BLOCK_N,))
        q = _codes(y, inv, qmax, KIND, BITWISE)
    else:
        # a group that is no power of two: one masked max per group (slower, same arithmetic)
        inv = tl.zeros((BLOCK_N,), tl.float32)
        for gi in range(N // GROUP):
            in_g = (cols >= gi * GROUP) & (cols < gi * GROUP + GROUP)
            a = tl.where(in_g, tl.abs(y), 0.0)
            nans = tl.sum((a != a).to(tl.int32), axis=0)
            s = _scale(
                tl.max(tl.where(a != a, 0.0, a), axis=0),
                nans,
                tl.load(Ub) if HAS_UB else 0.0,
                qmax,
                min_scale,
                HAS_UB,
                BITWISE,
            )
            tl.store(S + row * (N // GROUP) + gi, s)
            inv = tl.where(in_g, _div(1.0, s, BITWISE), inv)
        q = _codes(y, inv, qmax, KIND, BITWISE)
    tl.store(Q + row * N + cols, q, mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _eps_pair(eps: float) -> tuple[float, float]:
    hi = float(torch.tensor(eps, dtype=torch.float32))
    return hi, float(torch.tensor(eps - hi, dtype=torch.float32))


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
    block_n = _pow2(n)
    if block_n > 65536:
        raise ValueError(f"the triton quantized add + norm keeps a row in registers: N <= 65536, got {n}")
    acc = torch.empty(
        1, dtype=torch.float64 if torch.float64 in (x.dtype, h_out.dtype) else torch.float32, device=x.device
    )
    dummy = acc
    group = group_size
    pow2_group = group & (group - 1) == 0 and block_n % group == 0 and n % group == 0
    eps_hi, eps_lo = _eps_pair(eps)
    with torch.cuda.device(x.device) if x.is_cuda else _null():
        quant_rows_kernel[(m,)](
            x,
            residual if residual is not None else x,
            weight if weight is not None else dummy,
            bias if bias is not None else dummy,
            h_out,
            q.view(torch.uint8),
            scales if scales is not None else dummy,
            scale if scale is not None else dummy,
            scale_ub if scale_ub is not None else dummy,
            acc,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            h_out.stride(0),
            n,
            eps_hi,
            eps_lo,
            qmax,
            min_scale,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            IS_RMS=is_rms,
            ZERO_CENTERED=bool(zero_centered_weight),
            CAST_BEFORE_WEIGHT=bool(cast_before_weight),
            X_T=_TL_DTYPES[x_dtype],
            STATIC=scale is not None,
            HAS_UB=scale_ub is not None,
            GROUP=group,
            PER_TOKEN=group == n,
            POW2_GROUP=pow2_group,
            KIND=_KIND[q.dtype],
            BITWISE=_INTERPRETED,
            BLOCK_N=block_n,
            num_warps=min(16, max(1, block_n // 256)),
        )


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


_TL_DTYPES = (
    {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}
    if triton is not None
    else {}
)
