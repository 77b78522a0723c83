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
(strided rows). A row starting at an odd element (odd N) does its first value on the general loop, then pairs, and
an odd value left at the end on the general loop again.

In ``norm_add_norm`` the norm-add pass stores h without pack's NaN selects (:func:`pack_raw`: ~15% of that
pass): a NaN then keeps its sign. h's statistics, which N2 takes next, are NaN exactly when h holds a NaN, and
only then :func:`_canonical_nans` makes the row's NaNs 0x7FC0 and the statistics are taken again (the same bits).
N2's pass stores without the selects too where no NaN can arise: an ordinary row (the guard's test on h's
statistics) and finite N2 weights and biases (the launch tests them once a call); other rows keep pack.

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
def _norm_add_pairs(y, r, h, Wa, Wb, Ba, Bb, k0, k1, mean, rstd, has_w, has_b, cast, sub, canon):
    # _norm_add_loop of norm_add_kernels, two values a word: the same operations in the same order
    for k in range(k0, k1):
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


@njit(inline="always")
def _normalize_pairs(h, o, Wa, Wb, Ba, Bb, k0, k1, mean, rstd, has_w, has_b, cast, sub, canon):
    # kernels._normalize_loop, two values a word
    for k in range(k0, k1):
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
        if canon:
            o[k] = pack(a, b)
        else:  # a row where no NaN can arise (_fwd_row says when)
            o[k] = pack_raw(a, b)


@njit(inline="always")
def _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, add, canon, Pa, pa, Pb, pb):
    # blocks of one cache line per row, each followed by one prefetch of the rows ahead (Pa[pa..], Pb[pb..]); the
    # block loop has a constant trip count with the flags constant: LLVM vectorizes it whole
    nb = npairs // _BLOCK
    for q in range(nb):
        k0 = q * _BLOCK
        if add:
            _norm_add_pairs(x, r, out, Wa, Wb, Ba, Bb, k0, k0 + _BLOCK, mean, rstd, has_w, has_b, cast, sub, canon)
        else:
            _normalize_pairs(x, out, Wa, Wb, Ba, Bb, k0, k0 + _BLOCK, mean, rstd, has_w, has_b, cast, sub, canon)
        prefetch(Pa, pa + 2 * k0)
        prefetch(Pb, pb + 2 * k0)
    if add:
        _norm_add_pairs(x, r, out, Wa, Wb, Ba, Bb, nb * _BLOCK, npairs, mean, rstd, has_w, has_b, cast, sub, canon)
    else:
        _normalize_pairs(x, out, Wa, Wb, Ba, Bb, nb * _BLOCK, npairs, mean, rstd, has_w, has_b, cast, sub, canon)


@njit(inline="always")
def _unswitched(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, add, canon, Pa, pa, Pb, pb):
    # the flags as constants in each branch (a cast without weight or bias rounds twice: a no-op). sub False
    # (RMSNorm, mean +0.0) skips the subtraction: compiled for the bias-free cases only (RMSNorm's), to keep the
    # variants few
    if has_w and has_b:
        if cast:
            _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, True, True, True, True, add, canon, Pa, pa, Pb, pb)
        else:
            _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, True, True, False, True, add, canon, Pa, pa, Pb, pb)
    elif has_w:
        if cast:
            if sub:
                _pass(
                    x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, True, False, True, True, add, canon, Pa, pa, Pb, pb
                )
            else:
                _pass(
                    x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, True, False, True, False, add, canon, Pa, pa, Pb, pb
                )
        elif sub:
            _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, True, False, False, True, add, canon, Pa, pa, Pb, pb)
        else:
            _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, True, False, False, False, add, canon, Pa, pa, Pb, pb)
    elif has_b:
        if cast:
            _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, False, True, True, True, add, canon, Pa, pa, Pb, pb)
        else:
            _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, False, True, False, True, add, canon, Pa, pa, Pb, pb)
    elif sub:
        _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, False, False, False, True, add, canon, Pa, pa, Pb, pb)
    else:
        _pass(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, False, False, False, False, add, canon, Pa, pa, Pb, pb)


@njit(inline="always")
def _kinds(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, add, canon, Pa, pa, Pb, pb):
    # canon as a constant too (add is one where _pairs calls this): a branch on it in the block loop cost norm_add_
    # ~4% in cache
    if canon:
        _unswitched(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, add, True, Pa, pa, Pb, pb)
    else:
        _unswitched(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, add, False, Pa, pa, Pb, pb)


@njit(**JIT)
def _pairs(
    x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, add, in_place, canon, Pa, pa, Pb, pb
):
    """One elementwise pass over npairs words: norm-add (add: out = pairs of round(N1(x)) + r) or normalize
    (out = N2(x), r unused). sub: subtract the mean (False: RMSNorm). canon False: stores without the NaN selects
    (:func:`pack_raw`; the norm-add pass's caller makes the NaNs 0x7FC0, the normalize pass's has none). in_place
    (norm-add only): out is r, passed on as one array (two arrays at one address, LLVM's overlap test fails and it
    runs the scalar loop: 5x slower). Six variants of the block loop for each flag set: add in place or not, and
    normalize, each with canon True and False."""
    if not add:
        _kinds(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, False, canon, Pa, pa, Pb, pb)
    elif in_place:
        _kinds(x, r, r, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, True, canon, Pa, pa, Pb, pb)
    else:
        _kinds(x, r, out, Wa, Wb, Ba, Bb, npairs, mean, rstd, has_w, has_b, cast, sub, True, canon, Pa, pa, Pb, pb)


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


@njit(**JIT)
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
    # spread over the whole row rather than all in the first pass; the second prefetch of a pass then asks for a
    # line the first just asked for (one instruction a cache line)
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
        npairs = (n - hd) // 2
        e = hd + 2 * npairs  # the first value after the pairs
        if hd:
            _norm_add_row(y[:1], r[:1], h[:1], W1[:1], B1[:1], 1, mean1, rstd1, has_w1, has_b1, cast1, zero)
        Wa, Wb = _split(D, 0, L, hd, npairs)
        Ba, Bb = _split(D, 1, L, hd, npairs)
        y32, r32 = _words(y, hd, npairs), _words(r, hd, npairs)
        h32 = r32 if in_place else _words(h, hd, npairs)
        _pairs(
            y32, r32, h32, Wa, Wb, Ba, Bb, npairs, mean1, rstd1, has_w1, has_b1,
            cast1, not is_rms1, True, in_place, not has_norm2, Y, py, Pb, pb,
        )  # fmt: skip
        if e < n:
            _norm_add_row(y[e:], r[e:], h[e:], W1[e:], B1[e:], 1, mean1, rstd1, has_w1, has_b1, cast1, zero)
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
        elif hd != _head(o2):
            normalize_row(h, o2, W2, B2, n, mean2, rstd2, has_w2, has_b2, cast2, zero)
        else:
            npairs = (n - hd) // 2
            e = hd + 2 * npairs
            if hd:
                normalize_row(h[:1], o2[:1], W2[:1], B2[:1], 1, mean2, rstd2, has_w2, has_b2, cast2, zero)
            Wa, Wb = _split(D, 2, L, hd, npairs)
            Ba, Bb = _split(D, 3, L, hd, npairs)
            h32, o32 = _words(h, hd, npairs), _words(o2, hd, npairs)
            _pairs(
                h32, h32, o32, Wa, Wb, Ba, Bb, npairs, mean2, rstd2, has_w2, has_b2,
                cast2, not is_rms2, False, False, canon2, R, pr, R, pr,
            )  # fmt: skip
            if e < n:
                normalize_row(h[e:], o2[e:], W2[e:], B2[e:], 1, mean2, rstd2, has_w2, has_b2, cast2, zero)


# The drivers take norm_add_kernels.fwd_parallel's arguments plus D (split_pairs), pf (PREFETCH_ROWS) and fin2
# (N2's weight and bias finite: once a call, in the launch); fp32 statistics only.
@njit(parallel=True, **JIT)
def fwd_parallel(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, pf, fin2):
    zero = zero_of(Stats)
    eps1, eps2 = np.float32(eps1), np.float32(eps2)
    for i in prange(m):
        _fwd_row(
            i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, zero, pf, fin2
        )


@njit(**JIT)
def fwd_serial(Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, pf, fin2):
    zero = zero_of(Stats)
    eps1, eps2 = np.float32(eps1), np.float32(eps2)
    for i in range(m):
        _fwd_row(
            i, Y, sy, R, sr, H, sh, O2, so2, W1, B1, W2, B2, D, Stats, m, n, flags, in_place, eps1, eps2, zero, pf, fin2
        )


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
