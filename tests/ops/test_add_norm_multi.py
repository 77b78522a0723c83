"""add_norm_multi (x1, rowscale, weight1/bias1, RMSNorm bias, returned dropout masks) against a float64 oracle,
forward and every gradient, on every backend (Triton in its interpreter at tiny sizes)."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops import contract as C
from addnorm.ops.add_norm_multi import add_norm_multi
from addnorm.testing import assert_close

ALL = ["torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def multi_oracle(
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    is_rms,
    x1=None,
    weight1=None,
    bias1=None,
    rowscale=None,
    dropout_p=0.0,
    mask=None,
    mask1=None,
    residual_dtype=None,
    zero_centered_weight=False,
    cast_before_weight=False,
    out_dtype=None,
):
    """The extended contract in float64, written independently of the code under test. Returns the float64 leaves
    (for gradients) and the outputs (out, residual_out, out1), residual_out rounded to residual_dtype as stored."""
    rd = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    od = out_dtype or x.dtype
    inputs = dict(x=x, residual=residual, weight=weight, bias=bias, x1=x1, weight1=weight1, bias1=bias1)
    leaves = {k: v.detach().double().requires_grad_(True) for k, v in inputs.items() if v is not None}
    h = leaves["x"]
    if rowscale is not None:
        h = h * rowscale.double().reshape(*x.shape[:-1], 1)
    if dropout_p > 0:
        h = torch.where(mask, h / (1 - dropout_p), torch.zeros((), dtype=torch.float64))
    if x1 is not None:
        h1 = leaves["x1"]
        if dropout_p > 0:
            h1 = torch.where(mask1, h1 / (1 - dropout_p), torch.zeros((), dtype=torch.float64))
        h = h + h1
    if residual is not None:
        h = h + leaves["residual"]
    res = h + (h.detach().to(rd).double() - h.detach())  # stored in residual_dtype, gradient straight through
    if is_rms:
        xhat = res * torch.rsqrt(res.square().mean(-1, keepdim=True) + eps)
    else:
        mu = res.mean(-1, keepdim=True)
        xhat = (res - mu) * torch.rsqrt((res - mu).square().mean(-1, keepdim=True) + eps)

    def affine(w, b):
        y = xhat
        if cast_before_weight and (w is not None or b is not None):
            y = y + (y.detach().to(od).double() - y.detach())
        if w is not None:
            y = y * (w + 1 if zero_centered_weight else w)
        if b is not None:
            y = y + b
        return y

    out1 = affine(leaves.get("weight1"), leaves.get("bias1")) if weight1 is not None else None
    return leaves, affine(leaves.get("weight"), leaves.get("bias")), res, out1


def _inputs(shape, dtype, g, *, residual=True, x1=False, weight1=False, bias=True, rowscale=False):
    n = shape[-1]

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dtype)

    return dict(
        x=rnd(*shape).requires_grad_(True),
        residual=rnd(*shape).requires_grad_(True) if residual else None,
        weight=(1 + 0.2 * torch.randn(n, generator=g)).to(dtype).requires_grad_(True),
        bias=(0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_(True) if bias else None,
        x1=rnd(*shape).requires_grad_(True) if x1 else None,
        weight1=(1 + 0.2 * torch.randn(n, generator=g)).to(dtype).requires_grad_(True) if weight1 else None,
        bias1=(0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_(True) if weight1 and bias else None,
        rowscale=torch.rand(shape[:-1], generator=g) + 0.5 if rowscale else None,
    )


CASES = {
    # name: (input flags, op options)
    "x1": (dict(x1=True), {}),
    "x1+dropout": (dict(x1=True), dict(dropout_p=0.25)),
    "rowscale": (dict(rowscale=True), {}),
    "rowscale+dropout": (dict(rowscale=True), dict(dropout_p=0.3)),
    "x1+rowscale+dropout,no residual": (dict(x1=True, rowscale=True, residual=False), dict(dropout_p=0.2)),
    "weight1": (dict(weight1=True), {}),
    "weight1+x1+dropout": (dict(weight1=True, x1=True), dict(dropout_p=0.2)),
    "dropout mask only": ({}, dict(dropout_p=0.4)),
    "zero centered, weight1": (dict(weight1=True), dict(zero_centered_weight=True)),
}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_every_gradient_match_the_float64_oracle(backend, is_rms, case):
    _skip_unavailable(backend)
    flags, opts = CASES[case]
    g = torch.Generator().manual_seed(3)
    t = _inputs((2, 3, 40), torch.float32, g, **flags)  # rms gets a bias too: RMSNorm with bias
    eps = 1e-5
    res = add_norm_multi(
        t["x"],
        t["residual"],
        t["weight"],
        t["bias"],
        eps,
        is_rms=is_rms,
        x1=t["x1"],
        weight1=t["weight1"],
        bias1=t["bias1"],
        rowscale=t["rowscale"],
        return_dropout_mask=True,
        backend=backend,
        **opts,
    )
    p = opts.get("dropout_p", 0.0)
    if p > 0:
        assert res.dropout_mask.dtype == torch.bool and res.dropout_mask.shape == t["x"].shape
        assert 0.3 < res.dropout_mask.float().mean().item() < 0.95  # a real mask, not all kept
        assert (res.dropout_mask1 is not None) == (t["x1"] is not None)
    else:
        assert res.dropout_mask is None and res.dropout_mask1 is None
    leaves, out, res_out, out1 = multi_oracle(
        t["x"],
        t["residual"],
        t["weight"],
        t["bias"],
        eps=eps,
        is_rms=is_rms,
        x1=t["x1"],
        weight1=t["weight1"],
        bias1=t["bias1"],
        rowscale=t["rowscale"],
        dropout_p=p,
        mask=res.dropout_mask,
        mask1=res.dropout_mask1,
        zero_centered_weight=opts.get("zero_centered_weight", False),
    )
    assert_close(res.out, out, "out")
    assert_close(res.residual_out, res_out, "residual_out")
    assert (res.out1 is None) == (out1 is None)
    if out1 is not None:
        assert_close(res.out1, out1, "out1")
    # every gradient: random cotangents on every output
    outs = [(res.out, out), (res.residual_out, res_out)] + ([(res.out1, out1)] if out1 is not None else [])
    cot = [torch.randn(o.shape, generator=g) for o, _ in outs]
    torch.autograd.backward([o for o, _ in outs], cot)
    torch.autograd.backward([e for _, e in outs], [c.double() for c in cot])
    for name, leaf in leaves.items():
        actual = t[name].grad
        assert actual is not None, f"no gradient reached {name}"
        rows = 6 if name in ("weight", "bias", "weight1", "bias1") else 1
        assert_close(actual, leaf.grad, f"d{name}", grad=True, reduced_rows=rows)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_cast_before_weight_with_weight1_and_fp32_stream(backend):
    g = torch.Generator().manual_seed(5)
    t = _inputs((4, 48), torch.bfloat16, g, weight1=True, x1=True)
    t["residual"] = torch.randn(4, 48, generator=g).requires_grad_(True)  # fp32 residual stream
    res = add_norm_multi(
        t["x"],
        t["residual"],
        t["weight"],
        t["bias"],
        1e-5,
        x1=t["x1"],
        weight1=t["weight1"],
        bias1=t["bias1"],
        cast_before_weight=True,
        backend=backend,
    )
    assert res.out.dtype == res.out1.dtype == torch.bfloat16 and res.residual_out.dtype == torch.float32
    _, out, res_out, out1 = multi_oracle(
        t["x"],
        t["residual"],
        t["weight"],
        t["bias"],
        eps=1e-5,
        is_rms=False,
        x1=t["x1"],
        weight1=t["weight1"],
        bias1=t["bias1"],
        cast_before_weight=True,
    )
    assert_close(res.residual_out, res_out, "residual_out")
    assert_close(res.out, out, "out")
    assert_close(res.out1, out1, "out1")


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
def test_returned_mask_is_the_kernels_keep_function(backend):
    """With the same generator state, the mask returned equals the contract's keep mask for the seed the kernels
    would draw, and the fused op (no mask asked) gives bitwise the same residual_out."""
    x = torch.randn(5, 24)
    torch.manual_seed(11)
    res = add_norm_multi(x, None, None, None, 1e-5, dropout_p=0.5, return_dropout_mask=True, backend=backend)
    torch.manual_seed(11)
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    assert torch.equal(res.dropout_mask, C.dropout_keep_mask(seed, 5, 24, 0.5))
    torch.manual_seed(11)
    fused = add_norm_multi(x, None, None, None, 1e-5, dropout_p=0.5, backend=backend)
    assert torch.equal(fused.residual_out, res.residual_out)


def test_plain_call_is_the_fused_op():
    """No extra feature: exactly add_layer_norm's result (the fused path)."""
    import addnorm

    x, r, w, b = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), torch.randn(16)
    res = add_norm_multi(x, r, w, b, 1e-5, backend="cpu")
    out, res_out = addnorm.add_layer_norm(x, r, w, b, 1e-5, backend="cpu")
    assert torch.equal(res.out, out) and torch.equal(res.residual_out, res_out)
    assert res.out1 is None and res.dropout_mask is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(x1=torch.randn(3, 8)), "x1 must have x's shape"),
        (dict(weight1=torch.randn(5)), r"weight1 must have shape \(4,\)"),
        (dict(bias1=torch.randn(4)), "bias1 was given without weight1"),
        (dict(rowscale=torch.randn(3)), "rowscale must hold one value per row"),
        (dict(rowscale=torch.randn(2), dropout_p=1.0), "dropout_p must be in"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        add_norm_multi(torch.randn(2, 4), None, None, None, 1e-5, **kwargs)
