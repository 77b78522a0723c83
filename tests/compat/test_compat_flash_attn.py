"""addnorm.compat.flash_attn: flash-attention's calling convention and return tuples, every feature against the
float64 oracle (forward and every gradient) on every backend (Triton in its interpreter, tiny sizes), and
layer_norm_linear_fn's recompute."""

from __future__ import annotations

import pytest
import torch

from addnorm.compat import flash_attn as fa
from addnorm.ops import backends
from addnorm.testing import assert_close
from tests.ops.test_add_norm_multi import multi_oracle

ALL = ["torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _t(g, *shape, dtype=torch.float32, scale=1.0, shift=0.0):
    return (shift + scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_(True)


# each case: the flash-attention keyword arguments beyond x, weight, bias (tensors made below)
CASES = {
    "plain": {},
    "residual,prenorm": dict(residual=True, prenorm=True),
    "residual_in_fp32,prenorm": dict(residual_in_fp32=True, prenorm=True),
    "x1,weight1,bias1,prenorm": dict(residual=True, x1=True, weight1=True, prenorm=True),
    "dropout,mask,prenorm": dict(residual=True, dropout_p=0.3, return_dropout_mask=True, prenorm=True),
    "x1,dropout,masks": dict(residual=True, x1=True, dropout_p=0.2, return_dropout_mask=True),
    "rowscale,dropout,masks": dict(residual=True, rowscale=True, dropout_p=0.25, return_dropout_mask=True),
    "zero_centered,weight1": dict(weight1=True, zero_centered_weight=True),
}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm_fn", "rms_norm_fn"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_feature_matches_the_float64_oracle(backend, is_rms, case):
    _skip_unavailable(backend)
    opts = dict(CASES[case])
    g = torch.Generator().manual_seed(4)
    shape, n = (2, 3, 48), 48
    x, w, b = _t(g, *shape), _t(g, n, scale=0.2, shift=1.0), _t(g, n, scale=0.1)
    t = dict(x=x, weight=w, bias=b)
    kw = {}
    for name in ("residual", "x1"):
        if opts.pop(name, False):
            kw[name] = t[name] = _t(g, *shape)
    if opts.pop("weight1", False):
        kw["weight1"] = t["weight1"] = _t(g, n, scale=0.2, shift=1.0)
        kw["bias1"] = t["bias1"] = _t(g, n, scale=0.1)
    if opts.pop("rowscale", False):
        kw["rowscale"] = torch.rand(shape[:-1], generator=g) + 0.5
    kw.update(opts)
    fn = fa.rms_norm_fn if is_rms else fa.layer_norm_fn
    result = fn(x, w, b, eps=1e-6, backend=backend, **kw)
    result = result if isinstance(result, tuple) else (result,)
    # unpack flash-attention's return convention
    items = list(result)
    y = items.pop(0)
    y1 = items.pop(0) if "weight1" in kw else None
    res = items.pop(0) if kw.get("prenorm") else None
    masks = (items.pop(0), items.pop(0)) if kw.get("return_dropout_mask") else (None, None)
    assert not items, "extra outputs"
    if kw.get("dropout_p", 0) > 0:
        assert masks[0].dtype == torch.bool and (masks[1] is not None) == ("x1" in kw)
    leaves, out, res_ref, out1 = multi_oracle(
        x,
        kw.get("residual"),
        w,
        b,
        eps=1e-6,
        is_rms=is_rms,
        x1=kw.get("x1"),
        weight1=kw.get("weight1"),
        bias1=kw.get("bias1"),
        rowscale=kw.get("rowscale"),
        dropout_p=kw.get("dropout_p", 0.0),
        mask=masks[0],
        mask1=masks[1],
        residual_dtype=torch.float32 if kw.get("residual_in_fp32") else None,
        zero_centered_weight=kw.get("zero_centered_weight", False),
    )
    assert_close(y, out, "y")
    pairs = [(y, out)]
    if y1 is not None:
        assert_close(y1, out1, "y1")
        pairs.append((y1, out1))
    if res is not None:
        assert_close(res, res_ref, "residual_out")
        pairs.append((res, res_ref))
    cot = [torch.randn(a.shape, generator=g) for a, _ in pairs]
    torch.autograd.backward([a for a, _ in pairs], cot)
    torch.autograd.backward([e for _, e in pairs], [c.double() for c in cot])
    for name, leaf in leaves.items():
        rows = 6 if name in ("weight", "bias", "weight1", "bias1") else 1
        assert_close(t[name].grad, leaf.grad, f"d{name}", grad=True, reduced_rows=rows)


def test_dtypes_follow_flash_attention():
    """bf16 x: y in bf16 (or out_dtype), residual_out in the residual's dtype, else fp32 with residual_in_fp32."""
    x, w = torch.randn(4, 32).bfloat16(), torch.ones(32)
    y, res = fa.layer_norm_fn(x, w, None, prenorm=True, residual_in_fp32=True)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32
    y, res = fa.rms_norm_fn(
        x,
        w,
        None,
        residual=torch.randn(4, 32, dtype=torch.float64),
        prenorm=True,
        residual_in_fp32=True,
        out_dtype=torch.float32,
    )
    assert y.dtype == torch.float32 and res.dtype == torch.float64
    y, res = fa.layer_norm_fn(x, w, None, prenorm=True)
    assert torch.equal(res, x) and res.dtype == x.dtype  # nothing added or cast: residual_out is x


def test_no_mask_without_dropout_and_out_buffers_are_written():
    x, w = torch.randn(3, 16), torch.ones(16)
    y, m, m1 = fa.layer_norm_fn(x, w, None, return_dropout_mask=True)
    assert m is None and m1 is None
    out, res_buf = torch.empty(3, 16), torch.empty(3, 16)
    y, res = fa.rms_norm_fn(x, w, None, residual=torch.ones(3, 16), prenorm=True, out=out, residual_out=res_buf)
    assert y is out and res is res_buf and torch.equal(res_buf, x + 1)
    assert torch.equal(out, fa.rms_norm_fn(x, w, None, residual=torch.ones(3, 16)))


@pytest.mark.parametrize("is_rms", [False, True])
def test_refs_match_the_oracle_with_given_masks(is_rms):
    g = torch.Generator().manual_seed(2)
    x, x1, r = (torch.randn(4, 24, generator=g, dtype=torch.float64) for _ in range(3))
    w, b, w1 = (torch.randn(24, generator=g, dtype=torch.float64) for _ in range(3))
    mask, mask1 = torch.rand(4, 24, generator=g) > 0.3, torch.rand(4, 24, generator=g) > 0.3
    ref_fn = fa.rms_norm_ref if is_rms else fa.layer_norm_ref
    y, y1, res = ref_fn(
        x,
        w,
        b,
        r,
        x1,
        w1,
        None,
        eps=1e-6,
        dropout_p=0.3,
        prenorm=True,
        dropout_mask=mask,
        dropout_mask1=mask1,
        zero_centered_weight=True,
    )
    _, out, res_ref, out1 = multi_oracle(
        x,
        r,
        w,
        b,
        eps=1e-6,
        is_rms=is_rms,
        x1=x1,
        weight1=w1,
        dropout_p=0.3,
        mask=mask,
        mask1=mask1,
        zero_centered_weight=True,
    )
    for a, e, what in ((y, out, "y"), (y1, out1, "y1"), (res, res_ref, "res")):
        torch.testing.assert_close(a, e.detach(), msg=what)


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu", "triton"])
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
def test_layer_norm_linear_fn_forward_and_every_gradient(backend, is_rms, prenorm):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(9)
    x, r = _t(g, 2, 5, 32), _t(g, 2, 5, 32)
    nw, nb = _t(g, 32, scale=0.2, shift=1.0), _t(g, 32, scale=0.1)
    lw, lb = _t(g, 12, 32, scale=0.2), _t(g, 12, scale=0.1)
    result = fa.layer_norm_linear_fn(
        x, nw, nb, lw, lb, r, eps=1e-6, prenorm=prenorm, is_rms_norm=is_rms, backend=backend
    )
    out, res = result if prenorm else (result, None)
    leaves, y_ref, res_ref, _ = multi_oracle(x, r, nw, nb, eps=1e-6, is_rms=is_rms)
    lwd, lbd = lw.detach().double().requires_grad_(True), lb.detach().double().requires_grad_(True)
    out_ref = torch.nn.functional.linear(y_ref, lwd, lbd)
    assert_close(out, out_ref, "out")
    pairs = [(out, out_ref)] + ([(res, res_ref)] if prenorm else [])
    cot = [torch.randn(a.shape, generator=g) for a, _ in pairs]
    torch.autograd.backward([a for a, _ in pairs], cot)
    torch.autograd.backward([e for _, e in pairs], [c.double() for c in cot])
    for name, leaf in leaves.items():
        rows = 10 if name in ("weight", "bias") else 1
        assert_close(
            {"x": x, "residual": r, "weight": nw, "bias": nb}[name].grad,
            leaf.grad,
            f"d{name}",
            grad=True,
            reduced_rows=rows,
        )
    assert_close(lw.grad, lwd.grad, "dlinear_weight", grad=True, reduced_rows=10)
    assert_close(lb.grad, lbd.grad, "dlinear_bias", grad=True, reduced_rows=10)


def test_layer_norm_linear_fn_does_not_keep_the_norm_output():
    """Of the (M, N) activations, only residual_out is saved for the backward (layer_norm_fn + F.linear would
    also keep y)."""
    x, r, nw, nb = torch.randn(8, 32), torch.randn(8, 32), torch.ones(32, requires_grad=True), torch.zeros(32)
    lw = torch.randn(16, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fa.layer_norm_linear_fn(x, nw, nb, lw, None, r, backend="torch")
    assert saved.count((8, 32)) == 1, saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.linear(fa.layer_norm_fn(x, nw, nb, r, backend="torch"), lw)
    assert saved.count((8, 32)) >= 2, saved  # the composition this replaces keeps more


def test_layer_norm_linear_fn_under_autocast_returns_the_autocast_dtype():
    x, nw, lw = torch.randn(4, 32), torch.ones(32), torch.randn(8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fa.layer_norm_linear_fn(x, nw, None, lw, None)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lw.grad is not None and lw.grad.dtype == torch.float32


def test_layer_norm_linear_fn_without_autocast_runs_in_xs_dtype():
    """flash-attention casts the linear weight to the norm output's dtype (x's) when autocast is off."""
    x, nw = torch.randn(4, 32).bfloat16(), torch.ones(32)
    lw = torch.randn(8, 32, requires_grad=True)
    out = fa.layer_norm_linear_fn(x, nw, None, lw, None)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lw.grad.dtype == torch.float32


@pytest.mark.parametrize("cls", [fa.RMSNorm, fa.LayerNorm])
def test_modules_take_flash_attentions_forward_arguments(cls):
    m = cls(32, eps=1e-5, dropout_p=0.5)
    x, r = torch.randn(2, 4, 32), torch.randn(2, 4, 32)
    m.eval()
    y, res = m(x, r, prenorm=True, residual_in_fp32=True)
    assert torch.equal(res, x + r)
    fn = fa.rms_norm_fn if cls is fa.RMSNorm else fa.layer_norm_fn
    assert torch.equal(y, fn(x, m.weight, m.bias, r, eps=1e-5))
    m.train()
    _, res_train = m(x, r, prenorm=True)
    assert not torch.equal(res_train, x + r)  # dropout applies in training
    zc = cls(8, zero_centered_weight=True)
    assert torch.equal(zc.weight.detach(), torch.zeros(8))


def test_out_buffers_as_flash_attention_takes_them():
    """flash-attention's ``LayerNormFn.forward`` (Dao-AILab/flash-attention flash_attn/ops/triton/layer_norm.py at
    0a721dae) reshapes ``out``/``residual_out`` to (-1, N) and asserts that shape against x's rows and a unit last
    stride; its kernel writes ``residual_out`` whenever it computes one (a residual, another residual dtype,
    dropout, rowscale or x1), prenorm or not; and it returns the buffers reshaped to x's shape."""
    x, r, w = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.ones(16)
    flat = torch.empty(6, 16)
    y = fa.rms_norm_fn(x, w, None, out=flat)
    assert y.shape == x.shape and y.data_ptr() == flat.data_ptr()
    torch.testing.assert_close(y, fa.rms_norm_fn(x, w, None), rtol=0, atol=0)
    res_buf = torch.zeros(2, 3, 16)
    fa.rms_norm_fn(x, w, None, residual=r, residual_out=res_buf)  # no prenorm: written all the same
    assert torch.equal(res_buf, x + r)
    untouched = torch.zeros(2, 3, 16)
    fa.rms_norm_fn(x, w, None, residual_out=untouched)  # no residual_out computed: the buffer is left alone
    assert not untouched.any()
    with pytest.raises(AssertionError):
        fa.rms_norm_fn(x, w, None, out=torch.empty(2, 3, 16, 2)[..., 0])  # last-dimension stride 2
    with pytest.raises(AssertionError):
        fa.rms_norm_fn(x, w, None, out=torch.empty(5, 16))


def test_shape_refusals_are_flash_attentions_assertions():
    """flash-attention asserts its argument shapes (layer_norm.py at 0a721dae): residual and x1 of x's shape, every
    weight and bias (N,), rowscale M values; a failed ``assert`` is an AssertionError there, so it is one here."""
    x, w = torch.randn(2, 3, 16), torch.ones(16)
    calls = [
        lambda: fa.layer_norm_fn(x, w[:8], None),
        lambda: fa.layer_norm_fn(x, w, torch.zeros(8)),
        lambda: fa.layer_norm_fn(x, w, None, residual=torch.randn(1, 3, 16)),
        lambda: fa.layer_norm_fn(x, w, None, x1=torch.randn(6, 16)),
        lambda: fa.layer_norm_fn(x, w, None, weight1=torch.ones(8)),
        lambda: fa.layer_norm_fn(x, w, None, rowscale=torch.ones(5)),
    ]
    for call in calls:
        with pytest.raises(AssertionError):
            call()
    # rowscale of any shape holding one value per row is accepted there (reshape(-1)) and here
    fa.layer_norm_fn(x, w, None, rowscale=torch.ones(6))
