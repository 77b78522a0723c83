"""The register-level pieces of the bf16 pair passes (:mod:`addnorm.ops.cpu.bf16_pairs`): a uint32 word read as
two bf16 values and two float32 values stored as one word, written as LLVM IR so that everything stays in 32-bit
lanes (numba widens small integers to int64, and its bf16 conversions widen every vector to 32 bits and narrow it
back; bf16_pairs' docstring shows the word layout). Also the two memory helpers the passes need: a prefetch hint
and an array's address.

Each is inlined where it is called (numba intrinsics), so the split costs nothing at run time. After editing this
file delete the ``__pycache__`` entries (*.nbi, *.nbc) of bf16_pairs.py, which compiles them in.
"""

from __future__ import annotations

from addnorm.ops.cpu.convert import intrinsic, ir, types

__all__ = ["address", "hi", "lo", "pack", "pack_raw", "prefetch", "via_bf16"]

_I32 = ir.IntType(32) if ir is not None else None


def _c(v):
    return ir.Constant(_I32, v)


@intrinsic
def lo(typingctx, w):
    """The float32 of a word's low bf16 (the pair's first value)."""
    if w != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.shl(args[0], _c(16)), ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def hi(typingctx, w):
    """The float32 of a word's high bf16 (the pair's second value)."""
    if w != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.and_(args[0], _c(0xFFFF0000)), ir.FloatType())

    return types.float32(types.uint32), codegen


def _rne(builder, v, nan=True):
    """float32 v rounded to bf16, in the high half of an i32 (low half zero): convert.py's _f32_to_bf16. nan=False
    leaves out its NaN select (see via_bf16)."""
    u = builder.bitcast(v, _I32)
    lsb = builder.and_(builder.lshr(u, _c(16)), _c(1))
    rounded = builder.and_(builder.add(u, builder.add(lsb, _c(0x7FFF))), _c(0xFFFF0000))
    if not nan:
        return rounded
    return builder.select(builder.fcmp_unordered("uno", v, v), _c(0x7FC00000), rounded)


@intrinsic
def via_bf16(typingctx, v):
    """float32 v rounded to bf16 and back: convert.py's ``round_as`` for a bf16 array, except that a NaN keeps its
    own bits rather than becoming 0x7FC00000. Only on values that end in a rounded store, where any NaN becomes
    0x7FC0: what matters is that a NaN stays a NaN, and rounding keeps every NaN whose low 16 bits are 0 as it is
    (no carry into the exponent). The only NaNs in these passes are bf16 values (low bits 0), the NaN the FPU makes
    (0xFFC00000) and NaNs of fp32 weights or biases: the launch sends calls with a NaN weight or bias to the
    general kernels. (One select less on each value: ~10% of the pass.)"""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_rne(builder, args[0], nan=False), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def pack(typingctx, a, b):
    """The word of two float32 values each rounded to bf16: a in the low half, b in the high."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.or_(builder.lshr(_rne(builder, args[0]), _c(16)), _rne(builder, args[1]))

    return types.uint32(types.float32, types.float32), codegen


@intrinsic
def pack_raw(typingctx, a, b):
    """pack without its NaN selects: a NaN stays a NaN (via_bf16 says why) of any sign (bf16_pairs' docstring says where that is safe)."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.or_(builder.lshr(_rne(builder, args[0], nan=False), _c(16)), _rne(builder, args[1], nan=False))

    return types.uint32(types.float32, types.float32), codegen


@intrinsic
def prefetch(typingctx, arr, idx):
    """A hint to bring the cache line of arr[idx] in (no load, no fault, no bounds check)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.bitcast(builder.gep(a.data, [args[1]]), ir.IntType(8).as_pointer())
        name = "llvm.prefetch.p0" if getattr(p.type, "is_opaque", False) else "llvm.prefetch.p0i8"
        fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ir.VoidType(), [p.type, _I32, _I32, _I32]))
        builder.call(fn, [p, _c(0), _c(3), _c(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@intrinsic
def address(typingctx, arr):
    """The address of an array's first element, for the alignment test."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(context.make_array(sig.args[0])(context, builder, args[0]).data, ir.IntType(64))

    return types.uint64(arr), codegen
