"""Wide rows by teams: K programs share one row, each holding a chunk of CHUNK columns in registers (the kernels;
:mod:`addnorm.ops.triton.team_launch` chooses K and launches them).

Per row, program k of the team computes its chunk's partial statistics and publishes them:
    forward   RMSNorm: s_k = sum(h^2);   LayerNorm: s_k = sum(h), m2_k = sum((h - s_k / n_k)^2)  (Chan's partials)
    backward  s1_k = sum(g * xhat);      LayerNorm also s2_k = sum(g)
then the K partials are combined in the fixed order k = 0, 1, ..., K - 1 (one scalar add after another, so no
reduction tree that a layout or warp count could reorder), giving the row's statistics bit for bit the same in
every program of the team, whichever arrives first:
    RMSNorm   var = (s_0 + ... + s_{K-1}) / N
    LayerNorm mean = (s_0 + ... + s_{K-1}) / N,  M2 = sum_k m2_k + n_k * (s_k / n_k - mean)^2  (Chan et al.,
              the K-way form of the pairwise merge: exact, no E[h^2] - E[h]^2 cancellation), var = M2 / N
and every program normalizes (or finishes dx) from its own registers.

Two ways to meet, the same helpers:
- ``*_team_kernel`` (GPU): a persistent grid of teams, all programs resident (cooperative launch); a program
  publishes into a double-buffered workspace slot (team, row parity), arrives on that slot's counter and spins
  until the whole team has arrived; one pass over the row: 4 units of traffic forward and backward;
- ``*_partials_kernel`` then ``*_finish_kernel`` (Triton's interpreter, which runs programs one after another, so a
  spin-wait would never end; and ``WideTuning(fallback=True)`` on a GPU): the partials go to an (M, K) workspace,
  and a second kernel reads the chunk again, combines the same partials with the same helper and finishes.
The partials, their combination and the finishing arithmetic are the same functions in both, so the fallback gives
the team kernel's bits by construction (checked on a GPU by tests/ops/test_triton_team.py).

No atomics but the team counters (integers): dw/db are partial rows (one per team or row group) summed afterwards.
"""

from __future__ import annotations

from addnorm.ops.triton.elementwise import affine, dropout, dweight_term, jit, load_weight, round_to, tl
from addnorm.ops.triton.row_stats import (
    pow2,
    rsqrt,
    saved_rstd_fail,
    scale_exponent,
    scaled_looped_bwd_stats_inline,
)

# --------------------------------------------------------------------------------------------------------------
# Shared helpers: the math both ways run
# --------------------------------------------------------------------------------------------------------------


@jit
def _chunk_count(k, N, CHUNK: tl.constexpr):
    """Columns of the row in chunk k (0 for chunks past the row's end: N = 96 at K = 8 leaves two empty)."""
    return tl.minimum(tl.maximum(N - k * CHUNK, 0), CHUNK)


@jit
def _fwd_h(
    X, R, ResOut, row, cols, ok, stride_x, stride_r, N, Seed, keep_threshold, scale_hi, scale_mid, scale_lo,
    acc_t: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, ROUND_TO_RES: tl.constexpr,
    STORE: tl.constexpr, SEED_OFFSET: tl.constexpr,
):  # fmt: skip
    """The chunk's h = keep * x * scale + residual, rounded to residual_out's dtype (ROUND_TO_RES) and stored when
    STORE: the value the statistics and the normalization see, as the rows kernel computes it."""
    h = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(acc_t)
    if HAS_DROPOUT:
        h = dropout(h, row * N + cols, Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET)
    if HAS_RESIDUAL:
        h += tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(acc_t)
    if ROUND_TO_RES:
        stored = round_to(h, ResOut.dtype.element_ty)
        if STORE:
            tl.store(ResOut + row * N + cols, stored, mask=ok)
        h = stored.to(acc_t)
    return h


@jit
def _chunk_partials(h, ok, n_k, IS_RMS: tl.constexpr):
    """(sum h^2, 0) or (sum h, M2 about the chunk's mean) of a chunk."""
    if IS_RMS:
        s = tl.sum(h * h, axis=0)
        m2 = s * 0.0
    else:
        s = tl.sum(h, axis=0)
        d = tl.where(ok, h - s / tl.maximum(n_k, 1).to(h.dtype), 0.0)
        m2 = tl.sum(d * d, axis=0)
    return s, m2


@jit
def _chunk_fails(s, m2, n_k, eps, IS_RMS: tl.constexpr):
    """Whether a chunk's plain partials are out of range: its mean square beyond 2^100 (the K-way sums could
    overflow), NaN, or below TINY when eps does not dominate (row_stats' bound, chunk by chunk)."""
    n = tl.maximum(n_k, 1).to(s.dtype)
    if IS_RMS:
        q = s / n
    else:
        q = (s / n) * (s / n) + m2 / n
    big = pow2(tl.full([], 900 if s.dtype == tl.float64 else 100, tl.int32), s.dtype)
    tiny = pow2(tl.full([], -968 if s.dtype == tl.float64 else -102, tl.int32), s.dtype)
    lo = tl.where(eps < tiny, tiny, 0.0)
    return ((q < lo) | (q > big) | (q != q)) & (n_k > 0)


@jit
def _fwd_publish(WS, slot, k, h, ok, n_k, eps, IS_RMS: tl.constexpr):
    """Write chunk k's partials of h * 2^e and e into workspace slot ``slot`` (K triples: (sum h^2, -, e) or
    (sum h, M2 about its mean, e)); e = 0 unless the chunk's plain partials are out of range, when e brings its
    largest |h| to [1, 2) (row_stats.scale_exponent; a chunk of zeros takes the largest e, so it never sets the
    row's scale)."""
    s, m2 = _chunk_partials(h, ok, n_k, IS_RMS)
    e = tl.full([], 0, tl.int32)
    if _chunk_fails(s, m2, n_k, eps, IS_RMS):  # rare
        s, m2, e = _scaled_chunk_partials(h, ok, n_k, eps, IS_RMS)
    tl.store(WS + slot + 3 * k, s)
    if not IS_RMS:
        tl.store(WS + slot + 3 * k + 1, m2)
    tl.store(WS + slot + 3 * k + 2, e.to(s.dtype))


@jit
def _scaled_chunk_partials(h, ok, n_k, eps, IS_RMS: tl.constexpr):
    """(s, m2, e): the chunk's partials of h * 2^e, e from its largest |h| (a chunk of zeros: the largest e)."""
    amax = tl.max(tl.where(ok, tl.abs(h), 0.0), axis=0)
    e = scale_exponent(tl.where(amax > 0, amax, pow2(tl.full([], -126, tl.int32), h.dtype)), eps)
    s, m2 = _chunk_partials(h * pow2(e, h.dtype), ok, n_k, IS_RMS)
    return s, m2, e


@jit
def _align(d, acc_t: tl.constexpr):
    """2^d for an exponent difference d <= 0 (as two factors: d may pass the normal range; it then underflows)."""
    LIM: tl.constexpr = 1022 if acc_t == tl.float64 else 126
    d1 = tl.maximum(d, -LIM)
    return pow2(d1, acc_t) * pow2(tl.maximum(d - d1, -LIM), acc_t)


@jit
def _fwd_combine(
    WS, slot, N, eps, K: tl.constexpr, CHUNK: tl.constexpr, IS_RMS: tl.constexpr, VOLATILE: tl.constexpr
):  # fmt: skip
    """(mean_s, rstd_s, sc, mean, rstd) of the row from its K partials, each brought to the team's smallest e
    (sc = 2^e), combined in the fixed order 0, 1, ..., K - 1: xhat = (h * sc - mean_s) * rstd_s; mean and rstd are
    the row's statistics to save (row_stats). When every e is 0 (ordinary rows) every factor is 1: the plain sums."""
    acc_t: tl.constexpr = eps.dtype
    e_min = tl.load(WS + slot + 2, volatile=VOLATILE).to(tl.int32)
    for k in range(1, K):  # a loop, not unrolled: K loads in flight would hold K registers
        e_min = tl.minimum(e_min, tl.load(WS + slot + 3 * k + 2, volatile=VOLATILE).to(tl.int32))
    total = eps * 0.0
    for k in range(K):
        f = _align(e_min - tl.load(WS + slot + 3 * k + 2, volatile=VOLATILE).to(tl.int32), acc_t)
        if IS_RMS:
            total += tl.load(WS + slot + 3 * k, volatile=VOLATILE) * f * f
        else:
            total += tl.load(WS + slot + 3 * k, volatile=VOLATILE) * f
    mean = total / N
    if IS_RMS:
        var = mean
        mean = mean * 0.0
    else:
        m2 = mean * 0.0
        for k in range(K):
            f = _align(e_min - tl.load(WS + slot + 3 * k + 2, volatile=VOLATILE).to(tl.int32), acc_t)
            n_k = _chunk_count(k, N, CHUNK).to(acc_t)
            delta = tl.load(WS + slot + 3 * k, volatile=VOLATILE) * f / tl.maximum(n_k, 1.0) - mean
            m2 += tl.load(WS + slot + 3 * k + 1, volatile=VOLATILE) * f * f + n_k * delta * delta
        var = m2 / N
    sc = pow2(e_min, acc_t)
    v = var + eps * sc * sc
    rstd = rsqrt(v)
    flat = (v == 0) & (eps > 0.0 * v)  # as in row_stats.scaled_rows_fwd
    rstd_saved = tl.where(flat, rsqrt(eps), rstd * sc)
    return mean, tl.where(flat, 0.0, rstd), sc, mean * pow2(-e_min, acc_t), rstd_saved


@jit
def _fwd_finish(
    Out, W, B, Mean, Rstd, row, k, cols, ok, h, stats, N, acc_t: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    STORE_STATS: tl.constexpr,
):  # fmt: skip
    """out = (h * sc - mean_s) * rstd_s (* w + b) for the chunk, ``stats`` being _fwd_combine's; the team's first
    program stores the row's statistics."""
    mean_s, rstd_s, sc, mean, rstd = stats
    if STORE_STATS:
        if k == 0:
            tl.store(Rstd + row, rstd)
            if not IS_RMS:
                tl.store(Mean + row, mean)
    if sc != 1.0:  # a row beyond the plain statistics' range (row_stats): rare
        h = h * sc
    y = affine((h - mean_s) * rstd_s, W, B, cols, ok, acc_t, Out.dtype.element_ty, HAS_WEIGHT, HAS_BIAS,
               ZERO_CENTERED, CAST_BEFORE_WEIGHT)  # fmt: skip
    tl.store(Out + row * N + cols, round_to(y, Out.dtype.element_ty), mask=ok)


@jit
def _bwd_terms(DOut, H, Mean, Rstd, w, row, cols, ok, stride_dout, stride_h, N, acc_t: tl.constexpr,
               IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """(dy, xhat, g = dy * w, rstd_s, sc) of the chunk: xhat = (h * sc - mean_s) * rstd_s. sc = 1 but for a row the
    forward normalized with the scaled pass, whose statistics every program of the team recomputes from the whole
    row (row_stats; h is an input of the backward, so rereading it is safe)."""
    h = tl.load(H + row * stride_h + cols, mask=ok, other=0.0).to(acc_t)
    dy = tl.load(DOut + row * stride_dout + cols, mask=ok, other=0.0).to(acc_t)
    rstd = tl.load(Rstd + row)
    if IS_RMS:
        mean = rstd * 0.0
    else:
        mean = tl.load(Mean + row)
    sc = rstd * 0.0 + 1.0
    if saved_rstd_fail(rstd):  # rare
        TILE: tl.constexpr = CHUNK if CHUNK < 512 else 512  # small tiles: few registers for the rare path
        sc, mean, rstd = scaled_looped_bwd_stats_inline(H + row * stride_h, N, rstd, IS_RMS, TILE)
        h = h * sc
    if IS_RMS:
        xhat = h * rstd
    else:
        xhat = tl.where(ok, (h - mean) * rstd, 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * w
    return dy, xhat, g, rstd, sc


@jit
def _bwd_publish(WS, slot, k, g, xhat, IS_RMS: tl.constexpr):
    tl.store(WS + slot + 2 * k, tl.sum(g * xhat, axis=0))
    if not IS_RMS:
        tl.store(WS + slot + 2 * k + 1, tl.sum(g, axis=0))


@jit
def _bwd_combine(WS, slot, N, K: tl.constexpr, IS_RMS: tl.constexpr, VOLATILE: tl.constexpr):
    """(mean_j(g * xhat), mean_j(g)) of the row from its K partials, in the fixed order 0, 1, ..., K - 1."""
    s1 = tl.load(WS + slot, volatile=VOLATILE)
    for k in range(1, K):  # a loop, not unrolled: K loads in flight would hold K registers
        s1 += tl.load(WS + slot + 2 * k, volatile=VOLATILE)
    s2 = s1 * 0.0
    if not IS_RMS:
        s2 = tl.load(WS + slot + 1, volatile=VOLATILE)
        for k in range(1, K):  # a loop, not unrolled: K loads in flight would hold K registers
            s2 += tl.load(WS + slot + 2 * k + 1, volatile=VOLATILE)
    return s1 / N, s2 / N


@jit
def _bwd_finish(
    DResOut, DX, DRes, row, cols, ok, g, xhat, rstd, sc, c1, c2, stride_dres_out, N, Seed, keep_threshold, scale_hi,
    scale_mid, scale_lo, acc_t: tl.constexpr, HAS_DRES_OUT: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr, SEED_OFFSET: tl.constexpr,
):  # fmt: skip
    """dh = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dresidual_out): dresidual, then dx through dropout
    (rstd_s, then sc: the true size last, row_stats)."""
    if IS_RMS:
        dh = (g - xhat * c1) * rstd
    else:
        dh = (g - c2 - xhat * c1) * rstd
    if sc != 1.0:
        dh = dh * sc
    if HAS_DRES_OUT:
        dh += tl.load(DResOut + row * stride_dres_out + cols, mask=ok, other=0.0).to(acc_t)
    if STORE_DRES:
        tl.store(DRes + row * N + cols, round_to(dh, DRes.dtype.element_ty), mask=ok)
    if HAS_DROPOUT:
        dh = dropout(dh, row * N + cols, Seed, keep_threshold, scale_hi, scale_mid, scale_lo, SEED_OFFSET)
    tl.store(DX + row * N + cols, round_to(dh, DX.dtype.element_ty), mask=ok)


@jit
def _team_meet(Flags, slot, target):
    """Arrive on the team's counter for this slot and wait until it reaches ``target`` (K arrivals per use of the
    slot: counters only grow, so a slot is reused without a reset). The barrier before the release makes every
    thread's partial store part of what the arrival publishes; the acquire loads order the reads after it."""
    tl.debug_barrier()
    tl.atomic_add(Flags + slot, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(Flags + slot, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(Flags + slot, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


# --------------------------------------------------------------------------------------------------------------
# Forward kernels. Arguments: fwd_rows_kernel's (kernels.py), then the workspace (and the team counters).
# --------------------------------------------------------------------------------------------------------------


@jit
def fwd_team_kernel(
    X, R, W, B, Out, ResOut, Mean, Rstd, stride_x, stride_r, M, N, eps_hi, eps_lo, Seed, keep_threshold, scale_hi,
    scale_mid, scale_lo,
    WS,  # (teams, 2, K, 3) acc: each team's two slots of K partial triples (double-buffered by row parity)
    Flags,  # (teams, 2) int32, zeroed: arrivals per slot
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, SEED_OFFSET: tl.constexpr, STORE_STATS: tl.constexpr,
    K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # program pid is chunk pid % K of team pid // K; team t takes rows t, t + teams, ...: its K programs walk the
    # same rows in the same order, and the slot of the i-th row is reused at row i + 2 only after the team met at
    # row i + 1, which every program reaches after it has read row i's partials
    acc_t = Rstd.dtype.element_ty
    pid = tl.program_id(0)
    k = pid % K
    team = pid // K
    teams = tl.num_programs(0) // K
    cols = k * CHUNK + tl.arange(0, CHUNK)
    ok = cols < N
    n_k = _chunk_count(k, N, CHUNK)
    eps = tl.cast(eps_hi, acc_t) + tl.cast(eps_lo, acc_t)
    i = 0
    for r in range(team, M, teams):
        row = tl.cast(r, tl.int64)
        slot = team * 2 + i % 2
        h = _fwd_h(X, R, ResOut, row, cols, ok, stride_x, stride_r, N, Seed, keep_threshold, scale_hi, scale_mid,
                   scale_lo, acc_t, HAS_RESIDUAL, HAS_DROPOUT, STORE_RESIDUAL_OUT, True, SEED_OFFSET)  # fmt: skip
        _fwd_publish(WS, slot * 3 * K, k, h, ok, n_k, eps, IS_RMS)
        _team_meet(Flags, slot, K * (i // 2 + 1))
        stats = _fwd_combine(WS, slot * 3 * K, N, eps, K, CHUNK, IS_RMS, True)
        _fwd_finish(Out, W, B, Mean, Rstd, row, k, cols, ok, h, stats, N, acc_t, IS_RMS, HAS_WEIGHT, HAS_BIAS,
                    ZERO_CENTERED, CAST_BEFORE_WEIGHT, STORE_STATS)  # fmt: skip
        i += 1


@jit
def fwd_partials_kernel(
    X, R, W, B, Out, ResOut, Mean, Rstd, stride_x, stride_r, M, N, eps_hi, eps_lo, Seed, keep_threshold, scale_hi,
    scale_mid, scale_lo,
    WS,  # (M, K, 3) acc: the partials of every row
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, SEED_OFFSET: tl.constexpr, STORE_STATS: tl.constexpr,
    K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # program (row, k): the fallback's first half, residual_out and the partials of chunk k
    acc_t = Rstd.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    cols = k * CHUNK + tl.arange(0, CHUNK)
    ok = cols < N
    h = _fwd_h(X, R, ResOut, row, cols, ok, stride_x, stride_r, N, Seed, keep_threshold, scale_hi, scale_mid,
               scale_lo, acc_t, HAS_RESIDUAL, HAS_DROPOUT, STORE_RESIDUAL_OUT, True, SEED_OFFSET)  # fmt: skip
    eps = tl.cast(eps_hi, acc_t) + tl.cast(eps_lo, acc_t)
    _fwd_publish(WS, row * 3 * K, k, h, ok, _chunk_count(k, N, CHUNK), eps, IS_RMS)


@jit
def fwd_finish_kernel(
    X, R, W, B, Out, ResOut, Mean, Rstd, stride_x, stride_r, M, N, eps_hi, eps_lo, Seed, keep_threshold, scale_hi,
    scale_mid, scale_lo,
    WS,  # (M, K, 3) acc: fwd_partials_kernel's partials
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, SEED_OFFSET: tl.constexpr, STORE_STATS: tl.constexpr,
    K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # program (row, k): the fallback's second half. h again: residual_out as stored, or x (+ residual) recomputed
    # by the same helper when residual_out is not stored; out may be x (in place): each element is read by the
    # thread that then writes it
    acc_t = Rstd.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    cols = k * CHUNK + tl.arange(0, CHUNK)
    ok = cols < N
    if STORE_RESIDUAL_OUT:
        h = tl.load(ResOut + row * N + cols, mask=ok, other=0.0).to(acc_t)
    else:
        h = _fwd_h(X, R, ResOut, row, cols, ok, stride_x, stride_r, N, Seed, keep_threshold, scale_hi, scale_mid,
                   scale_lo, acc_t, HAS_RESIDUAL, HAS_DROPOUT, False, False, SEED_OFFSET)  # fmt: skip
    eps = tl.cast(eps_hi, acc_t) + tl.cast(eps_lo, acc_t)
    stats = _fwd_combine(WS, row * 3 * K, N, eps, K, CHUNK, IS_RMS, False)
    _fwd_finish(Out, W, B, Mean, Rstd, row, k, cols, ok, h, stats, N, acc_t, IS_RMS, HAS_WEIGHT, HAS_BIAS,
                ZERO_CENTERED, CAST_BEFORE_WEIGHT, STORE_STATS)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Backward kernels. Arguments: bwd_rows_kernel's (kernels.py), then the workspace (and the team counters).
# --------------------------------------------------------------------------------------------------------------


@jit
def bwd_team_kernel(
    DOut, DResOut, H, W, Mean, Rstd, DX, DRes,
    DWPart, DBPart,  # (teams, N) acc: each team's partial sums of dout * xhat and dout
    stride_dout, stride_dres_out, stride_h, M, N, Seed, keep_threshold, scale_hi, scale_mid, scale_lo,
    WS,  # (teams, 2, K, 2) acc
    Flags,  # (teams, 2) int32, zeroed
    HAS_DRES_OUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DB: tl.constexpr, IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, SEED_OFFSET: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    acc_t = Rstd.dtype.element_ty
    pid = tl.program_id(0)
    k = pid % K
    team = pid // K
    teams = tl.num_programs(0) // K
    cols = k * CHUNK + tl.arange(0, CHUNK)
    ok = cols < N
    w = tl.zeros([CHUNK], dtype=acc_t)
    if HAS_WEIGHT:
        w = load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
    dw_acc = tl.zeros([CHUNK], dtype=acc_t)
    db_acc = tl.zeros([CHUNK], dtype=acc_t)
    i = 0
    for r in range(team, M, teams):
        row = tl.cast(r, tl.int64)
        slot = team * 2 + i % 2
        dy, xhat, g, rstd, sc = _bwd_terms(DOut, H, Mean, Rstd, w, row, cols, ok, stride_dout, stride_h, N, acc_t,
                                           IS_RMS, HAS_WEIGHT, CHUNK)  # fmt: skip
        if HAS_WEIGHT:
            dw_acc += dweight_term(dy, xhat, CAST_BEFORE_WEIGHT, DOut.dtype.element_ty)
        if HAS_DB:
            db_acc += dy
        _bwd_publish(WS, slot * 2 * K, k, g, xhat, IS_RMS)
        _team_meet(Flags, slot, K * (i // 2 + 1))
        c1, c2 = _bwd_combine(WS, slot * 2 * K, N, K, IS_RMS, True)
        _bwd_finish(DResOut, DX, DRes, row, cols, ok, g, xhat, rstd, sc, c1, c2, stride_dres_out, N, Seed,
                    keep_threshold, scale_hi, scale_mid, scale_lo, acc_t, HAS_DRES_OUT, IS_RMS, HAS_DROPOUT,
                    STORE_DRES, SEED_OFFSET)  # fmt: skip
        i += 1
    if HAS_WEIGHT:
        tl.store(DWPart + team * N + cols, dw_acc, mask=ok)
    if HAS_DB:
        tl.store(DBPart + team * N + cols, db_acc, mask=ok)


@jit
def bwd_partials_kernel(
    DOut, H, W, Mean, Rstd, stride_dout, stride_h, N,
    WS,  # (M, K, 2) acc
    HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, K: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    # program (row, k): the two row sums' partials of chunk k
    acc_t = Rstd.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    cols = k * CHUNK + tl.arange(0, CHUNK)
    ok = cols < N
    w = tl.zeros([CHUNK], dtype=acc_t)
    if HAS_WEIGHT:
        w = load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
    dy, xhat, g, rstd, sc = _bwd_terms(DOut, H, Mean, Rstd, w, row, cols, ok, stride_dout, stride_h, N, acc_t,
                                       IS_RMS, HAS_WEIGHT, CHUNK)  # fmt: skip
    _bwd_publish(WS, row * 2 * K, k, g, xhat, IS_RMS)


@jit
def bwd_finish_kernel(
    DOut, DResOut, H, W, Mean, Rstd, DX, DRes,
    DWPart, DBPart,  # (groups, N) acc
    stride_dout, stride_dres_out, stride_h, M, N, Seed, keep_threshold, scale_hi, scale_mid, scale_lo,
    WS,  # (M, K, 2) acc: bwd_partials_kernel's partials
    HAS_DRES_OUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DB: tl.constexpr, IS_RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, SEED_OFFSET: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # program (k, group): chunk k of rows group, group + groups, ...; its dw/db partial row stays in registers
    acc_t = Rstd.dtype.element_ty
    k = tl.program_id(0)
    group = tl.program_id(1)
    cols = k * CHUNK + tl.arange(0, CHUNK)
    ok = cols < N
    w = tl.zeros([CHUNK], dtype=acc_t)
    if HAS_WEIGHT:
        w = load_weight(W, cols, ok, acc_t, ZERO_CENTERED)
    dw_acc = tl.zeros([CHUNK], dtype=acc_t)
    db_acc = tl.zeros([CHUNK], dtype=acc_t)
    for r in range(group, M, tl.num_programs(1)):
        row = tl.cast(r, tl.int64)
        dy, xhat, g, rstd, sc = _bwd_terms(DOut, H, Mean, Rstd, w, row, cols, ok, stride_dout, stride_h, N, acc_t,
                                           IS_RMS, HAS_WEIGHT, CHUNK)  # fmt: skip
        if HAS_WEIGHT:
            dw_acc += dweight_term(dy, xhat, CAST_BEFORE_WEIGHT, DOut.dtype.element_ty)
        if HAS_DB:
            db_acc += dy
        c1, c2 = _bwd_combine(WS, row * 2 * K, N, K, IS_RMS, False)
        _bwd_finish(DResOut, DX, DRes, row, cols, ok, g, xhat, rstd, sc, c1, c2, stride_dres_out, N, Seed,
                    keep_threshold, scale_hi, scale_mid, scale_lo, acc_t, HAS_DRES_OUT, IS_RMS, HAS_DROPOUT,
                    STORE_DRES, SEED_OFFSET)  # fmt: skip
    if HAS_WEIGHT:
        tl.store(DWPart + group * N + cols, dw_acc, mask=ok)
    if HAS_DB:
        tl.store(DBPart + group * N + cols, db_acc, mask=ok)
