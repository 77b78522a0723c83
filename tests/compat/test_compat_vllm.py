"""addnorm.compat.vllm against vLLM: the signatures of ``vllm._custom_ops`` and the schemas of ``torch.ops._C``
(vllm-project/vllm ``vllm/_custom_ops.py`` at 0002bde5, ``csrc/torch_bindings.cpp``), and vLLM's arithmetic written
out here from its CUDA sources (the commits cited in :mod:`addnorm.compat.vllm_ops`):

- norm: ``round(round(h * rstd) * w)`` in the input's dtype; h the rounded sum (static FP8 ops) or the float32 sum
  (dynamic per-token and per-block ops);
- FP8: ``y / scale`` (dynamic per token, per block), ``y * (1 / scale)`` (static, dynamic per tensor); a NaN
  saturates to +448 (fminf/fmaxf);
- int8: ``y * (1 / scale)`` (fused ops), ``x / scale`` (static), ``x * (127 / amax)`` (dynamic); [-128, 127].

The model takes ``h * rstd`` from addnorm (the sum of squares is reduced in another order than a CUDA block does, so
rstd itself is vLLM's only to the last bit): everything after it must match bit for bit."""

from __future__ import annotations

import inspect

import pytest
import torch

from addnorm.compat import vllm
from addnorm.ops.add_norm import add_rms_norm
from addnorm.ops.quant import add_rms_norm_quant
from tests.ops.quant_oracle import ALL, skip_unavailable

FP8 = torch.float8_e4m3fn
EPS = 1e-6

SIGNATURES = {
    "rms_norm": "(out, input, weight, epsilon)",
    "fused_add_rms_norm": "(input, residual, weight, epsilon)",
    "rms_norm_dynamic_per_token_quant": "(input, weight, epsilon, quant_dtype, scale_ub=None, residual=None)",
    "rms_norm_per_block_quant": "(input, weight, epsilon, quant_dtype, group_size, scale_ub=None, residual=None, "
    "is_scale_transposed=False, tma_alignment=0)",
    "scaled_fp8_quant": "(input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False, "
    "output=None, group_shape=None)",
    "scaled_int8_quant": "(input, scale=None, azp=None, symmetric=True)",
    "rms_norm_static_fp8_quant": "(out, input, weight, scale, epsilon)",
    "fused_add_rms_norm_static_fp8_quant": "(out, input, residual, weight, scale, epsilon)",
    "static_scaled_fp8_quant": "(out, input, scale, group_shape=None)",
}
# torch.ops._C's schemas (alias sets named a, b, c here: torch.library's custom ops need them named)
SCHEMAS = {
    "rms_norm": "(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": "(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float epsilon) -> ()",
    "rms_norm_static_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor(b!) residual, Tensor weight, "
    "Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant": "(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, "
    "float epsilon, Tensor? scale_ub, Tensor(c!)? residual) -> ()",
    "rms_norm_per_block_quant": "(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, float epsilon, "
    "Tensor? scale_ub, Tensor(c!)? residual, int group_size, bool is_scale_transposed) -> ()",
    "static_scaled_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()",
    "dynamic_scaled_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor(b!) scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor(b!) scale, Tensor? scale_ub) -> ()",
    "static_scaled_int8_quant": "(Tensor(a!) result, Tensor input, Tensor scale, Tensor? azp) -> ()",
    "dynamic_scaled_int8_quant": "(Tensor(a!) result, Tensor input, Tensor(b!) scale, Tensor(c!)? azp) -> ()",
}


def _fp8(v):
    return torch.fmax(torch.fmin(v, torch.tensor(448.0)), torch.tensor(-448.0)).to(FP8)


def _int8(v):
    return torch.nan_to_num(v, nan=0.0).round().clamp(-128, 127).to(torch.int8)


def _xhat(h32, backend):
    """h * rstd in float32, from addnorm (the one quantity the model does not write out)."""
    return add_rms_norm(h32, None, None, EPS, backend=backend)[0]


def _model_dynamic(x, r, w, qd, ub, group, backend):
    """vLLM's rms_norm_dynamic_per_token_quant / rms_norm_per_block_quant: (q, scales, residual)."""
    h = x.float() if r is None else x.float() + r.float()
    y = (_xhat(h, backend).to(x.dtype) * w).float()  # two bf16 factors: the product rounded to bf16
    amax = y.reshape(y.shape[0], -1, group).abs().amax(-1)
    if ub is not None:
        amax = torch.minimum(amax, ub)
    qmax, floor = (448.0, 1 / (448 * 512)) if qd == FP8 else (127.0, torch.finfo(torch.float32).eps)
    s = torch.clamp(amax / qmax, min=torch.tensor(floor, dtype=torch.float32).item())
    full = s.repeat_interleave(group, -1)
    q = _fp8(y / full) if qd == FP8 else _int8(y * (1.0 / full))
    return q, s, None if r is None else h.to(x.dtype)


def _same(a, b):
    return torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)


def _inputs(dtype=torch.bfloat16, shape=(33, 512), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w


@pytest.fixture(params=ALL)
def backend(request, monkeypatch):
    skip_unavailable(request.param)
    monkeypatch.setenv("ADDNORM_BACKEND", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _vllm_order():
    previous = vllm.set_order("vllm")
    yield
    vllm.set_order(previous)


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_vllms(name):
    params = inspect.signature(getattr(vllm, name)).parameters.values()
    got = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params)
    assert f"({got})" == SIGNATURES[name]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_ops_have_vllms_schemas(name):
    schema = str(getattr(torch.ops.addnorm_vllm, name).default._schema)
    assert schema == f"addnorm_vllm::{name}{SCHEMAS[name]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_norm_ops_are_vllms_order_bitwise(backend, dtype):
    x, r, w = _inputs(dtype)
    out = torch.empty_like(x)
    vllm.rms_norm(out, x, w, EPS)
    assert torch.equal(out, _xhat(x.float(), backend).to(dtype) * w)
    xi, ri = x.clone(), r.clone()
    vllm.fused_add_rms_norm(xi, ri, w, EPS)
    assert torch.equal(ri, x + r)
    assert torch.equal(xi, _xhat((x + r).float(), backend).to(dtype) * w)


@pytest.mark.parametrize(
    "qd, ub", [(FP8, None), (FP8, 2.0), (torch.int8, None)], ids=["e4m3", "e4m3-ub", "int8"]
)  # scale_ub is FP8 only: refused with int8 (test_refusals)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_dynamic_per_token_quant_is_vllms_order_bitwise(backend, qd, with_residual, ub):
    x, r, w = _inputs(shape=(64, 1024))
    ri = r.clone() if with_residual else None
    scale_ub = None if ub is None else torch.tensor(ub)
    q, s = vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, qd, scale_ub, ri)
    mq, ms, mres = _model_dynamic(x, r if with_residual else None, w, qd, scale_ub, x.shape[-1], backend)
    assert s.shape == (64, 1) and torch.equal(s, ms)
    assert _same(q, mq)
    if with_residual:
        assert torch.equal(ri, mres)


def test_dynamic_fp8_divides_where_multiplying_differs():
    """The bitwise test above has teeth: at bf16 4096 x 256, weight 1, multiplying by 1 / scale (the old model's
    and the old code's order) gives other FP8 codes than vLLM's division for some elements."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=g).to(torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    q, s = vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, FP8)
    y = (_xhat(x.float(), "torch").to(torch.bfloat16) * w).float()
    assert _same(q, _fp8(y / s))
    assert (_fp8(y * (1.0 / s)).view(torch.uint8) != q.view(torch.uint8)).sum() > 100


@pytest.mark.parametrize("qd", [FP8, torch.int8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("transposed, tma", [(False, 0), (True, 0), (True, 4)])
def test_per_block_quant_is_vllms_order_bitwise(qd, transposed, tma):
    x, r, w = _inputs(shape=(7, 256))
    ri = r.clone()
    q, s = vllm.rms_norm_per_block_quant(x, w, EPS, qd, [1, 128], None, ri, transposed, tma)
    mq, ms, mres = _model_dynamic(x, r, w, qd, None, 128, "torch")
    assert s.shape == (7, 2) and torch.equal(s, ms) and _same(q, mq) and torch.equal(ri, mres)
    assert (s.stride(0) == 1) == transposed  # vLLM's column-major layout (rows padded to 8 with tma 4)
    if tma:
        assert s.stride(1) == 8


def test_static_fp8_quant_multiplies_by_the_inverse(backend):
    x, r, w = _inputs()
    scale = torch.tensor([0.0173])
    q = torch.empty(x.shape, dtype=FP8)
    vllm.rms_norm_static_fp8_quant(q, x, w, scale, EPS)
    y = (_xhat(x.float(), backend).to(x.dtype) * w).float()
    assert _same(q, _fp8(y * (1.0 / scale)))
    xi, ri = x.clone(), r.clone()
    vllm.fused_add_rms_norm_static_fp8_quant(q, xi, ri, w, scale, EPS)
    assert torch.equal(ri, x + r) and torch.equal(xi, x)
    y = (_xhat((x + r).float(), backend).to(x.dtype) * w).float()  # the rounded sum, as vLLM's kernel
    assert _same(q, _fp8(y * (1.0 / scale)))


def test_scaled_fp8_quant_orders():
    x, _, _ = _inputs(shape=(16, 256))
    x[3, 5] = float("nan")  # saturates to +448 in vLLM's conversion (fminf ignores NaN)
    xf = x.float()
    scale = torch.tensor([0.0173])
    q, s = vllm.scaled_fp8_quant(x, scale)
    assert s is scale and _same(q, _fp8(xf * (1.0 / scale))) and q.float()[3, 5] == 448
    q, s = vllm.scaled_fp8_quant(x[:, :], None, num_token_padding=20, use_per_token_if_dynamic=True)
    amax = torch.where(xf.isnan(), 0, xf).abs().amax(-1, keepdim=True)
    assert q.shape == (20, 256) and s.shape == (20, 1)
    ub = torch.tensor(1.5)
    q, s = vllm.scaled_fp8_quant(x[4:], None, scale_ub=ub, use_per_token_if_dynamic=True)
    ms = torch.clamp(torch.minimum(amax[4:], ub) / 448.0, min=1 / (448 * 512))
    assert torch.equal(s, ms) and _same(q, _fp8(xf[4:] / ms))
    q, s = vllm.scaled_fp8_quant(x[4:])
    assert torch.equal(s, (amax[4:].max() / 448.0).reshape(1)) and _same(q, _fp8(xf[4:] * (1.0 / s)))


def test_scaled_int8_quant_orders():
    x, _, _ = _inputs(shape=(16, 256))
    xf = x.float()
    scale = torch.tensor([0.0173])
    q, s, azp = vllm.scaled_int8_quant(x, scale)
    assert azp is None and torch.equal(q, _int8(xf / scale))
    q, s, azp = vllm.scaled_int8_quant(x)
    amax = xf.abs().amax(-1, keepdim=True)
    assert torch.equal(s, amax / 127) and torch.equal(q, _int8(xf * (127.0 / amax)))
    q, s, azp = vllm.scaled_int8_quant(x, symmetric=False)
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    ms = (hi - lo) / 255
    mz = (-128 - lo / ms).round()
    assert torch.equal(s, ms) and torch.equal(azp, mz.to(torch.int32))
    assert torch.equal(q, ((xf * (1.0 / ms)).round() + mz).clamp(-128, 127).to(torch.int8))
    q, s, azp = vllm.scaled_int8_quant(x, scale, torch.tensor([3], dtype=torch.int32), symmetric=False)
    assert torch.equal(q, ((xf * (1.0 / scale)).round() + 3).clamp(-128, 127).to(torch.int8))


@pytest.mark.parametrize("qd", [FP8, torch.int8], ids=["e4m3", "int8"])
def test_addnorm_order_is_the_fused_kernels(backend, qd):
    """``set_order("addnorm")``: the codes of addnorm's fused kernels and contract, bitwise."""
    x, r, w = _inputs()
    vllm.set_order("addnorm")
    q, s = vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, qd)
    want_q, _, want_s = add_rms_norm_quant(x, None, w, EPS, quant_dtype=qd, cast_before_weight=True)
    assert _same(q, want_q) and torch.equal(s, want_s)
    scale = torch.tensor([0.02])
    q = torch.empty(x.shape, dtype=FP8)
    vllm.rms_norm_static_fp8_quant(q, x, w, scale, EPS)
    assert _same(q, add_rms_norm_quant(x, None, w, EPS, scale=scale, cast_before_weight=True)[0])
    with pytest.raises(ValueError, match="order must be one of"):
        vllm.set_order("fbgemm")


@pytest.mark.parametrize(
    "scales",
    [
        torch.empty(33, 1, dtype=torch.int32),  # truncated to 0 before: every dequantized value 0
        torch.empty(33, 1, dtype=torch.bfloat16),  # rounded before: not the scale q was made with
        torch.empty(33),
        torch.empty(3, 11),  # filled by reshape before
    ],
    ids=["int32", "bf16", "flat", "3x11"],
)
def test_dynamic_per_token_quant_refuses_scales_vllm_refuses(scales):
    x, _, w = _inputs()
    q = torch.empty(x.shape, dtype=FP8)
    with pytest.raises(RuntimeError, match=r"scales must be a float32 tensor of shape \(num_tokens, 1\) = \(33, 1\)"):
        torch.ops.addnorm_vllm.rms_norm_dynamic_per_token_quant(q, x, w, scales, EPS, None, None)


def test_refusals():
    x, r, w = _inputs(shape=(4, 256))
    with pytest.raises(RuntimeError, match="float8_e4m3fn or int8"):
        vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, torch.float8_e5m2)
    with pytest.raises(RuntimeError, match="scale_ub is for FP8 output only"):
        vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, torch.int8, torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="residual must be of input's dtype"):
        vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, FP8, None, r.half())
    with pytest.raises(RuntimeError, match="Unsupported group size: 32"):
        vllm.rms_norm_per_block_quant(x, w, EPS, FP8, [1, 32])
    with pytest.raises(AssertionError, match="group_size must be"):
        vllm.rms_norm_per_block_quant(x, w, EPS, FP8, [128])
    with pytest.raises(AssertionError, match="input must be 2-D"):
        vllm.scaled_fp8_quant(x.view(2, 2, 256))
    with pytest.raises(AssertionError, match="azp must only be provided"):
        vllm.scaled_int8_quant(x, torch.tensor([0.1]), symmetric=False)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        vllm.static_scaled_fp8_quant(torch.empty(4, 256, dtype=torch.float8_e5m2), x, torch.tensor([0.1]))
    with pytest.raises(RuntimeError, match="contiguous in the last dimension"):
        vllm.rms_norm_dynamic_per_token_quant(x.t().contiguous().t(), w, EPS, FP8)


def _opcheck_cases():
    x, r, w = _inputs(shape=(8, 256))
    i8, f8 = (torch.empty(8, 256, dtype=d) for d in (torch.int8, FP8))
    s1 = torch.tensor([0.1])
    return [
        ("rms_norm", (torch.empty_like(x), x, w, EPS)),
        ("fused_add_rms_norm", (x.clone(), r.clone(), w, EPS)),
        ("rms_norm_static_fp8_quant", (f8, x, w, s1, EPS)),
        ("fused_add_rms_norm_static_fp8_quant", (f8, x, r.clone(), w, s1, EPS)),
        ("rms_norm_dynamic_per_token_quant", (i8, x, w, torch.empty(8, 1), EPS, None, r.clone())),
        ("rms_norm_dynamic_per_token_quant", (f8, x, w, torch.empty(8, 1), EPS, torch.tensor(2.0), None)),
        ("rms_norm_per_block_quant", (i8, x, w, torch.empty(2, 8).t(), EPS, None, r.clone(), 128, True)),
        ("rms_norm_per_block_quant", (f8, x, w, torch.empty(8, 4), EPS, None, None, 64, False)),
        ("static_scaled_fp8_quant", (f8, x, s1)),
        ("dynamic_scaled_fp8_quant", (f8, x, torch.empty(1))),
        ("dynamic_per_token_scaled_fp8_quant", (f8, x, torch.empty(8, 1), None)),
        ("static_scaled_int8_quant", (i8, x, s1, None)),
        ("dynamic_scaled_int8_quant", (i8, x, torch.empty(8, 1), torch.empty(8, 1, dtype=torch.int32))),
    ]


def _allclose_any_float(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=equal_nan).all())


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case, monkeypatch):
    """All four of opcheck's tests. Its schema test compares each argument before and after the call with
    torch.allclose, which PyTorch has no float8 kernel for on CPU: compared in float64 instead, as vLLM's own opcheck
    helper (tests/kernels/utils.py) patches it."""
    name, args = _opcheck_cases()[case]
    monkeypatch.setattr(torch, "allclose", _allclose_any_float)
    utils = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    result = torch.library.opcheck(getattr(torch.ops.addnorm_vllm, name), args, test_utils=utils)
    assert set(result) == set(utils) and set(result.values()) == {"SUCCESS"}


def test_norm_ops_refuse_layouts_and_weight_dtypes_vllm_refuses():
    """vLLM's ``rms_norm`` and ``fused_add_rms_norm`` (vllm-project/vllm csrc/layernorm_kernels.cu at 0112cf23):
    ``TORCH_CHECK`` a contiguous ``out``, a unit last stride on ``input``, a contiguous ``residual`` and weight, and
    read the weight as ``data_ptr<scalar_t>()`` of the input's type, which torch refuses for another dtype. All
    RuntimeErrors; a row-strided input stays accepted (the kernels take ``input.stride(-2)``)."""
    x, r, w = _inputs(torch.bfloat16, shape=(4, 256))
    out = torch.empty_like(x)
    strided = torch.stack([x, x], dim=-1)[..., 0]  # last-dimension stride 2
    with pytest.raises(RuntimeError, match=r"Expected out.is_contiguous\(\) to be true"):
        vllm.rms_norm(out.t().contiguous().t(), x, w, EPS)
    with pytest.raises(RuntimeError, match=r"Expected input.stride\(-1\) == 1 to be true"):
        vllm.rms_norm(out, strided, w, EPS)
    with pytest.raises(RuntimeError, match=r"Expected weight.is_contiguous\(\) to be true"):
        vllm.rms_norm(out, x, torch.stack([w, w], -1)[:, 0], EPS)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        vllm.rms_norm(out, x, w.float(), EPS)
    with pytest.raises(RuntimeError, match=r"Expected residual.is_contiguous\(\) to be true"):
        vllm.fused_add_rms_norm(x.clone(), torch.stack([r, r], -1)[..., 0], w, EPS)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Half"):
        vllm.fused_add_rms_norm(x.clone(), r.clone(), w.half(), EPS)
    wide = torch.cat([x, x], dim=-1)[:, :256]  # row stride 512, unit last stride
    vllm.rms_norm(out, wide, w, EPS)
    ref = torch.empty_like(x)
    vllm.rms_norm(ref, x, w, EPS)
    assert torch.equal(out, ref)
