"""The finite-range guard (issue 38): every finite input gets the float64 answer rounded to the output dtype, forward
and every gradient, on rows whose plain fp32 statistics overflow or underflow (1e-45 .. 3e38 in fp32, bf16 across
its range, fp16 at its limits), RMSNorm and LayerNorm, eps = 0 and eps > 0, with the contract's options, and the
quantized ops on the same rows. The oracle is float64 autograd on the stored residual_out, written here."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm import add_layer_norm, add_layer_norm_, add_rms_norm, add_rms_norm_, norm_add_
from addnorm.ops import backends
from addnorm.ops.contract import GUARD_LIMITS, guard_scale_exponent, ordinary_rows
from addnorm.ops.quant import add_layer_norm_quant, add_rms_norm_quant
from addnorm.ops.quant.contract import QMAX, min_scale

# the backends under test ("triton" joins at merge time, with TRITON_INTERPRET=1 as in the other tests; "reference",
# the oracle behind the kernel contract, keeps the contract too: addnorm.reference_guard)
BACKENDS = ["torch", "cpu", "reference"]

# row scales per dtype: each row of a test input is uniform(-1, 1) (plus an offset for some rows) times one scale
SCALES = {
    torch.float32: [1e-45, 1e-42, 1e-38, 1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 1e37, 3e38],
    torch.bfloat16: [1e-38, 1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 1e38],
    torch.float16: [6e-8, 1e-6, 1e-4, 1.0, 1e2, 6e4],
}
IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
N = 50  # not a power of two


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _rows(dtype, seed=0, residual=True):
    """(x, residual) of one row per scale, and once more with a large common offset (LayerNorm's mean far from 0).
    x + residual stays finite: |x| <= 0.9 * scale, |residual| <= 0.05 * scale."""
    g = torch.Generator().manual_seed(seed)
    xs, rs = [], []
    for s in SCALES[dtype]:
        for offset in (0.0, 0.5):
            u = torch.rand(N, generator=g, dtype=torch.float64) * 2 - 1
            xs.append((offset + (0.4 if offset else 0.9) * u) * s)
            rs.append((torch.rand(N, generator=g, dtype=torch.float64) * 0.1 - 0.05) * s)
    x = torch.stack(xs).to(dtype)
    r = torch.stack(rs).to(dtype) if residual else None
    return x, r


def _affine(n, dtype, g, bias):
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(dtype) if bias else None
    return w, b


def _oracle(h, w, b, *, eps, is_rms, zc=False, cast_to=None):
    """float64 leaves (h, w, b) and out, the contract's norm in float64 of the stored h."""
    hd = h.detach().double().requires_grad_(True)
    wd = None if w is None else w.detach().double().requires_grad_(True)
    bd = None if b is None else b.detach().double().requires_grad_(True)
    if is_rms:
        xhat = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + eps)
    else:
        d = hd - hd.mean(-1, keepdim=True)
        xhat = d * torch.rsqrt(d.square().mean(-1, keepdim=True) + eps)
    y = xhat
    if cast_to is not None and (wd is not None or bd is not None):
        y = y + (y.detach().to(cast_to).double() - y.detach())
    if wd is not None:
        y = y * (wd + 1 if zc else wd)
    if bd is not None:
        y = y + bd
    return (hd, wd, bd), y


def _tol(dtype):
    # (elementwise rtol, tolerance relative to the row's largest |value|): fp32 statistics and one rounding
    return {torch.float32: (2e-6, 2e-6), torch.float64: (2e-6, 2e-6)}.get(dtype, (torch.finfo(dtype).eps, 1e-3))


def assert_close64(got, want, dtype, what, scale=None):
    """got (in dtype) against the float64 value want: inf exactly where want rounds beyond dtype's range (a value
    within a rounding of the boundary may land either side), elsewhere within rtol of itself plus tol of its row's
    largest value (``scale``: per-element magnitudes instead), plus the dtype's smallest subnormal."""
    assert got.dtype == dtype, what
    fi = torch.finfo(dtype)
    g, w = got.double(), want.detach()
    assert not torch.isnan(g).any() or torch.isnan(w).any(), f"{what}: NaN where float64 is finite"
    near_edge = w.abs() >= fi.max * (1 - 2 * fi.eps)
    beyond = w.to(dtype).isinf() & ~near_edge
    assert torch.equal(g[beyond], w.to(dtype).double()[beyond]), f"{what}: beyond {dtype}'s range but not inf"
    inside = ~w.to(dtype).isinf() & ~near_edge
    assert torch.isfinite(g[inside]).all(), f"{what}: inf or NaN where float64 rounds to a finite value"
    rtol, rowtol = _tol(dtype)
    if scale is None:
        scale = w.abs().where(inside, 0).amax(dim=-1, keepdim=True)
    bound = rtol * w.abs() + rowtol * scale + 2 * fi.smallest_normal * fi.eps
    err = (g - w).abs()
    bad = inside & ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, worst at {bad.nonzero()[0].tolist()}: got "
        f"{g[bad][0].item()!r}, float64 {w[bad][0].item()!r}"
    )


CASES = [
    (dtype, is_rms, eps)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for is_rms in (True, False)
    for eps in (0.0, 1e-5)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,is_rms,eps", CASES, ids=[f"{IDS[d]}-{'rms' if r else 'ln'}-eps{e:g}" for d, r, e in CASES]
)
def test_forward_and_gradients_match_float64(backend, dtype, is_rms, eps):
    _skip_unavailable(backend)
    x, r = _rows(dtype)
    g = torch.Generator().manual_seed(1)
    w, b = _affine(N, dtype, g, bias=not is_rms)
    _check(backend, x, r, w, b, eps=eps, is_rms=is_rms, g=g)


OPTIONS = [
    dict(zero_centered_weight=True),
    dict(cast_before_weight=True),
    dict(residual_dtype=torch.float32),
    dict(residual_dtype=torch.float32, out_dtype=torch.float32),
    dict(no_residual=True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(k for k in o))
def test_options_match_float64(backend, is_rms, opts):
    _skip_unavailable(backend)
    opts = dict(opts)
    dtype = torch.bfloat16
    x, r = _rows(dtype, seed=3, residual=not opts.pop("no_residual", False))
    g = torch.Generator().manual_seed(4)
    w, b = _affine(N, dtype, g, bias=not is_rms)
    _check(backend, x, r, w, b, eps=0.0, is_rms=is_rms, g=g, **opts)


def _check(backend, x, r, w, b, *, eps, is_rms, g, **opts):
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, r, w, b)]
    xg, rg, wg, bg = leaves
    if is_rms:
        out, res = add_rms_norm(xg, rg, wg, eps, backend=backend, **opts)
    else:
        out, res = add_layer_norm(xg, rg, wg, bg, eps, backend=backend, **opts)
    od = opts.get("out_dtype") or x.dtype
    cast_to = od if opts.get("cast_before_weight") else None
    (hd, wd, bd), want = _oracle(
        res,
        w,
        None if is_rms else b,
        eps=eps,
        is_rms=is_rms,
        zc=opts.get("zero_centered_weight", False),
        cast_to=cast_to,
    )
    assert_close64(out, want, od, f"{backend} out")
    dout = torch.randn(out.shape, generator=g).to(od)
    dres = torch.randn(res.shape, generator=g).to(res.dtype) if r is not None else None
    torch.autograd.backward([out] + ([res] if dres is not None else []), [dout] + ([dres] if dres is not None else []))
    want.backward(dout.double())
    dh = hd.grad + (dres.double() if dres is not None else 0)
    assert_close64(xg.grad, dh, x.dtype, f"{backend} dx")
    if r is not None:
        assert_close64(rg.grad, dh, r.dtype, f"{backend} dresidual")
    # dweight, dbias: sums over rows; tolerance relative to the sum of |terms| of each column
    xhat = ((want.detach() - (bd.detach() if bd is not None else 0)) / wd.detach()) if w is not None else None
    if w is not None:
        terms = (dout.double() * xhat).abs().sum(0)
        assert_close64(wg.grad, wd.grad, w.dtype, f"{backend} dweight", scale=terms)
    if b is not None and not is_rms:
        assert_close64(bg.grad, bd.grad, b.dtype, f"{backend} dbias", scale=dout.double().abs().sum(0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_subnormal_row_eps0_correctly_rounded(backend, is_rms):
    """eps = 0 on a row of subnormals: rstd ~ 1e40 is beyond fp32, the normalized row is ordinary. Correctly
    rounded: within half an ulp of float64 plus the float64 computation's own error."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(5)
    x = (torch.randint(-50, 51, (3, N), generator=g) * 2.0**-149).float()
    x[:, 0] = 2.0**-149  # not all zero
    fn = add_rms_norm if is_rms else add_layer_norm
    out = fn(x, None, None, eps=0.0, backend=backend)[0]
    _, want = _oracle(x, None, None, eps=0.0, is_rms=is_rms)
    ulp = torch.finfo(torch.float32).eps * want.detach().abs().clamp(min=2.0**-126)
    assert ((out.double() - want.detach()).abs() <= 0.51 * ulp + 1e-300).all()


def test_the_guard_leaves_ordinary_rows_alone():
    """The test itself: ordinary statistics pass, every failure class fails (inf, 0, NaN, huge, subnormal mean)."""
    lo, hi, tiny = GUARD_LIMITS[torch.float32]
    rstd = torch.tensor([1.0, lo, hi, hi * 2, lo / 2, math.inf, 0.0, math.nan])
    assert ordinary_rows(None, rstd).tolist() == [True, True, True, False, False, False, False, False]
    mean = torch.tensor([0.0, 1e-30, tiny, tiny / 2, 1.0, 1.0, 1.0, 1.0])
    assert ordinary_rows(mean, rstd).tolist() == [True, True, True, False, False, False, False, False]
    assert ordinary_rows(torch.tensor([-tiny / 4]), torch.tensor([1.0])).tolist() == [False]
    for a in (2.0**-149, 1e-30, 1.0, 1.5, 3e38):
        assert 1 <= a * 2.0 ** guard_scale_exponent(a) < 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_and_zero_rows_are_left_as_they_were(backend):
    """A row holding inf or NaN stays NaN (no rescue of non-finite input); a zero row with eps = 0 is 0/0 (NaN), as
    in float64; the ordinary row beside them is unaffected."""
    _skip_unavailable(backend)
    x = torch.randn(4, N)
    x[0, 3] = math.inf
    x[1, 5] = math.nan
    x[2] = 0.0
    out = add_rms_norm(x, None, None, eps=0.0, backend=backend)[0]
    assert out[:3].isnan().any(dim=-1).all()
    assert torch.isfinite(out[3]).all()


QUANT = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("quant_dtype", QUANT, ids=["int8", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_ops_on_extreme_rows(backend, is_rms, quant_dtype, dtype):
    """Dynamic per-token scales on the same rows: each code within one step of the float64 y / scale, each scale
    within fp32 rounding of float64's."""
    _skip_unavailable(backend)
    x, r = _rows(dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    w, b = _affine(N, dtype, g, bias=not is_rms)
    with torch.no_grad():
        if is_rms:
            q, res, scales = add_rms_norm_quant(x, r, w, 0.0, quant_dtype=quant_dtype, backend=backend)
        else:
            q, res, scales = add_layer_norm_quant(x, r, w, b, 0.0, quant_dtype=quant_dtype, backend=backend)
    _, y = _oracle(res, w, None if is_rms else b, eps=0.0, is_rms=is_rms)
    y = y.detach()
    qmax = QMAX[quant_dtype]
    s = (y.abs().amax(-1, keepdim=True) / qmax).clamp(min=min_scale(quant_dtype))
    assert torch.allclose(scales.double(), s, rtol=1e-5, atol=0), f"{backend} scales"
    v = (y / s).clamp(-qmax, qmax)
    if quant_dtype == torch.int8:
        assert ((q.double() - v).abs() <= 1).all(), f"{backend} int8 codes"
    else:
        qv = q.to(torch.float64)
        step = 2.0 ** (torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)  # e4m3: 3 mantissa bits
        assert ((qv - v).abs() <= step).all(), f"{backend} fp8 codes"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_dropout_on_extreme_rows(backend, is_rms):
    """Dropout before the norm: the gradient of a rescaled row goes through the regenerated mask. Without a residual,
    residual_out is dropout(x), so the kept elements are its nonzero ones (x has no zeros here)."""
    _skip_unavailable(backend)
    p = 0.25
    x = _rows(torch.float32)[0][4:-2]  # 1e-38 .. 1e37: no element rounds to 0, none overflows once scaled by 4/3
    assert (x != 0).all()
    xg = x.clone().requires_grad_(True)
    fn = add_rms_norm if is_rms else add_layer_norm
    out, res = fn(xg, None, None, eps=0.0, dropout_p=p, backend=backend)
    keep = res.detach() != 0
    assert 0 < keep.float().mean() < 1
    (hd, _, _), want = _oracle(res, None, None, eps=0.0, is_rms=is_rms)
    assert_close64(out, want, torch.float32, f"{backend} out")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    out.backward(dout)
    want.backward(dout.double())
    scale = float(torch.tensor(1 / (1 - p), dtype=torch.float32))
    assert_close64(xg.grad, hd.grad * keep * scale, torch.float32, f"{backend} dx")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_inference_calls_on_extreme_rows(backend, dtype, is_rms):
    """The calls nothing differentiates (the decode fast path: one row, and a few rows; one dtype) take the guard
    too."""
    _skip_unavailable(backend)
    x, r = _rows(dtype, seed=9)
    g = torch.Generator().manual_seed(10)
    w, b = _affine(N, dtype, g, bias=not is_rms)
    for rows in (slice(16, 17), slice(None)):  # one row (1e20 in fp32, 1e38 in bf16), then all of them
        with torch.no_grad():
            if is_rms:
                out, res = add_rms_norm(x[rows], r[rows], w, 0.0, backend=backend)
            else:
                out, res = add_layer_norm(x[rows], r[rows], w, b, 0.0, backend=backend)
        _, want = _oracle(res, w, None if is_rms else b, eps=0.0, is_rms=is_rms)
        assert_close64(out, want, dtype, f"{backend} out, rows {rows}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_inplace_ops_on_extreme_rows(backend, dtype, is_rms):
    """The in-place forms (serving) take the guard too: add_*_norm_ writes the normalized sum into x, norm_add_
    writes residual + Norm(y), Norm(y) rounded to y's dtype first, into the residual."""
    _skip_unavailable(backend)
    x, r = _rows(dtype, seed=13)
    g = torch.Generator().manual_seed(14)
    w, b = _affine(N, dtype, g, bias=not is_rms)
    b = None if is_rms else b
    xi, ri = x.clone(), r.clone()
    if is_rms:
        add_rms_norm_(xi, ri, w, 0.0, backend=backend)
    else:
        add_layer_norm_(xi, ri, w, b, 0.0, backend=backend)
    _, want = _oracle(ri, w, b, eps=0.0, is_rms=is_rms)
    assert_close64(xi, want, dtype, f"{backend} {'add_rms_norm_' if is_rms else 'add_layer_norm_'}")
    ri = r.clone()
    norm_add_(x, ri, w, b, 0.0, norm="rms" if is_rms else "layer", backend=backend)
    _, normed = _oracle(x, w, b, eps=0.0, is_rms=is_rms)
    assert_close64(ri, r.double() + normed.detach().to(dtype).double(), dtype, f"{backend} norm_add_")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_few_wide_rows(backend, is_rms):
    """Two rows of 2^17 (1e30 and 1e-40, fp32): the cpu backward's column-split path (few rows, many elements, more
    than one thread) carries the rescaled rows' statistics to every column block."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(11)
    n = 1 << 17
    x = (torch.rand(2, n, generator=g, dtype=torch.float64) * 2 - 1) * torch.tensor(
        [[1e30], [1e-40]], dtype=torch.float64
    )
    x = x.float()
    w, b = _affine(n, torch.float32, g, bias=not is_rms)
    _check(backend, x, torch.zeros_like(x), w, b, eps=0.0, is_rms=is_rms, g=g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_float64_rows_beyond_float64_statistics(backend, is_rms):
    """fp64 statistics have a guard of their own (GUARD_LIMITS[float64]): subnormal fp64 rows (1e-310, the scale
    2^k of the pass up to 2^1075) and rows of 1e300 with eps = 0 normalize as the same row scaled by a power of two
    into the ordinary range does (exact scalings: the float64 answers agree); with eps = 1e-300 on the subnormal row,
    eps * 4^k is beyond float64 and eps alone decides: y = h / sqrt(eps)."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(17)
    u = torch.rand(2, N, generator=g, dtype=torch.float64) * 1.8 - 0.9
    u[:, 0] = 0.95
    fn = add_rms_norm if is_rms else add_layer_norm
    for scale, j in ((1e-310, 1000), (1e300, -1000)):
        x = u * scale  # (subnormals: a few bits each, the scaling by 2^j below exact all the same)
        out = fn(x, None, None, eps=0.0, backend=backend)[0]
        want = fn(x * 2.0**j, None, None, eps=0.0, backend=backend)[0]
        assert torch.allclose(out, want, rtol=1e-13, atol=0), f"{backend} {scale:g}"
    if is_rms:
        x = u * 1e-310
        out = fn(x, None, None, eps=1e-300, backend=backend)[0]
        assert torch.allclose(out, x / math.sqrt(1e-300), rtol=1e-13, atol=0), f"{backend} eps dominates"


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_reference_backend_keeps_the_oracles_bits_on_ordinary_rows(is_rms):
    """The reference backend's guard (addnorm.reference_guard) patches only the rows it rescues: beside them, every
    ordinary row's out, saved statistics and gradients are bitwise the plain oracle's (addnorm.reference, which the
    kernels' ordinary rows are checked against bit for bit), and so is dweight of a batch of ordinary rows; a rescued
    row saves its float64 statistics rounded to fp32 (rstd inf for the subnormal rows: eps = 0)."""
    from addnorm import reference_backend
    from addnorm.reference import add_norm_bwd_ref, add_norm_ref

    x, r = _rows(torch.float32, seed=15)
    g = torch.Generator().manual_seed(16)
    w, b = _affine(N, torch.float32, g, bias=not is_rms)
    opts = dict(eps=0.0, is_rms=is_rms, dropout_p=0.0, residual_dtype=torch.float32, zero_centered_weight=False)
    plain = add_norm_ref(x, r, w, b, **opts)
    out, res, mean, rstd = reference_backend.forward(x, r, w, b, seed=None, store_residual_out=True, **opts)
    ok = ordinary_rows(plain[2], plain[3])
    assert 0 < int(ok.sum()) < len(ok)
    assert torch.equal(res, plain[1])
    assert torch.equal(out[ok], plain[0][ok]) and torch.equal(rstd[ok], plain[3][ok])
    hd = res[~ok].double()
    d = hd if is_rms else hd - hd.mean(-1, keepdim=True)
    assert torch.allclose(rstd[~ok].double(), d.square().mean(-1).rsqrt().float().double(), rtol=2**-23, atol=0)
    if not is_rms:
        assert torch.equal(mean[ok], plain[2][ok])
        assert torch.allclose(mean[~ok].double(), hd.mean(-1).float().double(), rtol=2**-23, atol=0)
    dout = torch.randn(out.shape, generator=g)
    bwd = dict(dropout_p=0.0, zero_centered_weight=False, x_dtype=torch.float32, residual_dtype=torch.float32)
    dx, dres, dw, db = reference_backend.backward(
        dout, None, res, w, mean, rstd, is_rms=is_rms, seed=None, bias_dtype=None if is_rms else b.dtype, **bwd
    )
    want = add_norm_bwd_ref(dout, None, res, w, plain[2], plain[3], bias_dtype=None if is_rms else b.dtype, **bwd)
    assert not dx.isnan().any()  # (inf in the subnormal rows: their float64 dx is beyond fp32)
    assert torch.equal(dx[ok], want[0][ok]) and torch.equal(dres[ok], want[1][ok])
    if not is_rms:
        assert torch.equal(db, want[3])
    m, s = None if is_rms else plain[2][ok], plain[3][ok]
    alone = reference_backend.backward(
        dout[ok], None, res[ok], w, m, s, is_rms=is_rms, seed=None, bias_dtype=None, **bwd
    )
    assert torch.equal(alone[2], add_norm_bwd_ref(dout[ok], None, res[ok], w, m, s, bias_dtype=None, **bwd)[2])


# The torch backend's eager test of the statistics (torch_backend._all_ordinary): one row read as values, up to
# _HOST_TEST_ROWS rows read as lists, more rows through reductions; on a CPU one read per tensor, off it (one_read)
# one read in all. Every form must agree with ordinary_rows(...).all() wherever the failing row sits.
LO, HI, TINY = GUARD_LIMITS[torch.float32]
BAD_RSTD = [HI * 2, LO / 2, math.inf, 0.0, math.nan]
BAD_MEAN = [TINY / 2, -TINY / 4, 2.0**-149]


def _stats(m, lead, seed):
    g = torch.Generator().manual_seed(seed)
    rstd = (torch.rand(m, 1, generator=g) + 0.5).reshape(*lead, 1)
    mean = torch.randn(m, 1, generator=g).reshape(*lead, 1)
    return mean, rstd


@pytest.mark.parametrize("one_read", [False, True], ids=["per-tensor", "one-read"])
@pytest.mark.parametrize("m", [1, 2, 8, 16, 17, 40])
def test_eager_statistics_test_agrees_with_ordinary_rows(m, one_read):
    from addnorm.ops import torch_backend as TB

    assert TB._HOST_TEST_ROWS in (8, 16)  # the sizes above straddle it (list and reduced forms)
    for lead in [(m,), (1, m)] + ([(2, m // 2)] if m % 2 == 0 else []):
        mean, rstd = _stats(m, lead, seed=m)
        for means in (None, mean):
            assert TB._all_ordinary(means, rstd, one_read) is True
        for row in sorted({0, m // 2, m - 1}):
            for bad in BAD_RSTD:
                r = rstd.clone().view(-1)
                r[row] = bad
                r = r.view(rstd.shape)
                for means in (None, mean):
                    assert TB._all_ordinary(means, r, one_read) is False, (lead, row, bad, means is None)
            for bad in BAD_MEAN:
                u = mean.clone().view(-1)
                u[row] = bad
                assert TB._all_ordinary(u.view(mean.shape), rstd, one_read) is False, (lead, row, bad)
            # an exact zero mean is ordinary; beside a subnormal one (the reduced form's second pass) it is not
            u = mean.clone().view(-1)
            u[row] = 0.0
            assert TB._all_ordinary(u.view(mean.shape), rstd, one_read) is True
            u[(row + 1) % m] = TINY / 8
            assert TB._all_ordinary(u.view(mean.shape), rstd, one_read) is False, (lead, row)
    assert TB._all_ordinary(torch.empty(0, 1), torch.empty(0, 1), one_read) is True


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("m", [1, 8, 40])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_torch_backend_rescues_the_row_wherever_it_sits(monkeypatch, is_rms, m, grad):
    """One row in need of the scaled pass (1e30 in fp32, and for LayerNorm a subnormal mean with an ordinary rstd) at
    the first and the last position of 1, 8 and 40 rows: the scaled pass runs and out is float64's, on the decode
    shortcut (no grad) and the general path."""
    from addnorm.ops import torch_backend as TB

    calls = []
    real = TB.scaled_norm
    monkeypatch.setattr(TB, "scaled_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(12 + m)
    kinds = [("big", 1e30)] + ([] if is_rms else [("subnormal mean", None)])
    for kind, scale in kinds:
        for row in sorted({0, m - 1}):
            x = torch.randn(m, N, generator=g)
            if scale is not None:
                x[row] *= scale
            else:  # values ~ 1e-39 around a mean of ~ 3e-39: var << eps, rstd = eps^-1/2, the mean subnormal
                x[row] = (3 + torch.rand(N, generator=g)) * 1e-39
            w = (1 + 0.3 * torch.randn(N, generator=g)).requires_grad_(grad)
            xg = x.clone().requires_grad_(grad)
            calls.clear()
            with torch.set_grad_enabled(grad):
                fn = add_rms_norm if is_rms else add_layer_norm
                out, res = fn(xg, None, w, eps=1e-5, backend="torch")
            assert calls, f"{kind} at row {row} of {m}: no rescue"
            _, want = _oracle(res, w, None, eps=1e-5, is_rms=is_rms)
            assert_close64(out, want, torch.float32, f"{kind}, row {row} of {m}")
