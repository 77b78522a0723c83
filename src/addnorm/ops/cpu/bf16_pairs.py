"""The bf16 forward of the fused norm-then-add ops (:mod:`addnorm.ops.cpu.norm_add_kernels`) for large calls: the
same arithmetic, the same bits, with the elementwise passes over bf16 pairs.

Why: the general kernels convert bf16 one value at a time (:mod:`addnorm.ops.cpu.convert`): LLVM vectorizes that,
but every vector of 8 values is widened from 16 to 32 bits and every store narrowed back (unpacks, packs, lane
permutes), which made the bf16 forward compute-bound at 4096 x 4096 while the fp32 one reached the streaming limit.
Here a row is viewed as uint32 words, each two bf16 values, and never leaves 32-bit lanes:

    the value of the low half  = float32 bits  w << 16        (the bf16 at the even index)
    the value of the high half = float32 bits  w & 0xFFFF0000 (the bf16 at the odd index)
    a pair stored              = rne(a) >> 16 | rne(b) & 0xFFFF0000,  rne(v) = v's bits + 0x7FFF + (bit 16 of them),
                                 NaN as 0x7FC0 (convert.py's ``store_rounded``, the same bits)

so a vector of 8 words is 16 values with shifts and masks, no shuffles. The weights and biases are split once per
call into their even and odd elements (:func:`split_pairs`), which meet the low and high halves in the same lanes.
Each value goes through the operations the general loops apply in the same order (no fused multiply-add: no
``fastmath``), so every value and every rounding is the same. The statistics are the general kernels' own
(:func:`~addnorm.ops.cpu.stats.guarded_row_stats`: the RMSNorm sum of squares in PyTorch's order, the guard), and so
are the rows the pairs do not serve: a row the guard rescaled, and a row whose arrays disagree on 4-byte alignment
(strided rows). The pairs go in whole blocks of one cache line (16 words); a row starting at an odd element does its
first value on the general loop, and the values after the last whole block (up to 31 pairs and an odd one) go to
the general loop too.

In ``norm_add_norm`` the norm-add pass stores h without pack's NaN selects (:func:`pack_raw`: ~15% of that
pass): a NaN then keeps its sign. h's statistics, which N2 takes next, are NaN exactly when h holds a NaN, and
only then :func:`_canonical_nans` makes the row's NaNs 0x7FC0 and the statistics are taken again (the same bits).
N2's pass stores without the selects too where no NaN can arise: an ordinary row (the guard's test on h's
statistics) and finite N2 weights and biases (the launch tests them once a call); other rows take the general
loop, which stores NaNs as 0x7FC0.

Each call kind (the nine flags and in place or not) has its own driver, compiled on its first call with the flags
as constants (:func:`_driver`), so a kind's compile holds one block loop per pass: with the flags as arguments one
compile held every kind's loops (54 copies), and numba's inlining took 14 minutes before a first large bf16 call
returned (2026-12-04, 855 s for ``norm_add_``; now 5-15 s, the general row functions included). numba's cache keeps
the kinds apart: its key includes a closure's values.

While working on row i, the rows a thread does next (y and the residual, ``PREFETCH_ROWS`` ahead) are prefetched
a cache line at a time between the elementwise blocks: without it each row's passes wait on DRAM in turn, the
hardware prefetcher restarting at every 4 KB page.

The launch (:mod:`addnorm.ops.cpu.norm_add_launch`) takes this path for bf16 y, residual, h (and out2) with fp32
statistics and at least ``MIN_ELEMENTS`` values; smaller calls (decode) keep the general kernels.
tests/ops/test_bf16_pairs.py compares the two bit for bit. The word-level pieces (unpacking a word, rounding and
packing two values, the prefetch hint) are LLVM IR in :mod:`addnorm.ops.cpu.bf16_words`. After editing this file or
that one delete this file's ``__pycache__`` entries (*.nbi, *.nbc), as for the other kernel files.
"""

from __future__ import annotations

import numpy as np

from addnorm.ops.cpu.bf16_words import address, hi, lo, pack, pack_raw, prefetch, via_bf16
from addnorm.ops.cpu.convert import JIT, njit, prange, zero_of
from addnorm.ops.cpu.kernels import normalize_row, normalize_row_scaled
from addnorm.ops.cpu.norm_add_kernels import _norm_add_row, _norm_add_row_inplace, _norm_add_row_scaled
from addnorm.ops.cpu.stats import NOT_SCALED, guarded_row_stats, row_is_ordinary

__all__ = ["MIN_ELEMENTS", "PREFETCH_ROWS", "fwd_parallel", "fwd_serial", "split_pairs"]

# Values in a call (M * N) from which the launch takes this path: decode sizes keep the general kernels.
MIN_ELEMENTS = 1 << 20
# How many rows ahead a thread prefetches (compiled in: numba freezes module globals).
PREFETCH_ROWS = 2
# Words per elementwise block: 16 words = 32 bf16 values = one 64-byte cache line of each row.
_BLOCK = 16

# --------------------------------------------------------------------------------------------------------------
# The elementwise passes over pairs
# --------------------------------------------------------------------------------------------------------------


@njit(inline="always")
def _norm_add_blocks(y, r, h, Wa, Wb, Ba, Bb, nb, mean, rstd, has_w, has_b, cast, sub, canon, Pa, pa, Pb, pb):
    # _norm_add_loop of norm_add_kernels over nb blocks of one cache line per row, two values a word: the same
    # operations in the same order. The block has a constant trip count with the flags constant: LLVM vectorizes it
    # whole. After each block, one prefetch of each of the rows ahead (Pa[pa..], Pb[pb..])
    for q in range(nb):
        for k in range(q * _BLOCK, (q + 1) * _BLOCK):
            wy, wr = y[k], r[k]
            if sub:
                a, b = (lo(wy) - mean) * rstd, (hi(wy) - mean) * rstd
            else:  # RMSNorm: mean is +0.0 and v - 0.0 is v, bit for bit (-0.0 included; a NaN stays a NaN)
                a, b = lo(wy) * rstd, hi(wy) * rstd
            if cast:
                a, b = via_bf16(a), via_bf16(b)
            if has_w:
                a, b = a * Wa[k], b * Wb[k]
            if has_b:
                a, b = a + Ba[k], b + Bb[k]
            if canon:
                h[k] = pack(via_bf16(a) + lo(wr), via_bf16(b) + hi(wr))
            else:  # NaNs as they come (pack_raw)
                h[k] = pack_raw(via_bf16(a) + lo(wr), via_bf16(b) + hi(wr))
        prefetch(Pa, pa + 2 * q * _BLOCK)
        prefetch(Pb, pb + 2 * q * _BLOCK)


@njit(inline="always")
def _normalize_blocks(h, o, Wa, Wb, Ba, Bb, nb, mean, rstd, has_w, has_b, cast, sub, Pa, pa):
    # kernels._normalize_loop over nb blocks, two values a word, stored without the NaN selects: only for rows
    # where no NaN can arise (_fwd_row says when). After each block, one prefetch of a row ahead (Pa[pa..])
    for q in range(nb):
        for k in range(q * _BLOCK, (q + 1) * _BLOCK):
            wh = h[k]
            if sub:
                a, b = (lo(wh) - mean) * rstd, (hi(wh) - mean) * rstd
            else:
                a, b = lo(wh) * rstd, hi(wh) * rstd
            if cast:
                a, b = via_bf16(a), via_bf16(b)
            if has_w:
                a, b = a * Wa[k], b * Wb[k]
            if has_b:
                a, b = a + Ba[k], b + Bb[k]
            o[k] = pack_raw(a, b)
        prefetch(Pa, pa + 2 * q * _BLOCK)


# --------------------------------------------------------------------------------------------------------------
# Rows and drivers
# --------------------------------------------------------------------------------------------------------------


@njit(inline="always")
def _canonical_nans(h, n):
    """Every NaN of bf16 row h (uint16 bits) as 0x7FC0, the NaN every rounded store writes."""
    for j in range(n):
        if h[j] & np.uint16(0x7FFF) > np.uint16(0x7F80):
            h[j] = np.uint16(0x7FC0)


@njit(inline="always")
def _head(a):
    """1 when a's first value is the high half of a 4-byte word (the pairs start at its second value), else 0."""
    return np.int64((address(a) >> np.uint64(1)) & np.uint64(1))


@njit(inline="always")
def _split(D, q, L, hd, npairs):
    """The (low, high) halves' parts of split vector q (:func:`split_pairs`) for pairs from element hd."""
    ev, od = D[2 * q * L : 2 * q * L + L], D[(2 * q + 1) * L : (2 * q + 1) * L + L]
    if hd == 0:
        return ev[:npairs], od[:npairs]
    return od[:npairs], ev[1 : npairs + 1]


@njit(inline="always")
def _words(a, hd, npairs):
    return a[hd : hd + 2 * npairs].view(np.uint32)


@njit(inline="always")
def _fwd_row(
    i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, zero, pf, fin2
):
    # norm_add_kernels._fwd_row's arguments (bf16 rows, fp32 statistics) and D, the weights and biases split into
    # even and odd elements (split_pairs); rows the pairs do not serve take that module's loops. fin2: N2's weight
    # and bias are finite (or absent)
    is_rms1, has_w1, has_b1, cast1, has_norm2, is_rms2, has_w2, has_b2, cast2 = flags
    L = n // 2 + 1
    y = Y[i * sy : i * sy + n]
    r = R[i * sr : i * sr + n]
    h = H[i * sh : i * sh + n]
    ahead = np.int64(i) + pf  # (int64: prange's index may be unsigned)
    if ahead >= m:
        ahead = np.int64(i)
    py, pr = ahead * sy, ahead * sr
    # with N2, the rows ahead are prefetched half in each pass (y's in the norm-add pass, the residual's in N2's),
    # spread over the whole row rather than all in the first pass (the norm-add pass's second prefetch then asks
    # for the line its first just asked for: one instruction a cache line)
    pb = py if has_norm2 else pr
    Pb = Y if has_norm2 else R
    mean1, rstd1, k1, mean_s1, r1 = guarded_row_stats(y, n, is_rms1, eps1, zero)
    Stats[i], Stats[m + i] = mean1, rstd1
    hd = _head(y)
    if k1 != NOT_SCALED:  # a row the finite-range guard rescaled
        _norm_add_row_scaled(y, r, h, W1, B1, n, k1, mean_s1, r1, has_w1, has_b1, cast1, zero)
    elif hd != _head(r) or hd != _head(h):  # strided rows out of step: the general loops
        if in_place:
            _norm_add_row_inplace(y, h, W1, B1, n, mean1, rstd1, has_w1, has_b1, cast1, zero)
        else:
            _norm_add_row(y, r, h, W1, B1, n, mean1, rstd1, has_w1, has_b1, cast1, zero)
    else:
        # the pairs in whole blocks from element hd (a row starting at the high half of a word does its first
        # value alone), the values after the last block on the general loops: one inlined loop for the pass, so
        # that a call kind compiles in seconds
        nb = (n - hd) // (2 * _BLOCK)
        npairs = nb * _BLOCK
        e = hd + 2 * npairs  # the first value after the blocks
        if hd:
            _norm_add_row(y[:1], r[:1], h[:1], W1[:1], B1[:1], 1, mean1, rstd1, has_w1, has_b1, cast1, zero)
        Wa, Wb = _split(D, 0, L, hd, npairs)
        Ba, Bb = _split(D, 1, L, hd, npairs)
        y32, r32 = _words(y, hd, npairs), _words(r, hd, npairs)
        # in place, h is r itself: two arrays at one address fail LLVM's overlap test, and it runs the scalar loop
        # (5x slower). A cast without weight or bias rounds twice: a no-op
        h32 = r32 if in_place else _words(h, hd, npairs)
        c1 = cast1 and (has_w1 or has_b1)
        _norm_add_blocks(
            y32, r32, h32, Wa, Wb, Ba, Bb, nb, mean1, rstd1, has_w1, has_b1, c1, not is_rms1, not has_norm2,
            Y, py, Pb, pb,
        )  # fmt: skip
        if e < n:
            _norm_add_row(y[e:], r[e:], h[e:], W1[e:], B1[e:], n - e, mean1, rstd1, has_w1, has_b1, cast1, zero)
    if has_norm2:  # h is still in cache: its statistics and N2 cost no DRAM reads
        mean2, rstd2, k2, mean_s2, r2 = guarded_row_stats(h, n, is_rms2, eps2, zero)
        if rstd2 != rstd2 or mean2 != mean2:  # a NaN in h (or inf - inf in a sum): the NaNs the pass kept as they came
            _canonical_nans(h, n)
            mean2, rstd2, k2, mean_s2, r2 = guarded_row_stats(h, n, is_rms2, eps2, zero)
        Stats[2 * m + i], Stats[3 * m + i] = mean2, rstd2
        # an ordinary row (the guard's test: rstd2 in [2^-50, 2^50], so the sum of squares is finite, so is every
        # value of h and of h - mean2, and each |h - mean2| * rstd2 is at most ~sqrt(n)) with finite weights and
        # biases: no NaN can arise (no inf * 0, no inf - inf), N2's pass stores without the NaN selects
        canon2 = not (fin2 and row_is_ordinary(mean2, rstd2))
        o2 = O2[i * so2 : i * so2 + n]
        hd = _head(h)
        if k2 != NOT_SCALED:
            normalize_row_scaled(h, o2, W2, B2, n, k2, mean_s2, r2, has_w2, has_b2, cast2)
        elif canon2 or hd != _head(o2):  # (the general loops store NaNs as 0x7FC0)
            normalize_row(h, o2, W2, B2, n, mean2, rstd2, has_w2, has_b2, cast2, zero)
        else:
            nb = (n - hd) // (2 * _BLOCK)
            npairs = nb * _BLOCK
            e = hd + 2 * npairs
            if hd:
                normalize_row(h[:1], o2[:1], W2[:1], B2[:1], 1, mean2, rstd2, has_w2, has_b2, cast2, zero)
            Wa, Wb = _split(D, 2, L, hd, npairs)
            Ba, Bb = _split(D, 3, L, hd, npairs)
            c2 = cast2 and (has_w2 or has_b2)
            _normalize_blocks(
                _words(h, hd, npairs), _words(o2, hd, npairs), Wa, Wb, Ba, Bb, nb, mean2, rstd2, has_w2, has_b2, c2,
                not is_rms2, R, pr,
            )  # fmt: skip
            if e < n:
                normalize_row(h[e:], o2[e:], W2[e:], B2[e:], n - e, mean2, rstd2, has_w2, has_b2, cast2, zero)


# The drivers take norm_add_kernels.fwd_parallel's arguments plus D (split_pairs), pf (PREFETCH_ROWS) and fin2
# (N2's weight and bias finite: once a call, in the launch); fp32 statistics only. Each call kind (the flags and
# in_place) has its own compiled driver with them as constants, compiled on its first call: with the flags as
# arguments one compile held every kind's passes (54 copies of the block loop, 14 minutes of numba's inlining
# before a first bf16 call returned); one kind's driver compiles in seconds. numba's cache keeps each kind apart
# (its key includes a closure's values).
_DRIVERS: dict = {}  # (flags, in_place, parallel) -> that kind's compiled driver


def _driver(flags: tuple, in_place: bool, parallel: bool):
    key = (flags, in_place, parallel)
    if key not in _DRIVERS:  # (two threads racing here each make one: the same code, harmless)
        _DRIVERS[key] = _make_driver(flags, in_place, parallel)
    return _DRIVERS[key]


def _make_driver(flags: tuple, in_place: bool, parallel: bool):
    # two closures, not one compiled both ways: numba's cache key holds a closure's values and its code, not the
    # compile options, so one closure compiled with and without parallel=True would share cache entries
    if parallel:

        @njit(parallel=True, **JIT)
        def fwd_kind_parallel(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, eps1, eps2, pf, fin2):
            zero = zero_of(Stats)
            e1, e2 = np.float32(eps1), np.float32(eps2)
            for i in prange(m):
                _fwd_row(
                    i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, e1, e2,
                    zero, pf, fin2,
                )  # fmt: skip

        return fwd_kind_parallel

    @njit(**JIT)
    def fwd_kind_serial(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, eps1, eps2, pf, fin2):
        zero = zero_of(Stats)
        e1, e2 = np.float32(eps1), np.float32(eps2)
        for i in range(m):
            _fwd_row(
                i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, e1, e2,
                zero, pf, fin2,
            )  # fmt: skip

    return fwd_kind_serial


def _kind(flags) -> tuple:
    """The flags as the drivers' key: N2's flags are not read without N2 (one driver for every value of them)."""
    f = tuple(bool(v) for v in flags)
    return f if f[4] else f[:5] + (False,) * 4


def fwd_parallel(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, pf, fin2):
    """The forward over the rows in parallel (numba threads), the driver of this call's kind."""
    run = _driver(_kind(flags), bool(in_place), True)
    run(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, eps1, eps2, pf, fin2)


def fwd_serial(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, pf, fin2):
    """The forward over the rows in order, the driver of this call's kind."""
    run = _driver(_kind(flags), bool(in_place), False)
    run(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, eps1, eps2, pf, fin2)


def split_pairs(n: int, vectors) -> np.ndarray:
    """The weights and biases (w1, b1, w2, b2: fp32 arrays of n, or None) as _fwd_row's D: for each, its even
    elements then its odd ones, each in a region of n // 2 + 1 (absent vectors: zeros, never read)."""
    L = n // 2 + 1
    D = np.zeros(8 * L, np.float32)
    for q, v in enumerate(vectors):
        if v is not None:
            ev, od = v[0::2], v[1::2]
            D[2 * q * L : 2 * q * L + ev.size] = ev
            D[(2 * q + 1) * L : (2 * q + 1) * L + od.size] = od
    return D
