"""A row's sum of squares in PyTorch's own order: the sum behind the ``cpu`` backend's RMSNorm rstd.

Why: a sum of floats depends on its order, and users compare the ``cpu`` backend with PyTorch. FlashInfer's and
vLLM's tests check a bf16 RMSNorm against ``x.float().pow(2).mean(-1)`` with a tolerance below one bf16 ulp, so an
rstd one float32 ulp away (any other order of the same sum) now and then rounds an output element the other way.
Summed in PyTorch's order, the kernels' rstd is PyTorch's, bit for bit, at no measurable cost for RMSNorm: the order
is itself a 32-lane vector sum (benchmarks/results/torch_order.md). (LayerNorm keeps the kernels' own sums:
:mod:`addnorm.ops.cpu.stats` says why.)

The order, as ATen's CPU ``sum`` (its "cascade sum") takes a contiguous row of n squares of the accumulation type
(float32, or float64 for float64 rows). With V lanes per 32-byte vector (V = 8 for float32, 4 for float64; PyTorch
builds its sum kernel for 32-byte vectors also on AVX-512 machines, measured on this CPU):

    rows of 4 vectors (4V values each), numbered i = 0 .. n // (4V) - 1
    level 0: 4 vectors that add rows one by one, from zero, each lane a sequential sum
    every `step` rows (step = 2^p, p = max(4, ceil(log2(rows)) // 4)) level 0 is added into level 1 and reset;
        level 1 goes into level 2 (and is reset) when i is a multiple of step^2, level 2 into 3 at step^3
    the rows left after the last full step go into level 0; then level0 + level1 + level2 + level3 (in that order)
    the vectors left after the rows (n // V - 4 * rows, at most 3) are added to the first of the 4 vectors,
        then vector0 + vector1 + vector2 + vector3
    the result: 0, plus the values left after the vectors (n % V) one by one, plus the V lanes in lane order

A row shorter than one vector (n < V) takes ATen's scalar form: four running sums over the values in groups of 4,
the rest added to the first, then the four in order. ``Tensor.mean`` on CPU is that sum divided by n in the
accumulation type, as :func:`addnorm.ops.cpu.stats.row_stats` divides it.

The vector part is LLVM IR written here (:func:`_cascade`), because numba's own code for it stays scalar (the
lanes are loop-carried values, which LLVM's vectorizers do not pack): measured on this machine, a numba transcription
of the same order matched PyTorch bit for bit but summed at 10 GB/s against 30-40 for the IR. The scalar parts
(a handful of additions per row) are plain numba. Nothing here may be compiled with reassociation (``FAST``).

Tests: tests/ops/test_torch_order.py (``torch.sum`` bit for bit over row lengths through every branch, each storage
type; the kernels' RMSNorm against PyTorch's). Where PyTorch splits one long row across
threads (a single row of 32768 values or more with several threads), its own result depends on the thread count;
the kernels keep the serial order.
"""

from __future__ import annotations

from addnorm.ops.cpu.convert import cast_like, intrinsic, ir, load, njit, overload, types

__all__ = ["row_sum_sq"]

# the storage types of the kernels' arrays: bf16 travels as uint16 bits, fp16 as int16 bits (convert.py)
_STORAGE = ("float32", "float64", "uint16", "int16")


def _lanes(acc_type) -> int:
    return 8 if acc_type == types.float32 else 4


@intrinsic
def _cascade_sum_sq(typingctx, h, nvec, start):
    """The module docstring's vector part over the first nvec vectors of row h (nvec * V values), summing squares;
    returns start plus the V lanes in order (the caller's start: the row's last n % V squares, summed from 0)."""
    if not (
        isinstance(h, types.Array)
        and h.ndim == 1
        and h.layout == "C"
        and str(h.dtype) in _STORAGE
        and start in (types.float32, types.float64)
        and isinstance(nvec, types.Integer)
    ):
        return None
    lanes = _lanes(start)

    def codegen(context, builder, sig, args):
        hty = sig.args[0]
        arr = context.make_array(hty)(context, builder, args[0])
        i64 = ir.IntType(64)
        acc = ir.FloatType() if lanes == 8 else ir.DoubleType()
        vacc = ir.VectorType(acc, lanes)
        kind = str(hty.dtype)
        elem = {"float32": ir.FloatType(), "float64": ir.DoubleType()}.get(kind, ir.IntType(16))
        velem = ir.VectorType(elem, lanes)
        nvec = builder.sext(args[1], i64) if args[1].type.width < 64 else args[1]
        zero = ir.Constant(vacc, [0.0] * lanes)

        def c(v):
            return ir.Constant(i64, v)

        def vector(index):
            """The squares of vector ``index`` of the row (values index*V ..), converted as ``load`` converts."""
            ptr = builder.bitcast(builder.gep(arr.data, [builder.mul(index, c(lanes))]), velem.as_pointer())
            v = builder.load(ptr, align={"float32": 4, "float64": 8}.get(kind, 2))
            if kind == "uint16":  # bf16: the high half of a float32
                v = builder.shl(
                    builder.zext(v, ir.VectorType(ir.IntType(32), lanes)),
                    ir.Constant(ir.VectorType(ir.IntType(32), lanes), [16] * lanes),
                )
                v = builder.bitcast(v, ir.VectorType(ir.FloatType(), lanes))
            elif kind == "int16":
                v = builder.fpext(
                    builder.bitcast(v, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(ir.FloatType(), lanes)
                )
            if v.type != vacc:
                v = builder.fpext(v, vacc)
            return builder.fmul(v, v)

        def add_row(accs, row):
            return [builder.fadd(a, vector(builder.add(builder.mul(row, c(4)), c(k)))) for k, a in enumerate(accs)]

        # rows of 4 vectors, and the cascade's step: computed once, in IR like the rest
        rows = builder.sdiv(nvec, c(4))
        at_least_1 = builder.select(builder.icmp_signed("<", rows, c(1)), c(1), rows)
        log2 = builder.sub(c(64), builder.ctlz(builder.sub(at_least_1, c(1)), ir.Constant(ir.IntType(1), 0)))
        power = builder.select(builder.icmp_signed(">", builder.sdiv(log2, c(4)), c(4)), builder.sdiv(log2, c(4)), c(4))
        step = builder.shl(c(1), power)
        mask = builder.sub(step, c(1))
        mask1, mask2 = builder.shl(mask, power), builder.shl(mask, builder.add(power, power))

        pre = builder.block
        fn = builder.function
        outer = fn.append_basic_block("cascade.outer")
        inner_pre = fn.append_basic_block("cascade.inner_pre")
        inner = fn.append_basic_block("cascade.inner")
        inner_body = fn.append_basic_block("cascade.inner_body")
        flush = fn.append_basic_block("cascade.flush")
        rest = fn.append_basic_block("cascade.rest")
        rest_body = fn.append_basic_block("cascade.rest_body")
        fold = fn.append_basic_block("cascade.fold")
        left = fn.append_basic_block("cascade.left")
        left_body = fn.append_basic_block("cascade.left_body")
        done = fn.append_basic_block("cascade.done")
        builder.branch(outer)

        # outer: whole steps of rows; levels 1-3 carried
        builder.position_at_end(outer)
        i = builder.phi(i64)
        lv = [[builder.phi(vacc) for _ in range(4)] for _ in range(3)]
        i.add_incoming(c(0), pre)
        for level in lv:
            for p in level:
                p.add_incoming(zero, pre)
        builder.cbranch(builder.icmp_signed("<=", builder.add(i, step), rows), inner_pre, rest)

        builder.position_at_end(inner_pre)
        builder.branch(inner)
        builder.position_at_end(inner)
        j = builder.phi(i64)
        l0 = [builder.phi(vacc) for _ in range(4)]
        j.add_incoming(c(0), inner_pre)
        for p in l0:
            p.add_incoming(zero, inner_pre)
        builder.cbranch(builder.icmp_signed("<", j, step), inner_body, flush)
        builder.position_at_end(inner_body)
        new0 = add_row(l0, builder.add(i, j))
        j.add_incoming(builder.add(j, c(1)), inner_body)
        for p, v in zip(l0, new0):
            p.add_incoming(v, inner_body)
        builder.branch(inner)

        # flush: level 0 into 1; 1 into 2 when i is a multiple of step^2; 2 into 3 at step^3
        builder.position_at_end(flush)
        i2 = builder.add(i, step)
        up1 = builder.icmp_signed("==", builder.and_(i2, mask1), c(0))
        up2 = builder.and_(up1, builder.icmp_signed("==", builder.and_(i2, mask2), c(0)))
        a1 = [builder.fadd(a, b) for a, b in zip(lv[0], l0)]
        a2 = [builder.fadd(a, b) for a, b in zip(lv[1], a1)]
        a1 = [builder.select(up1, zero, a) for a in a1]
        a2 = [builder.select(up1, b, a) for a, b in zip(lv[1], a2)]
        a3 = [builder.fadd(a, b) for a, b in zip(lv[2], a2)]
        a2 = [builder.select(up2, zero, a) for a in a2]
        a3 = [builder.select(up2, b, a) for a, b in zip(lv[2], a3)]
        i.add_incoming(i2, flush)
        for level, new in zip(lv, (a1, a2, a3)):
            for p, v in zip(level, new):
                p.add_incoming(v, flush)
        builder.branch(outer)

        # rest: the rows after the last whole step, into a fresh level 0
        builder.position_at_end(rest)
        r = builder.phi(i64)
        b0 = [builder.phi(vacc) for _ in range(4)]
        r.add_incoming(i, outer)
        for p in b0:
            p.add_incoming(zero, outer)
        builder.cbranch(builder.icmp_signed("<", r, rows), rest_body, fold)
        builder.position_at_end(rest_body)
        newb = add_row(b0, r)
        r.add_incoming(builder.add(r, c(1)), rest_body)
        for p, v in zip(b0, newb):
            p.add_incoming(v, rest_body)
        builder.branch(rest)

        # left: levels folded into level 0, then the vectors after the rows into its first vector
        builder.position_at_end(fold)
        parts = [builder.fadd(builder.fadd(builder.fadd(b, x), y), z) for b, x, y, z in zip(b0, *lv)]
        after_rows = builder.mul(rows, c(4))
        builder.branch(left)
        builder.position_at_end(left)
        q = builder.phi(i64)
        first = builder.phi(vacc)
        q.add_incoming(after_rows, fold)
        first.add_incoming(parts[0], fold)
        builder.cbranch(builder.icmp_signed("<", q, nvec), left_body, done)
        builder.position_at_end(left_body)
        first.add_incoming(builder.fadd(first, vector(q)), left_body)
        q.add_incoming(builder.add(q, c(1)), left_body)
        builder.branch(left)

        builder.position_at_end(done)
        total = builder.fadd(builder.fadd(builder.fadd(first, parts[1]), parts[2]), parts[3])
        f = args[2]
        for lane in range(lanes):
            f = builder.fadd(f, builder.extract_element(total, ir.Constant(ir.IntType(32), lane)))
        return f

    return start(h, nvec, start), codegen


@njit(inline="always")
def _scalar_sum_sq(h, n, zero):
    """ATen's scalar form, for a row shorter than one vector: four running sums over groups of 4, the rest into the
    first, then the four in order."""
    p0 = p1 = p2 = p3 = zero
    groups = n // 4
    for g in range(groups):
        v0, v1 = cast_like(load(h, 4 * g), zero), cast_like(load(h, 4 * g + 1), zero)
        v2, v3 = cast_like(load(h, 4 * g + 2), zero), cast_like(load(h, 4 * g + 3), zero)
        p0, p1, p2, p3 = p0 + v0 * v0, p1 + v1 * v1, p2 + v2 * v2, p3 + v3 * v3
    for j in range(4 * groups, n):
        v = cast_like(load(h, j), zero)
        p0 += v * v
    return ((p0 + p1) + p2) + p3


def _vector_lanes(zero):
    """Values per 32-byte vector of the statistics dtype (zero's type); numba-only."""
    raise NotImplementedError


@overload(_vector_lanes, inline="always")
def _vector_lanes_impl(zero):
    lanes = _lanes(zero)
    return lambda zero: lanes


@njit(error_model="numpy", cache=True, nogil=True)
def row_sum_sq(h, n, zero):
    """The sum of h_j^2 over row h's n values in the statistics dtype (zero's type), in PyTorch's order:
    ``h.to(dtype).pow(2).sum()`` bit for bit."""
    lanes = _vector_lanes(zero)
    if n < lanes:
        return _scalar_sum_sq(h, n, zero)
    nvec = n // lanes
    f = zero
    for j in range(nvec * lanes, n):  # ATen adds the values after the last vector first, then the lanes
        v = cast_like(load(h, j), zero)
        f += v * v
    return _cascade_sum_sq(h, nvec, f)
