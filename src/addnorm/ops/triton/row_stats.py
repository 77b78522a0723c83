"""Row statistics that hold for every finite row: the guard and the scaled pass of the Triton kernels.

The plain statistics overflow when sum(h^2) passes the accumulation type's range (fp32: |h| beyond ~1e19 in a
row) and lose their meaning when the squares underflow (|h| below ~1e-19) and eps does not dominate them. Every
kernel therefore computes the plain statistics first and checks one scalar per row, v = var + eps:

    plain is exact enough  <=>  TINY <= v < inf      (TINY = 2^-102 in fp32: squares' underflow, at most
                                                      N * 2^-150 on sum(h^2), is then below 2^-48 of v)

and only a row that fails recomputes its statistics with h scaled by a power of two sc (so the scaling is exact):
sc = 2^-floor(log2(max |h|)) brings the row's largest |h| to [1, 2), lowered when eps > 0 so that eps * sc^2
stays below 4; sc is clamped to [2^-126, 2^126] (fp32), so a subnormal row's max lands in [2^-23, 1). In the
scaled space the same formulas run (mean_s = sc * mean, var_s = sc^2 * var, rstd_s = rstd / sc) and

    xhat = (h * sc - mean_s) * rstd_s,      dh = ((g - mean_j(g) - xhat * mean_j(g * xhat)) * rstd_s) * sc

with the last product carrying the result's true size (inf where it is beyond the output's range, 0 where the
bracket is 0: never inf * 0). Rows that pass take the plain arithmetic and their bits do not change.

Where the scaled pass runs: the rows forward redoes its failing rows last, one by one through memory in tiles
(``scaled_looped_stats``); the looped kernels and the
quantized one in place of their plain statistics; the team kernels chunk by chunk: a chunk whose plain partials
are out of range publishes them for h * 2^e with its e, and the K partials are combined at the team's smallest e
(addnorm.ops.triton.team_kernels). The backward recomputes a failing row's statistics from h (below).

The saved statistics (what the backward receives): mean and rstd are the row's true statistics rounded to the
statistics dtype, rstd = inf where it is beyond that dtype's range (fp32: eps = 0 and the row's std below
~2.9e-39, i.e. a row of subnormals) and subnormal where the std is above ~8.5e37. The backward re-checks the saved
rstd (plain iff rstd in [RSTD_LO, RSTD_HI], the image of [TINY, fp32 max]) and recomputes an out-of-range row's
mean_s, var_s from h with the same scaled pass; rstd_s is then the saved rstd / sc when that is a normal number
(exact), else rsqrt(var_s): a saved rstd of inf means eps was 0 (an fp32 eps is 0 or >= 2^-149, and v < 2^-256),
and a subnormal one means var > 2^252, beside which any fp32 eps is negligible.
"""

from __future__ import annotations

from types import SimpleNamespace

from addnorm.ops.triton.elementwise import affine, round_to

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    # the scaled passes are called, not inlined: a rare path inlined would add its registers to every launch (ptxas
    # sizes a kernel for its worst path), where a call spills what the caller holds, on that path only
    rare_path = triton.jit(noinline=True)
except ImportError:  # the module still imports, so the backend can say what to install
    triton = None
    tl = SimpleNamespace(constexpr=None)
    jit = rare_path = lambda fn: fn  # noqa: E731


@jit
def rsqrt(v):
    # correctly rounded sqrt then a division: tl.math.rsqrt is approximate, and sqrt_rn has no fp64 form
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return 1.0 / tl.sqrt_rn(v)


@jit
def pow2(k, acc_t: tl.constexpr):
    """2^k in acc_t, exactly, for integers k within acc_t's normal exponents (built from the bits)."""
    if acc_t == tl.float64:
        return ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    else:
        return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@jit
def exponent_of(a):
    """floor(log2(a)) for a normal a >= 0 (from the bits); the lowest exponent - 1 for 0 and subnormals."""
    if a.dtype == tl.float64:
        return ((a.to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32) - 1023
    else:
        return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@jit
def plain_stats_fail(v):
    """Per row: whether v = var + eps from the plain statistics is out of [TINY, inf) (NaN included)."""
    if v.dtype == tl.float64:
        tiny = pow2(tl.full([], -968, tl.int32), tl.float64)  # 2^-(1022 - 52 - 2)
    else:
        tiny = pow2(tl.full([], -102, tl.int32), tl.float32)  # 2^-(126 - 23 - 1)
    return (v < tiny) | (v != v) | (v == float("inf"))


@jit
def saved_rstd_fail(rstd):
    """Per row: whether a saved rstd is outside [RSTD_LO, RSTD_HI] = rsqrt([fp max, TINY]): the rows the forward
    normalized with the scaled pass, whose statistics the backward recomputes from h."""
    if rstd.dtype == tl.float64:
        lo = pow2(tl.full([], -512, tl.int32), tl.float64)
        hi = pow2(tl.full([], 484, tl.int32), tl.float64)
    else:
        lo = pow2(tl.full([], -64, tl.int32), tl.float32)
        hi = pow2(tl.full([], 51, tl.int32), tl.float32)
    return (rstd < lo) | (rstd > hi) | (rstd != rstd)


@jit
def scale_exponent(amax, eps):
    """e with sc = 2^e for a row whose largest |h| is amax (0 for a row of zeros or non-finite values)."""
    LIM: tl.constexpr = 1022 if amax.dtype == tl.float64 else 126
    BIAS: tl.constexpr = 2048 if amax.dtype == tl.float64 else 256
    e = -exponent_of(amax)
    # eps * sc^2 in [1, 4): sc <= 2^-floor(E(eps) / 2) (BIAS keeps the floor division's operand positive)
    e_eps = BIAS // 2 - (exponent_of(eps) + BIAS) // 2
    e = tl.where(eps > 0, tl.minimum(e, e_eps), e)
    e = tl.where((amax > 0) & (amax < float("inf")), e, 0)
    return tl.minimum(tl.maximum(e, -LIM), LIM)


@jit
def scaled_rows_fwd(h, mask, N, eps, bad, IS_RMS: tl.constexpr):
    """The scaled pass over a (rows, BLOCK_N) tile, for the rows ``bad`` (the others get sc = 1: the plain
    arithmetic, the same bits). Returns (x_s, rstd_s, mean, rstd): xhat = x_s * rstd_s; mean and rstd are the
    statistics to save (module docstring)."""
    acc_t: tl.constexpr = h.dtype
    amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=1)
    e = tl.where(bad, scale_exponent(amax, eps), 0)
    sc = pow2(e, acc_t)
    h_s = h * sc[:, None]
    eps_s = eps * sc * sc
    if IS_RMS:
        x_s = h_s
        mean_s = tl.zeros_like(sc)
        v_s = tl.sum(h_s * h_s, axis=1) / N + eps_s
    else:
        mean_s = tl.sum(h_s, axis=1) / N
        x_s = tl.where(mask, h_s - mean_s[:, None], 0.0)
        v_s = tl.sum(x_s * x_s, axis=1) / N + eps_s
    rstd_s = rsqrt(v_s)
    # a constant row scaled down so far that eps * sc^2 underflowed: var is 0, so rstd is eps's and xhat is 0
    flat = (v_s == 0) & (eps + tl.zeros_like(v_s) > 0)
    rstd = tl.where(flat, rsqrt(eps + tl.zeros_like(v_s)), rstd_s * sc)
    rstd_s = tl.where(flat, 0.0, rstd_s)
    return x_s, rstd_s, mean_s * pow2(-e, acc_t), rstd


@jit
def scaled_rows_bwd(h, mask, N, mean, rstd, bad, IS_RMS: tl.constexpr):
    """The backward's scaled pass over a (rows, BLOCK_N) tile from the saved (mean, rstd) of each row: for the rows
    ``bad``, (xhat, rstd_s, sc) recomputed (module docstring); for the others xhat from the saved statistics,
    rstd_s = rstd and sc = 1, the plain arithmetic."""
    acc_t: tl.constexpr = h.dtype
    amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=1)
    e = tl.where(bad, scale_exponent(amax, tl.zeros_like(amax)), 0)
    sc = pow2(e, acc_t)
    h_s = h * sc[:, None]
    if IS_RMS:
        x_s = h_s
        var_s = tl.sum(h_s * h_s, axis=1) / N
    else:
        mean_s = tl.where(bad, tl.sum(h_s, axis=1) / N, mean)
        x_s = tl.where(mask, h_s - mean_s[:, None], 0.0)
        var_s = tl.sum(x_s * x_s, axis=1) / N
    LOWEST: tl.constexpr = -1022 if acc_t == tl.float64 else -126
    normal = (rstd >= pow2(tl.full([], LOWEST, tl.int32), acc_t)) & (rstd < float("inf"))
    rstd_s = tl.where(normal, rstd * pow2(-e, acc_t), rsqrt(var_s))
    return x_s * rstd_s[:, None], rstd_s, sc


@jit
def merge_tile(h, ok, start, N, mean, m2, count, sumsq, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile of a looped row into its running statistics: sumsq += h^2 (RMSNorm), or the tile's exact two-pass
    (mean, M2) merged into (mean, m2, count) by Chan et al.'s pairwise update (LayerNorm)."""
    if IS_RMS:
        sumsq += h * h
    else:
        n_b = tl.minimum(N - start, BLOCK_N).to(h.dtype)
        mean_b = tl.sum(h, axis=0) / n_b
        d = tl.where(ok, h - mean_b, 0.0)
        m2_b = tl.sum(d * d, axis=0)
        n_ab = count + n_b
        delta = mean_b - mean
        mean += delta * (n_b / n_ab)
        m2 += m2_b + delta * delta * (count * (n_b / n_ab))
        count = n_ab
    return mean, m2, count, sumsq


@jit
def merge_init(acc_t: tl.constexpr, BLOCK_N: tl.constexpr):
    """The running (mean, m2, count, sumsq) of merge_tile before a row's first tile."""
    mean = tl.zeros([1], dtype=acc_t)
    m2 = tl.zeros([1], dtype=acc_t)
    count = tl.zeros([1], dtype=acc_t)
    sumsq = tl.zeros([BLOCK_N], dtype=acc_t)
    return mean, m2, count, sumsq


@jit
def merge_result(mean, m2, sumsq, N, IS_RMS: tl.constexpr):
    """(mean, var) of a row from merge_tile's running statistics after its last tile (RMSNorm: mean 0)."""
    if IS_RMS:
        var = tl.sum(sumsq, axis=0) / N
        mean_r = tl.zeros_like(var)
    else:
        var = tl.sum(m2, axis=0) / N
        mean_r = tl.sum(mean, axis=0)
    return mean_r, var


@jit
def scaled_looped_moments(H, N, eps, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The part of the scaled pass the forward and the backward share, over one row at H (contiguous, N long) read
    tile by tile: max |h|, then the statistics of h * sc. Returns (e, sc = 2^e, mean_s, var_s); eps (0 in the
    backward) only lowers sc (scale_exponent) and gives the accumulation type."""
    acc_t: tl.constexpr = eps.dtype
    amax = tl.zeros([BLOCK_N], dtype=acc_t)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        amax = tl.maximum(amax, tl.abs(tl.load(H + cols, mask=cols < N, other=0.0).to(acc_t)))
    e = scale_exponent(tl.max(amax, axis=0), eps)
    sc = pow2(e, acc_t)
    mean, m2, count, sumsq = merge_init(acc_t, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        h = tl.load(H + cols, mask=ok, other=0.0).to(acc_t) * sc
        mean, m2, count, sumsq = merge_tile(h, ok, start, N, mean, m2, count, sumsq, IS_RMS, BLOCK_N)
    mean_s, var_s = merge_result(mean, m2, sumsq, N, IS_RMS)
    return e, sc, mean_s, var_s


@rare_path
def scaled_looped_stats(H, N, eps, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scaled pass over one row at H (contiguous, N long) read tile by tile: max |h|, then the statistics of
    h * sc. Returns (sc, mean_s, rstd_s, mean, rstd): xhat = (h * sc - mean_s) * rstd_s; mean and rstd to save."""
    acc_t: tl.constexpr = eps.dtype
    e, sc, mean_s, var_s = scaled_looped_moments(H, N, eps, IS_RMS, BLOCK_N)
    v_s = var_s + eps * sc * sc
    rstd_s = rsqrt(v_s)
    flat = (v_s == 0) & (eps + tl.zeros_like(v_s) > 0)  # as in scaled_rows_fwd
    rstd = tl.where(flat, rsqrt(eps), rstd_s * sc)
    rstd_s = tl.where(flat, 0.0, rstd_s)
    return sc, mean_s, rstd_s, mean_s * pow2(-e, acc_t), rstd


@rare_path
def scaled_looped_bwd_stats(H, N, rstd, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """scaled_looped_bwd_stats_inline as a call (the rows and looped backward kernels)."""
    return scaled_looped_bwd_stats_inline(H, N, rstd, IS_RMS, BLOCK_N)


@jit
def scaled_looped_bwd_stats_inline(H, N, rstd, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The backward's scaled pass over one row at H from its saved (mean, rstd) (the module docstring's rule, tile
    by tile). Returns (sc, mean_s, rstd_s): xhat = (h * sc - mean_s) * rstd_s, dh = (... * rstd_s) * sc."""
    acc_t: tl.constexpr = rstd.dtype
    e, sc, mean_s, var_s = scaled_looped_moments(H, N, tl.zeros_like(rstd), IS_RMS, BLOCK_N)
    LOWEST: tl.constexpr = -1022 if acc_t == tl.float64 else -126
    normal = (rstd >= pow2(tl.full([], LOWEST, tl.int32), acc_t)) & (rstd < float("inf"))
    rstd_s = tl.where(normal, rstd * pow2(-e, acc_t), rsqrt(var_s))
    return sc, mean_s, rstd_s


@jit
def normalize_row(H, O, W, B, N, sc, mean_s, rstd, acc_t: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """out[j] = ((h[j] * sc - mean_s) * rstd) (* w[j] + b[j]) over the row at H into the row at O, tile by tile
    (sc = 1 but for a row beyond the plain statistics' range: row_stats)."""
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        h = tl.load(H + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(acc_t)
        y = affine((h * sc - mean_s) * rstd, W, B, cols, ok, acc_t, O.dtype.element_ty, HAS_WEIGHT, HAS_BIAS,
                   ZERO_CENTERED, CAST_BEFORE_WEIGHT)  # fmt: skip
        tl.store(O + cols, round_to(y, O.dtype.element_ty), mask=ok)


@rare_path
def redo_row(H, O, W, B, MeanRow, RstdRow, N, eps, acc_t: tl.constexpr, IS_RMS: tl.constexpr,
             STORE_STATS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
             CAST_BEFORE_WEIGHT: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """One row beyond the plain statistics' range, from its h at H to its output at O, through the scaled pass
    (row_stats; not inlined, so it adds no registers to the plain path)."""
    sc, mean_s, rstd_s, mean, rstd = scaled_looped_stats(H, N, eps, IS_RMS, TILE)
    if STORE_STATS:
        if not IS_RMS:
            tl.store(MeanRow, mean)
        tl.store(RstdRow, rstd)
    normalize_row(H, O, W, B, N, sc, mean_s, rstd_s, acc_t, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, CAST_BEFORE_WEIGHT,
                  TILE)  # fmt: skip
