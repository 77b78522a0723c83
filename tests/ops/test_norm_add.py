"""norm_add (residual + Norm(y)) against a float64 oracle, forward and every gradient, on every backend (Triton in its
interpreter at tiny sizes), over dtypes and awkward shapes; its bad input; and Hugging Face's two roundings."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops.norm_add import norm_add
from addnorm.testing import assert_close

ALL = ["torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def oracle(y, residual, weight, bias, *, eps, is_rms, zero_centered_weight=False, cast_before_weight=False):
    """residual + Norm(y) in float64, written apart from the code under test: the norm's output rounded to y's
    dtype as stored (gradient straight through), the sum rounded to the promoted dtype. Returns (leaves, out)."""
    inputs = dict(y=y, residual=residual, weight=weight, bias=bias)
    leaves = {k: v.detach().double().requires_grad_(True) for k, v in inputs.items() if v is not None}
    h = leaves["y"]
    if not is_rms:
        h = h - h.mean(-1, keepdim=True)
    xhat = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)

    def rounded(t, dtype):
        return t + (t.detach().to(dtype).double() - t.detach())

    if cast_before_weight and weight is not None:
        xhat = rounded(xhat, y.dtype)
    w = leaves.get("weight")
    if w is not None:
        xhat = xhat * (w + 1 if zero_centered_weight else w)
    if "bias" in leaves:
        xhat = xhat + leaves["bias"]
    out = rounded(xhat, y.dtype) + leaves["residual"]
    return leaves, rounded(out, torch.promote_types(y.dtype, residual.dtype))


def _inputs(shape, dtype, g, *, bias, residual_dtype=None, strided=False):
    n = shape[-1]

    def rnd(*s):
        return (torch.randn(*s, generator=g) * 2 + 0.5).to(dtype)

    y = rnd(*shape)
    if strided:  # rows of a wider buffer: the last dim contiguous, the row stride not N
        y = rnd(*shape[:-1], n + 7)[..., :n]
    return dict(
        y=y.requires_grad_(True),
        residual=rnd(*shape).to(residual_dtype or dtype).requires_grad_(True),
        weight=(1 + 0.2 * torch.randn(n, generator=g)).to(dtype).requires_grad_(True),
        bias=(0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_(True) if bias else None,
    )


SHAPES = {"3x40": (3, 40), "0 rows": (0, 24), "1 row": (1, 33), "2x5x77": (2, 5, 77)}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_and_every_gradient_match_the_float64_oracle(backend, dtype, is_rms, shape):
    _skip_unavailable(backend)
    if backend == "triton" and dtype != torch.float32 and shape != "3x40":
        pytest.skip("Triton's interpreter is slow: one shape per reduced dtype")
    g = torch.Generator().manual_seed(7)
    t = _inputs(SHAPES[shape], dtype, g, bias=not is_rms, strided=shape == "2x5x77")
    eps = 1e-5
    got = norm_add(
        t["y"], t["residual"], t["weight"], t["bias"], eps, norm="rms" if is_rms else "layer", backend=backend
    )
    leaves, want = oracle(t["y"], t["residual"], t["weight"], t["bias"], eps=eps, is_rms=is_rms)
    assert got.dtype == dtype and got.shape == t["y"].shape
    assert_close(got, want, "out")
    cot = torch.randn(got.shape, generator=g).to(dtype)
    got.backward(cot)
    want.backward(cot.double())
    rows = max(1, got.numel() // got.shape[-1])
    for name, leaf in leaves.items():
        actual = t[name].grad
        assert actual is not None, f"no gradient reached {name}"
        reduced = rows if name in ("weight", "bias") else 1
        assert_close(actual, leaf.grad, f"d{name}", grad=True, reduced_rows=reduced)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("option", ["zero_centered_weight", "cast_before_weight"])
def test_options_match_the_oracle_in_bf16(backend, option):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(8)
    t = _inputs((4, 48), torch.bfloat16, g, bias=False)
    got = norm_add(t["y"], t["residual"], t["weight"], None, 1e-6, norm="rms", backend=backend, **{option: True})
    leaves, want = oracle(t["y"], t["residual"], t["weight"], None, eps=1e-6, is_rms=True, **{option: True})
    assert_close(got, want, "out")
    got.float().sum().backward()
    want.sum().backward()
    for name, leaf in leaves.items():
        assert_close(t[name].grad, leaf.grad, f"d{name}", grad=True, reduced_rows=4 if name == "weight" else 1)


def test_fp32_residual_stream_with_bf16_branch():
    """The sum takes torch's promotion: an fp32 residual plus the bf16 norm output is fp32."""
    g = torch.Generator().manual_seed(9)
    t = _inputs((5, 64), torch.bfloat16, g, bias=True, residual_dtype=torch.float32)
    got = norm_add(t["y"], t["residual"], t["weight"], t["bias"], 1e-5, norm="layer", backend="torch")
    _, want = oracle(t["y"], t["residual"], t["weight"], t["bias"], eps=1e-5, is_rms=False)
    assert got.dtype == torch.float32
    assert_close(got, want, "out", dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_equals_huggingface_olmo2_order_bitwise(backend):
    """What OLMo 2 computes, ``residual + norm(h)`` with the norm returning h's dtype, bit for bit in bf16 (the
    torch backend's RMSNorm is F.rms_norm's math; the cpu kernel's statistics agree with it on these rows)."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(10)
    y = torch.randn(6, 96, generator=g).to(torch.bfloat16)
    r = torch.randn(6, 96, generator=g).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(torch.bfloat16)
    yf = y.float()
    hf_norm = (w.float() * (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(torch.bfloat16)
    want = r + hf_norm
    got = norm_add(y, r, w, None, 1e-6, norm="rms", backend=backend)
    assert (got != want).float().mean().item() <= 0.01  # an fp32 rsqrt may differ in its last bit on a rare row
    assert (got.float() - want.float()).abs().max().item() <= 2**-7 * want.float().abs().max().item()


def test_bad_input_names_the_argument():
    y, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="norm must be one of"):
        norm_add(y, r, w, norm="batch")
    with pytest.raises(ValueError, match="residual must have y's shape"):
        norm_add(y, torch.randn(2, 9), w)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        norm_add(y, None, w)
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        norm_add([1.0], r, w)
    with pytest.raises(TypeError, match="residual must be a floating tensor"):
        norm_add(y, torch.ones(2, 8, dtype=torch.int64), w)
    with pytest.raises(ValueError, match="bias must be None with norm='rms'"):
        norm_add(y, r, w, torch.zeros(8), norm="rms")
    with pytest.raises(ValueError, match="weight must have shape"):
        norm_add(y, r, torch.ones(9), norm="layer")


def test_exported_from_addnorm():
    import addnorm
    from addnorm import ops

    assert addnorm.norm_add is ops.norm_add is norm_add
    from addnorm.ops.norm_add import norm_add_, norm_add_norm, norm_add_norm_

    assert addnorm.norm_add_ is ops.norm_add_ is norm_add_
    assert addnorm.norm_add_norm is norm_add_norm and addnorm.norm_add_norm_ is ops.norm_add_norm_ is norm_add_norm_


@pytest.mark.parametrize("backend", ALL)
def test_norm_add_norm_is_norm_add_then_the_next_norm(backend):
    """The sandwich chain's contract: h is norm_add's result bitwise, N2(h) is the second norm of h on h's dtype."""
    _skip_unavailable(backend)
    from addnorm.ops.add_norm import add_layer_norm
    from addnorm.ops.norm_add import norm_add_norm

    g = torch.Generator().manual_seed(0)
    y, residual = (torch.randn(5, 48, generator=g).to(torch.bfloat16) for _ in range(2))
    w1, w2, b2 = (torch.randn(48, generator=g).to(torch.bfloat16) for _ in range(3))
    out, h = norm_add_norm(
        y, residual, w1, w2, None, b2, 1e-6, 1e-5, norm="rms", norm2="layer",
        zero_centered_weight=(True, False), backend=backend,
    )  # fmt: skip
    h_expected = norm_add(y, residual, w1, None, 1e-6, zero_centered_weight=True, backend=backend)
    assert torch.equal(h, h_expected)
    assert torch.equal(out, add_layer_norm(h_expected, None, w2, b2, 1e-5, backend=backend)[0])
    with pytest.raises(ValueError, match="norm2"):
        norm_add_norm(y, residual, norm2="batch")
    with pytest.raises(ValueError, match="bias2"):
        norm_add_norm(y, residual, w1, w2, None, b2)
