"""The decode fast path of the norm-then-add ops (:mod:`addnorm.ops.norm_add_fast`) with zero-centered weights
(Gemma's ``x * (1 + w)``, issue 37): such calls take the raw-address launch and give the general path's bits (the
same call with the fast path switched off), out of place and in place, over dtypes, one and eight rows and odd
widths; the calls it still refuses reach the general path with its bits."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops.norm_add import norm_add, norm_add_, norm_add_norm, norm_add_norm_

NA = importlib.import_module("addnorm.ops.norm_add")  # (the package's attribute of that name is the function)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ZC = [(True, True), (True, False), (False, True)]


@pytest.fixture(autouse=True)
def _cpu_backend():
    reason = backends.unavailable_reason("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def launches(monkeypatch):
    """Counts the fused decode launches."""
    from addnorm.ops.cpu import norm_add_fast_launch

    seen = []
    real = norm_add_fast_launch.forward_ptr
    monkeypatch.setattr(norm_add_fast_launch, "forward_ptr", lambda *a: seen.append(1) or real(*a))
    return seen


def _general(monkeypatch, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the fast path switched off: what the general path returns."""
    with monkeypatch.context() as m:
        m.setattr(NA, "try_norm_add", lambda *a: None)
        m.setattr(NA, "try_norm_add_", lambda *a: False)
        return fn(*args, **kwargs)


def _inputs(shape, dtype, seed=0):
    """y, residual, and weights stored zero-centered (w - 1: values around 0), biases."""
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    y, r = (3 * torch.randn(shape, generator=g)).to(dtype), (2 * torch.randn(shape, generator=g)).to(dtype)
    w1, w2 = ((0.5 * torch.randn(n, generator=g)).to(dtype) for _ in range(2))
    b1, b2 = ((0.3 * torch.randn(n, generator=g)).to(dtype) for _ in range(2))
    return y, r, w1, w2, b1, b2


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n", [7, 515])
@pytest.mark.parametrize("norms", ["rms-rms", "layer-rms", "rms-layer"])
def test_zero_centered_calls_take_the_fast_path_with_the_general_bits(monkeypatch, launches, dtype, m, n, norms):
    y, r, w1, w2, b1, b2 = _inputs((m, n), dtype)
    norm1, norm2 = norms.split("-")
    b1, b2 = (None if norm1 == "rms" else b1), (None if norm2 == "rms" else b2)
    taken = 0
    for zc, cast in itertools.product(ZC, (False, True)):
        kw = dict(norm=norm1, norm2=norm2, zero_centered_weight=zc, cast_before_weight=cast, backend="cpu")
        args = (w1, w2, b1, b2, 1e-5, 1e-6)
        with torch.inference_mode():
            got = norm_add_norm(y, r, *args, **kw)
            want = _general(monkeypatch, norm_add_norm, y, r, *args, **kw)
            plain = norm_add_norm(y, r, *args, **{**kw, "zero_centered_weight": False})
            yi, ri = y.clone(), r.clone()
            norm_add_norm_(yi, ri, *args, **kw)
            one = dict(norm=norm1, zero_centered_weight=zc[0], cast_before_weight=cast, backend="cpu")
            h = norm_add(y, r, w1, b1, 1e-5, **one)
            h_want = _general(monkeypatch, norm_add, y, r, w1, b1, 1e-5, **one)
            ri1 = r.clone()
            norm_add_(y.clone(), ri1, w1, b1, 1e-5, **one)
        taken += 5
        for a, b in zip((*got, yi, ri, h, ri1), (*want, want[0], want[1], h_want, h_want), strict=True):
            _same(a, b)
        # (the flags reached the kernel: 1 + w is not w, in the norm that has it)
        assert not torch.equal(got[0], plain[0]) and (zc[1] or not torch.equal(got[1], plain[1]))
    assert len(launches) == taken


def test_a_zero_centered_call_without_that_weight_is_the_plain_call(monkeypatch, launches):
    y, r, *_ = _inputs((2, 33), torch.bfloat16)
    with torch.inference_mode():
        got = norm_add_norm(y, r, None, None, zero_centered_weight=True, backend="cpu")
        want = norm_add_norm(y, r, None, None, backend="cpu")
    _same(got[0], want[0])
    _same(got[1], want[1])
    assert len(launches) == 2


def test_zero_centered_calls_it_does_not_serve_reach_the_general_path(monkeypatch, launches):
    y, r, w1, w2, *_ = _inputs((4, 64), torch.bfloat16)
    wide = _inputs((80, 4096), torch.bfloat16)  # above the parallel threshold: the threaded general launch
    kw = dict(zero_centered_weight=True, backend="cpu")
    declined = {
        "strided y": lambda: norm_add_norm(torch.cat([y, y], 1)[:, ::2], r, w1, w2, **kw),
        "fp32 weight": lambda: norm_add_norm(y, r, w1.float(), w2, **kw),
        "fp32 residual": lambda: norm_add_norm(y, r.float(), w1, w2, **kw),
        "fp64": lambda: norm_add_norm(y.double(), r.double(), w1.double(), w2.double(), **kw),
        "parallel size": lambda: norm_add_norm(*wide[:4], **kw),
        "torch backend": lambda: norm_add_norm(y, r, w1, w2, zero_centered_weight=True, backend="torch"),
    }
    for name, call in declined.items():
        with torch.inference_mode():
            got = call()
            want = _general(monkeypatch, call)
        assert len(launches) == 0, name
        _same(got[0], want[0])
        _same(got[1], want[1])
    # something to differentiate: the autograd route
    out2, _ = norm_add_norm(y, r, w1.clone().requires_grad_(), w2, **kw)
    assert out2.requires_grad and len(launches) == 0
