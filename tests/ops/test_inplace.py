"""The in-place serving ops add_rms_norm_ / add_layer_norm_ against the out-of-place ops, on every backend, eagerly
and under torch.compile(fullgraph=True); their refusals (grad, aliasing, no residual)."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops import backends

ALL = ["torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _inputs(shape, x_dtype, r_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(x_dtype)
    r = torch.randn(shape, generator=g).to(r_dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(x_dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(x_dtype)
    return x, r, w, b


def _both(is_rms, x, r, w, b, backend, **kw):
    """(out-of-place (out, residual_out), in-place (x, residual) after the call) for the same inputs."""
    xi, ri = x.clone(), r.clone()
    if is_rms:
        expected = addnorm.add_rms_norm(x, r, w, None, backend=backend, **kw)
        got = addnorm.add_rms_norm_(xi, ri, w, None, backend=backend, **kw)
    else:
        expected = addnorm.add_layer_norm(x, r, w, b, 1e-5, backend=backend, **kw)
        got = addnorm.add_layer_norm_(xi, ri, w, b, 1e-5, backend=backend, **kw)
    assert got[0] is xi and got[1] is ri  # returns its arguments, written in place
    return expected, (xi, ri)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize(
    "x_dtype, r_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
    ids=["fp32", "bf16", "bf16-fp32stream", "fp16-fp32stream"],
)
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 100), (1, 7)], ids=str)
def test_in_place_equals_out_of_place_bit_for_bit(backend, is_rms, x_dtype, r_dtype, shape):
    _skip_unavailable(backend)
    x, r, w, b = _inputs(shape, x_dtype, r_dtype)
    (out, res_out), (xi, ri) = _both(is_rms, x, r, w, b, backend)
    assert xi.dtype == x_dtype and ri.dtype == r_dtype
    assert torch.equal(ri, res_out)
    assert torch.equal(xi, out)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("opts", [dict(zero_centered_weight=True), dict(cast_before_weight=True)], ids=["zc", "cbw"])
def test_in_place_options(backend, opts):
    _skip_unavailable(backend)
    x, r, w, b = _inputs((4, 64), torch.bfloat16, torch.float32)
    for is_rms in (False, True):
        (out, res_out), (xi, ri) = _both(is_rms, x, r, w, b, backend, **opts)
        assert torch.equal(ri, res_out) and torch.equal(xi, out)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_kernel_backends_write_into_the_given_memory(backend, monkeypatch):
    """No (M, N) output is allocated: the kernel writes x and residual directly (forward_into), never through the
    allocating forward and a copy back."""
    _skip_unavailable(backend)
    x, r, _, _ = _inputs((8, 64), torch.float32, torch.float32)
    expected = addnorm.add_rms_norm(x, r, None, 1e-6, backend=backend)
    from addnorm.ops import torch_backend

    def refuse(*a, **k):
        raise AssertionError("the in-place op went through an allocating path")

    monkeypatch.setattr(backends.kernel_module(backend), "forward", refuse)
    monkeypatch.setattr(torch_backend, "add_norm", refuse)
    ptrs = (x.data_ptr(), r.data_ptr())
    addnorm.add_rms_norm_(x, r, None, 1e-6, backend=backend)
    assert (x.data_ptr(), r.data_ptr()) == ptrs
    assert torch.equal(x, expected[0]) and torch.equal(r, expected[1])


@pytest.mark.parametrize("backend", ALL)
def test_non_contiguous_inputs_are_written_in_place_too(backend):
    _skip_unavailable(backend)
    xb, rb, w, _ = _inputs((6, 80), torch.float32, torch.float32)
    x, r = xb[:, 8:72], rb[:, 8:72]  # strided rows: views into bigger buffers
    expected = addnorm.add_rms_norm(x.clone(), r.clone(), w[8:72].clone(), 1e-6, backend=backend)
    before = xb[:, :8].clone(), rb[:, 72:].clone()
    addnorm.add_rms_norm_(x, r, w[8:72].clone(), 1e-6, backend=backend)
    assert torch.equal(x, expected[0]) and torch.equal(r, expected[1])
    assert torch.equal(xb[:, :8], before[0]) and torch.equal(rb[:, 72:], before[1])  # nothing outside touched


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu", "triton"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_in_place_under_compile_fullgraph(backend, is_rms):
    _skip_unavailable(backend)
    x, r, w, b = _inputs((4, 32), torch.bfloat16, torch.float32, seed=2)
    expected = (
        addnorm.add_rms_norm(x, r, w, None, backend=backend)
        if is_rms
        else addnorm.add_layer_norm(x, r, w, b, 1e-5, backend=backend)
    )

    def f(x, r, w, b):
        if is_rms:
            addnorm.add_rms_norm_(x, r, w, backend=backend)
        else:
            addnorm.add_layer_norm_(x, r, w, b, backend=backend)
        return x.float().sum()

    xi, ri = x.clone(), r.clone()
    total = torch.compile(f, fullgraph=True, backend="aot_eager")(xi, ri, w, b)
    assert torch.equal(ri, expected[1]) and torch.equal(xi, expected[0])
    assert total.item() == expected[0].float().sum().item()  # the graph saw the mutated x


def test_inference_mode_and_no_grad_with_parameters():
    """A model's Parameter (requires_grad) is fine once grad mode is off, as in any serving loop."""
    lin = torch.nn.Linear(32, 32)
    w = torch.nn.Parameter(torch.ones(32))
    x, r = torch.randn(3, 32), torch.randn(3, 32)
    with torch.inference_mode():
        xi, ri = lin(x), r.clone()
        addnorm.add_rms_norm_(xi, ri, w, backend="cpu")
    with torch.no_grad():
        xj, rj = lin(x), r.clone()
        addnorm.add_rms_norm_(xj, rj, w, backend="cpu")
        expected = addnorm.add_rms_norm(lin(x), r, w, backend="cpu")
    assert torch.equal(xi, xj) and torch.equal(ri, rj)
    assert torch.equal(xi, expected[0]) and torch.equal(ri, expected[1])


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda x, r, w: (x.requires_grad_(True), r, None), RuntimeError, "x requires grad"),
        (lambda x, r, w: (x, r.requires_grad_(True), None), RuntimeError, "residual requires grad"),
        (lambda x, r, w: (x, r, w.requires_grad_(True)), RuntimeError, "weight requires grad"),
        (lambda x, r, w: (x, None, None), ValueError, "residual must be a tensor"),
        (lambda x, r, w: (x, x, None), ValueError, "must not share memory"),
        (lambda x, r, w: (x, r[:, :8], None), ValueError, "residual must have x's shape"),
        (lambda x, r, w: (x, r, w[:4]), ValueError, "weight must have shape"),
    ],
    ids=["x-grad", "residual-grad", "weight-grad", "no-residual", "aliased", "shape", "weight-shape"],
)
def test_refusals_name_the_problem(make, exc, words):
    x, r, w, _ = _inputs((3, 16), torch.float32, torch.float32)
    x, r, w = make(x, r, w)
    with pytest.raises(exc, match=words):
        addnorm.add_rms_norm_(x, r, w)
