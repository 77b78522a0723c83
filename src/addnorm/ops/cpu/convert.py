"""Register-level pieces of the ``cpu`` backend's numba kernels: the numba import (the module still imports
without numba, so that ``unavailable_reason`` can say why), the compile flags, and the dtype conversions.

Half types never exist as numpy/numba floats here: bf16 travels as uint16 bits and fp16 as int16 bits, converted
in registers (bf16 by bit operations with round-to-nearest-even, fp16 by LLVM's half type, F16C on x86).
"""

from __future__ import annotations

import numpy as np

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
    "intrinsic",
    "ir",
    "load",
    "njit",
    "numba",
    "overload",
    "prange",
    "round_as",
    "store_rounded",
    "types",
    "zero_of",
]

# Flags for the row reductions only: reassociation lets LLVM keep 8 partial sums in a vector register (faster, and
# no less accurate than one sequential sum). Elementwise code stays IEEE-exact so residual_out is bit-identical to
# the float oracle of addnorm.reference. No nnan/ninf: NaN and inf must propagate.
FAST = {"reassoc", "contract"}
# error_model="numpy": a float division by zero is IEEE (inf/nan), as in torch. numba's default ("python") raises
# ZeroDivisionError, which a constant row with eps=0 (rstd = 1/sqrt(0)) hit in the middle of a kernel.
JIT = dict(cache=True, nogil=True, error_model="numpy")

# numba's cache (cache=True) keys a kernel on the source of its own file only: every kernel file inlines the helpers
# below (and those of stats.py), and the decode entry points of fast_launch.py compile fwd_serial into themselves,
# so after editing this file or stats.py delete the other files' entries in __pycache__ (*.nbi, *.nbc), or they
# keep running the old code (tests/ops/test_decode_fast_path.py, which compares fast_launch with the general
# launch, would notice).

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
