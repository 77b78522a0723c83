"""The Triton backend on every finite row (issue 38): rows whose fp32 sum of squares overflows or underflows are
normalized through the scaled pass of addnorm.ops.triton.row_stats, forward and every gradient, against the float64
oracle rounded to the output dtype (inf where the true value is beyond that dtype's range, never NaN where float64
is finite). Rows at 1e-38 ... 3e38 and subnormal in fp32 and bf16, fp16 from its subnormals to 65504, RMSNorm and
LayerNorm, eps = 0 and eps > 0; the rows path, the looped path (forced by shrinking the block limits), the team
fallback (forced team sizes) and the quantized kernels (int8, fp8) on the same rows. In Triton's interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from addnorm import (  # noqa: E402
    add_layer_norm,
    add_layer_norm_,
    add_layer_norm_quant,
    add_rms_norm,
    add_rms_norm_,
    add_rms_norm_quant,
)
from addnorm.ops.quant.contract import QMAX, min_scale  # noqa: E402
from addnorm.ops.triton import launch as T  # noqa: E402
from addnorm.ops.triton import plan as P  # noqa: E402
from addnorm.ops.triton import team_launch as W  # noqa: E402
from addnorm.testing import oracle, tol  # noqa: E402

LN, RMS = False, True
TINY = P.Tuning(max_fwd_block_n=64, max_bwd_block_n=64, max_bwd_block_n_rms_16bit=64, loop_block_n=32)

# Triton 3.9's interpreter converts bf16 subnormals to fp32 wrongly (its _convert_float: 1e-39 -> 4.4e-39): bf16
# rows holding subnormals are checked on a GPU only; in the interpreter the smallest bf16 rows hold none
INTERPRETED = T.interpreted()
BF16_TINY = 1e-33 if INTERPRETED else 1e-39

# scales per dtype: the largest |h| of a row (x at half of it, the residual at 0.4 of it, so h never overflows)
F32 = [1e-45 * 64, 1e-41, 1e-38, 1e-30, 1e-20, 1e20, 1e30, 1e37, 3e38]
BF16 = [1e-28, 1e20, 1e30, 1e37, 3e38] + ([1e-33] if INTERPRETED else [1e-40, 1e-38])
F16 = [6e-8 * 16, 1e-5, 1e3, 65504.0]
F64 = [1e-320, 1e-200, 1e200, 1e307]  # fp64 statistics: the same guard at fp64's range
CASES = (
    [(torch.float32, s) for s in F32]
    + [(torch.bfloat16, s) for s in BF16]
    + [(torch.float16, s) for s in F16]
    + [(torch.float64, s) for s in F64]
)


@pytest.fixture(autouse=True)
def _triton_here(device):
    reason = T.unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)


def _unit_rows(m, n, gen):
    """(m, n) float64 rows of random values with max |v| = 1 in every row."""
    v = torch.randn(m, n, generator=gen, dtype=torch.float64)
    return v / v.abs().amax(dim=1, keepdim=True)


def _rows(m, n, dtype, scales, device, seed=0):
    """Leaf tensors x, residual, weight, bias; row i of h = x + residual is at scales[i % len(scales)]."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.tensor([scales[i % len(scales)] for i in range(m)], dtype=torch.float64)[:, None]
    x = (0.5 * s * _unit_rows(m, n, gen)).to(dtype)
    r = (0.4 * s * _unit_rows(m, n, gen)).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    b = (0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    return [t.to(device).requires_grad_(True) for t in (x, r, w, b)]


def _pow2_floor(t):
    """2^floor(log2 t) (1 where t is 0 or not finite): an exact scale to compare a row at."""
    safe = torch.where(torch.isfinite(t) & (t > 0), t, torch.ones_like(t))
    return torch.exp2(torch.floor(torch.log2(safe)))


def check(actual, expected, what, *, grad=False, reduced_rows=1):
    """actual (its dtype) against the float64 ``expected`` rounded to that dtype: the same infinities (beyond
    range), no NaN where expected is finite, and the finite values at the dtype's tolerance relative to each
    row's largest |expected| (a power of two, so the comparison of tiny and huge rows loses nothing)."""
    dtype = actual.dtype
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    e_r = e.to(dtype).double()
    assert not (torch.isnan(a) & ~torch.isnan(e)).any(), f"{what}: NaN where float64 is finite"
    inf = torch.isinf(e_r)
    assert torch.equal(torch.isinf(a), inf), f"{what}: infinities at other places than float64's rounded"
    assert torch.equal(a[inf], e_r[inf]), f"{what}: infinities of the wrong sign"
    fin = torch.isfinite(e_r)
    rows = a.reshape(-1, a.shape[-1]) if a.dim() > 1 else a[None]
    e_rows, fin_rows = e.reshape(rows.shape), fin.reshape(rows.shape)
    scale = _pow2_floor(torch.where(fin_rows, e_rows.abs(), torch.zeros_like(e_rows)).amax(dim=1, keepdim=True))
    if reduced_rows > 1:  # dweight, dbias: sums of dout * xhat (|xhat| <= sqrt(N)) and dout, whose scale is dout's
        scale = scale.clamp(min=1.0)  # (xhat itself is ~0 in a row of subnormals that eps > 0 dominates)
    atol, rtol = tol(dtype, grad=grad, reduced_rows=reduced_rows)
    # plus the roundings where values are subnormal (xhat, then xhat * w): two steps of the dtype's smallest
    step = 2 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps / scale
    diff = torch.where(fin_rows, (rows - e_rows).abs() / scale, 0.0)
    allowed = atol * (2.0 if grad else 1.0) + rtol * (e_rows.abs() / scale) + step
    worst = (diff - allowed).amax()
    assert worst <= 0, f"{what}: off by {float((diff / allowed).amax()):.3g} times the tolerance"


def _oracle(x, r, w, b, *, eps, is_rms, dout, dresidual_out):
    """The float64 oracle; for fp64 rows beyond its own range (sum(h^2) overflowing fp64, or underflowing with
    eps = 0) fed h * s, s = 2^-floor(log2 max |h|) (exact), and eps * s^2: out is the same, dx and dresidual are s
    times the scaled ones (dresidual_out passed as dresidual_out / s), dweight and dbias the same."""
    h = x.detach().double() + r.detach().double()
    amax = float(h.abs().max())
    if x.dtype != torch.float64 or not (amax > 1e150 or (amax < 1e-150 and eps == 0)):
        return oracle(x, r, w, b, eps=eps, is_rms=is_rms, dout=dout, dresidual_out=dresidual_out)
    k = -math.floor(math.log2(amax))

    def times_2_to(t, e):  # t * 2^e in two exact steps: 2^e alone may be beyond fp64's range
        return t * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)

    xs, rs = times_2_to(x.detach(), k).requires_grad_(True), times_2_to(r.detach(), k).requires_grad_(True)
    eps_s = eps * 2.0 ** (2 * k) if k < 0 else 0.0  # a tiny row is scaled only when eps = 0
    ref = oracle(xs, rs, w, b, eps=eps_s, is_rms=is_rms, dout=dout, dresidual_out=times_2_to(dresidual_out, -k))
    ref["residual_out"] = times_2_to(ref["residual_out"], -k)
    ref["dx"], ref["dresidual"] = times_2_to(ref["dx"], k), times_2_to(ref["dresidual"], k)
    return ref


def run_and_check(is_rms, x, r, w, b, eps):
    if is_rms:
        out, res = add_rms_norm(x, r, w, eps, backend="triton")
    else:
        out, res = add_layer_norm(x, r, w, b, eps, backend="triton")
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype).to(out.device)
    dres = torch.randn(res.shape, generator=gen).to(res.dtype).to(res.device)
    torch.autograd.backward((out, res), (dout, dres))
    ref = _oracle(x, r, w, None if is_rms else b, eps=eps, is_rms=is_rms, dout=dout, dresidual_out=dres)
    m = x.shape[0]
    check(out, ref["out"], "out")
    assert torch.equal(res.detach().cpu().double(), ref["residual_out"].cpu()), "residual_out"
    check(x.grad, ref["dx"], "dx", grad=True)
    check(r.grad, ref["dresidual"], "dresidual", grad=True)
    check(w.grad, ref["dweight"], "dweight", grad=True, reduced_rows=m)
    if not is_rms:
        check(b.grad, ref["dbias"], "dbias", grad=True, reduced_rows=m)
    return out


def _id(case):
    dtype, scale = case
    return f"{str(dtype).split('.')[-1]}-{scale:g}"


@pytest.mark.parametrize("eps", [0.0, 1e-5], ids=["eps0", "eps1e-5"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_rows_at_every_scale(device, case, is_rms, eps):
    dtype, scale = case
    run_and_check(is_rms, *_rows(3, 40, dtype, [scale], device), eps)


MIXED = [1.0, 1e37, 1e-41, 0.5, 3e38, 1e-38 * 0.25, 2.0]
MIXED_BF16 = [1.0, 1e37, BF16_TINY, 0.5, 3e38, 1e-25, 2.0]


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_mixed_scales_and_its_ordinary_rows_bits(device, dtype, is_rms):
    """Each row is checked by its own guard: ordinary rows beside scaled ones keep the bits they have alone."""
    x, r, w, b = _rows(7, 48, dtype, MIXED if dtype == torch.float32 else MIXED_BF16, device)
    out = run_and_check(is_rms, x, r, w, b, 0.0)
    ordinary = [0, 3, 6]
    with torch.no_grad():
        xo, ro = x[ordinary].contiguous(), r[ordinary].contiguous()
        alone = add_rms_norm(xo, ro, w, 0.0, backend="triton")[0] if is_rms else None
        if not is_rms:
            alone = add_layer_norm(xo, ro, w, b, 0.0, backend="triton")[0]
    assert torch.equal(out.detach()[ordinary], alone)


@pytest.fixture
def looped(monkeypatch):
    """Force the looped kernels (forward, and the backward's row sums + tiles): rows wider than 64 elements."""
    monkeypatch.setattr(P, "tuning", lambda: TINY)


@pytest.mark.parametrize("eps", [0.0, 1e-5], ids=["eps0", "eps1e-5"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_looped_path(device, looped, dtype, is_rms, eps):
    scales = {torch.float16: [65504.0, 1e-6, 1.0]}.get(
        dtype, [1e37, 1e-41 if dtype == torch.float32 else BF16_TINY, 1.0]
    )
    run_and_check(is_rms, *_rows(3, 100, dtype, scales, device), eps)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("eps", [0.0, 1e-5], ids=["eps0", "eps1e-5"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_team_fallback(device, monkeypatch, k, is_rms, eps):
    """K programs per row (the interpreter runs the team's two-kernel fallback, which shares its helpers)."""
    tuning = W.WideTuning(team=k)
    monkeypatch.setattr(W, "wide_tuning", lambda: tuning)
    run_and_check(is_rms, *_rows(4, 96, torch.float32, [1e37, 1e-41, 1.0, 3e38], device), eps)


# --------------------------------------------------------------------------------------------------------------
# The quantized kernels on the same rows
# --------------------------------------------------------------------------------------------------------------


def _quant_oracle(x, r, w, b, is_rms, eps, qd):
    """float64 values v = y / scale, saturated, and the scales, per token (the contract of addnorm.ops.quant)."""
    h = (x.double() + r.double()).to(x.dtype).double()
    n = h.shape[-1]
    if is_rms:
        y = torch.nn.functional.rms_norm(h, (n,), None, eps) * w.double()
    else:
        y = torch.nn.functional.layer_norm(h, (n,), None, None, eps) * w.double() + b.double()
    qmax = QMAX[qd]
    s = (y.abs().amax(-1, keepdim=True) / qmax).clamp(min=min_scale(qd))
    return (y / s).clamp(-qmax, qmax), s


@pytest.mark.parametrize("qd", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
@pytest.mark.parametrize("eps", [0.0, 1e-5], ids=["eps0", "eps1e-5"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows(device, dtype, is_rms, eps, qd):
    scales = [1e37, 3e38, 1e-41 if dtype == torch.float32 else BF16_TINY, 1e20, 1.0]
    x, r, w, b = (t.detach() for t in _rows(5, 64, dtype, scales, device))
    if is_rms:
        q, res, s = add_rms_norm_quant(x, r, w, eps, quant_dtype=qd, backend="triton")
    else:
        q, res, s = add_layer_norm_quant(x, r, w, b, eps, quant_dtype=qd, backend="triton")
    v, s_ref = _quant_oracle(x.cpu(), r.cpu(), w.cpu(), b.cpu(), is_rms, eps, qd)
    torch.testing.assert_close(s.cpu().double().reshape(s_ref.shape), s_ref, rtol=1e-5, atol=0)
    codes = q.cpu().to(torch.float64) if qd == torch.int8 else q.cpu().to(torch.float32).double()
    # one code apart where fp32 and fp64 straddle a rounding boundary; e4m3 codes step by 2^-3 relative
    step = 1.0 if qd == torch.int8 else 0.0
    rel = 0.0 if qd == torch.int8 else 2.0**-3
    assert ((codes - v).abs() <= step + rel * v.abs() + 1e-9).all()
    assert not math.isnan(float(codes.abs().max()))


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
@pytest.mark.parametrize("path", ["rows", "looped"])
def test_in_place_rows_beyond_range(device, monkeypatch, path, is_rms):
    """out written over x (no residual_out) and the in-place add + norm (residual_out over the residual): the rows
    redone through the scaled pass still read their own h, not the output written over it."""
    if path == "looped":
        monkeypatch.setattr(P, "tuning", lambda: TINY)
    n = 100 if path == "looped" else 40
    x, r, w, b = (t.detach() for t in _rows(4, n, torch.float32, [1.0, 1e37, 1e-41, 3e38], device))
    ref = oracle(x, None, w, None if is_rms else b, eps=0.0, is_rms=is_rms)
    x1 = x.clone()
    T.forward_into(x1, None, None, None, x1, None, w, None if is_rms else b, eps=0.0, is_rms=is_rms, dropout_p=0.0,
                   seed=None, zero_centered_weight=False)  # fmt: skip
    check(x1, ref["out"], "out over x")
    ref = oracle(x, r, w, None if is_rms else b, eps=0.0, is_rms=is_rms)
    x2, r2 = x.clone(), r.clone()
    if is_rms:
        add_rms_norm_(x2, r2, w, 0.0, backend="triton")
    else:
        add_layer_norm_(x2, r2, w, b, 0.0, backend="triton")
    check(x2, ref["out"], "out over x, residual_out over the residual")
    assert torch.equal(r2.double(), ref["residual_out"])
