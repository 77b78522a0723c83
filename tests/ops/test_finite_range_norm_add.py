"""The finite-range guard (issue 38) in the fused norm-then-add ops: norm_add and norm_add_norm on rows whose plain
fp32 statistics overflow or underflow (fp32 at 1e37, 1e-30 and subnormal with eps = 0, bf16 at 1e30, fp16 near
65504), forward and every gradient against float64, and the decode-size fast launch's forward. The weights carry
the row scale, so h (and N2's statistics) are as extreme as y."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops.norm_add import norm_add, norm_add_norm
from tests.ops.test_finite_range import assert_close64

BACKENDS = ["torch", "cpu", "triton", "reference"]
CASES = [
    (torch.float32, 1e37),
    (torch.float32, 1e-30),
    (torch.float32, 1e-42),  # subnormal
    (torch.bfloat16, 1e30),
    (torch.float16, 6e4),
    (torch.float32, 1.0),  # ordinary rows: the guard must not change them
    (torch.bfloat16, 1.0),
]
IDS = [f"{str(d).split('.')[-1]}-{s:g}" for d, s in CASES]
N = 50  # not a power of two


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _inputs(dtype, s, is_rms, seed=0):
    """y (|y| <= 0.9 s), residual (|.| <= 0.05 s), weights ~0.2 s and biases ~0.02 s: |h| stays below ~0.6 s."""
    g = torch.Generator().manual_seed(seed)
    m = 3
    y = (torch.rand(m, N, generator=g, dtype=torch.float64) * 1.8 - 0.9) * s
    y[1] = (0.5 + 0.4 * (torch.rand(N, generator=g, dtype=torch.float64) * 2 - 1)) * s  # mean far from 0
    r = (torch.rand(m, N, generator=g, dtype=torch.float64) * 0.1 - 0.05) * s
    # weights at most 1e-30 small: subnormal weights would leave g = dout * w a few bits (fp32 arithmetic, not the
    # guard); h is then ~1e-31, still beyond the plain statistics' range with eps = 0
    ws = max(s, 1e-30)
    w1, w2 = ((0.2 + 0.04 * torch.randn(2, N, generator=g, dtype=torch.float64)) * ws).to(dtype)
    b1, b2 = (None, None) if is_rms else (0.02 * ws * torch.randn(2, N, generator=g, dtype=torch.float64)).to(dtype)
    return y.to(dtype), r.to(dtype), w1, b1, w2, b2, g


def _norm64(x, w, b, is_rms):
    if is_rms:
        xhat = x * torch.rsqrt(x.square().mean(-1, keepdim=True))
    else:
        d = x - x.mean(-1, keepdim=True)
        xhat = d * torch.rsqrt(d.square().mean(-1, keepdim=True))
    out = xhat * w
    return out if b is None else out + b


def _leaves(*ts):
    return [None if t is None else t.detach().double().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("has_norm2", [False, True], ids=["norm_add", "norm_add_norm"])
@pytest.mark.parametrize("dtype,s", CASES, ids=IDS)
def test_norm_add_extreme_rows_match_float64(backend, is_rms, has_norm2, dtype, s):
    _skip_unavailable(backend)
    y, r, w1, b1, w2, b2, g = _inputs(dtype, s, is_rms)
    norm = "rms" if is_rms else "layer"
    ins = [None if t is None else t.clone().requires_grad_(True) for t in (y, r, w1, b1, w2, b2)]
    yg, rg, w1g, b1g, w2g, b2g = ins
    if has_norm2:
        out2, h = norm_add_norm(yg, rg, w1g, w2g, b1g, b2g, 0.0, 0.0, norm=norm, backend=backend)
    else:
        h, out2 = norm_add(yg, rg, w1g, b1g, 0.0, norm=norm, backend=backend), None
    # float64 oracle: h = residual + N1(y); N2 of the stored h (the rounding of h passes the gradient straight on)
    yd, rd, w1d, b1d, w2d, b2d = _leaves(y, r, w1, b1, w2, b2)
    hd = rd + _norm64(yd, w1d, b1d, is_rms)
    hd.retain_grad()
    # the composition's autograd (torch, reference) rounds the gradient reaching h to h's dtype before N1's backward
    # (the fused kernels keep it in fp32): one more rounding of a half dtype in dy, dresidual, dw1 and db1, at any
    # scale (bf16 at 1.0 too)
    loose = 16.0 if backend in ("torch", "reference") and has_norm2 and dtype != torch.float32 else 1.0
    assert_close64(h, hd, dtype, f"{backend} h")
    dh = torch.randn(h.shape, generator=g).to(dtype)
    outs, grads = [h], [dh]
    want_outs, want_grads = [hd], [dh.double()]
    if has_norm2:
        h_used = hd + (h.detach().double() - hd).detach()
        want2 = _norm64(h_used, w2d, b2d, is_rms)
        assert_close64(out2, want2, dtype, f"{backend} out2")
        do2 = torch.randn(out2.shape, generator=g).to(dtype)
        outs.append(out2), grads.append(do2)
        want_outs.append(want2), want_grads.append(do2.double())
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(want_outs, want_grads)
    for got, want, what in ((yg.grad, yd.grad, "dy"), (rg.grad, rd.grad, "dresidual")):
        row = want.abs().where(want.to(dtype).isfinite(), 0).amax(-1, keepdim=True)
        assert_close64(got, want, dtype, f"{backend} {what}", scale=loose * row)
    # dweight, dbias: sums over rows; tolerance relative to each column's sum of |terms|
    t = hd.grad
    xhat1 = _norm64(yd.detach(), 1.0, None, is_rms)
    assert_close64(w1g.grad, w1d.grad, dtype, f"{backend} dw1", scale=loose * (t * xhat1).abs().sum(0))
    if not is_rms:
        assert_close64(b1g.grad, b1d.grad, dtype, f"{backend} db1", scale=loose * t.abs().sum(0))
    if has_norm2:
        xhat2 = _norm64(h.detach().double(), 1.0, None, is_rms)
        assert_close64(w2g.grad, w2d.grad, dtype, f"{backend} dw2", scale=(do2.double() * xhat2).abs().sum(0))
        if not is_rms:
            assert_close64(b2g.grad, b2d.grad, dtype, f"{backend} db2", scale=do2.double().abs().sum(0))


@pytest.mark.parametrize("has_norm2", [False, True], ids=["norm_add", "norm_add_norm"])
@pytest.mark.parametrize("dtype,s", CASES, ids=IDS)
def test_fast_launch_extreme_rows_match_float64(has_norm2, dtype, s):
    """Inference (no grad, contiguous, decode size): the cpu fast launch, the same kernel, the same guard."""
    _skip_unavailable("cpu")
    y, r, w1, b1, w2, b2, _ = _inputs(dtype, s, is_rms=False, seed=2)
    with torch.no_grad():
        if has_norm2:
            out2, h = norm_add_norm(y, r, w1, w2, b1, None, 0.0, 0.0, norm="layer", norm2="rms", backend="cpu")
        else:
            h = norm_add(y, r, w1, b1, 0.0, norm="layer", backend="cpu")
    want_h = r.double() + _norm64(y.double(), w1.double(), b1.double(), False)
    assert_close64(h, want_h, dtype, "fast h")
    if has_norm2:
        assert_close64(out2, _norm64(h.double(), w2.double(), None, True), dtype, "fast out2")
