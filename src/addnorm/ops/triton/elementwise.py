"""The per-element parts of the add + norm contract that every Triton kernel shares: rounding to a stored dtype,
the effective weight and the affine step, the dropout keep-function (the contract's hash,
:mod:`addnorm.ops.contract`) and the dweight term. (The row statistics are in :mod:`addnorm.ops.triton.row_stats`.)
"""

from __future__ import annotations

import os
from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # the module still imports, so the backend can say what to install
    triton = None
    tl = SimpleNamespace(constexpr=None)
    jit = lambda fn: fn  # noqa: E731

# round_to(v, dtype): v in dtype, rounded to nearest even. Triton's interpreter truncates fp32 -> bf16 (the GPU
# rounds), so there it rounds on the bits: chosen at import (Triton re-checks a tl.constexpr global per launch).
if os.environ.get("TRITON_INTERPRET") == "1":

    @jit
    def round_to(v, dtype: tl.constexpr):
        if dtype != tl.bfloat16:  # (the interpreter runs this as plain Python)
            return v.to(dtype)
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)  # add half an ulp of bf16, ties to even
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
else:

    @jit
    def round_to(v, dtype: tl.constexpr):
        return v.to(dtype)


@jit
def load_weight(W, cols, ok, acc_t: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """The effective weight of columns ``cols``: w, or 1 + w (Gemma); 0 outside the row, where dout is 0 too."""
    w = tl.load(W + cols, mask=ok, other=0.0).to(acc_t)
    if ZERO_CENTERED:
        w += 1.0
    return w


@jit
def affine(y, W, B, cols, ok, acc_t: tl.constexpr, out_t: tl.constexpr, HAS_WEIGHT: tl.constexpr,
           HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr):  # fmt: skip
    """y * w + b in acc_t for y = xhat of the columns ``cols`` (each term when present; w -> 1 + w: Gemma), with
    CAST_BEFORE_WEIGHT's rounding of y to out's dtype out_t first (Llama's order). y is a tile (BLOCK_N,) or a block
    of rows (BLOCK_M, BLOCK_N): w and b are loaded as (BLOCK_N,) and broadcast over the rows."""
    if CAST_BEFORE_WEIGHT:
        y = round_to(y, out_t).to(acc_t)
    if HAS_WEIGHT:
        y = y * load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=ok, other=0.0).to(acc_t)
    return y


@jit
def _mix32(z):
    """lowbias32 on uint32, products wrapping mod 2^32: the contract's hash (addnorm.ops.contract)."""
    z ^= z >> 16
    z *= 0x7FEB352D
    z ^= z >> 15
    z *= 0x846CA68B
    return z ^ (z >> 16)


@jit
def dropout(v, idx, Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET: tl.constexpr):
    """v times the contract's scale where element ``idx`` (= i * N + j, int64) is kept, else 0: the keep-function
    of addnorm.ops.contract (SEED_OFFSET is its DROPOUT_SEED_OFFSET), so the forward, the backward and every backend
    draw the same mask."""
    key = _mix32((tl.load(Seed) + SEED_OFFSET).to(tl.uint32))
    z = _mix32(idx.to(tl.uint32) ^ _mix32((idx >> 32).to(tl.uint32) ^ key))
    keep = (z >> 8).to(tl.int32) >= keep_threshold
    if v.dtype == tl.float64:
        scale = tl.cast(scale_hi, tl.float64) + tl.cast(scale_mid, tl.float64) + tl.cast(scale_lo, tl.float64)
    else:
        scale = tl.cast(scale_hi, tl.float32)  # the scale rounded to fp32
    return tl.where(keep, v * scale, 0.0)


@jit
def dweight_term(dy, xhat, CAST_BEFORE_WEIGHT: tl.constexpr, out_t: tl.constexpr):
    """dout * (the value the weight multiplied): xhat, or xhat rounded to out's dtype (cast_before_weight)."""
    if CAST_BEFORE_WEIGHT:
        return dy * round_to(xhat, out_t).to(dy.dtype)
    else:
        return dy * xhat
