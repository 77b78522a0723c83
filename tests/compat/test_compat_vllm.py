"""addnorm.compat.vllm against vLLM's documented order (its CUDA kernels': the sum rounded to the input's dtype and
stored in residual, ``round(x * rstd) * weight`` in the input's dtype, then ``* (1 / scale)``, saturated and
converted; dynamic scales ``max(min(amax, ub) / QMAX, floor)``), written out here in plain PyTorch. addnorm
quantizes the float32 product instead of its rounding to the input's dtype (docs/compat.md), so codes may differ
by one where that rounding crosses a code boundary, and rarely do."""

from __future__ import annotations

import inspect

import pytest
import torch

from addnorm.compat import vllm
from addnorm.ops.quant.contract import QMAX
from tests.ops.quant_oracle import ALL, assert_codes_within_one, skip_unavailable

SIGNATURES = {
    "rms_norm": ("out", "input", "weight", "epsilon"),
    "fused_add_rms_norm": ("input", "residual", "weight", "epsilon"),
    "rms_norm_static_fp8_quant": ("out", "input", "weight", "scale", "epsilon"),
    "fused_add_rms_norm_static_fp8_quant": ("out", "input", "residual", "weight", "scale", "epsilon"),
    "rms_norm_dynamic_per_token_quant": ("out", "input", "weight", "scales", "epsilon", "scale_ub", "residual"),
    "static_scaled_fp8_quant": ("out", "input", "scale"),
}
EPS = 1e-6


def _vllm_norm(x, residual, w):
    """vLLM's kernel order: (round(round(h * rstd) * w) as float32, residual_out)."""
    h = x.float() if residual is None else (x.float() + residual.float()).to(x.dtype).float()
    xr = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    res = None if residual is None else h.to(x.dtype)
    return (xr * w).float(), res


def _vllm_quant(y, qd, scale):
    qmax = QMAX[qd]
    v = (y * (1.0 / scale)).clamp(-qmax, qmax)
    return v.round().to(torch.int8) if qd == torch.int8 else v.to(qd)


def _inputs(dtype=torch.bfloat16, shape=(33, 512)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w


@pytest.fixture(params=ALL)
def backend(request, monkeypatch):
    skip_unavailable(request.param)
    monkeypatch.setenv("ADDNORM_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_vllms(name):
    params = tuple(inspect.signature(getattr(vllm, name)).parameters)
    assert params == SIGNATURES[name]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_norm_ops_are_vllms_order_bitwise(backend, dtype):
    """Without quantization the orders agree exactly: round(round(xhat) * w) either way."""
    x, r, w = _inputs(dtype)
    out = torch.empty_like(x)
    vllm.rms_norm(out, x, w, EPS)
    want, _ = _vllm_norm(x, None, w)
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=0)  # rstd: one fp32 ulp apart at most
    assert (out.float() != want).float().mean() < 0.01
    xi, ri = x.clone(), r.clone()
    vllm.fused_add_rms_norm(xi, ri, w, EPS)
    want, res = _vllm_norm(x, r, w)
    assert torch.equal(ri, res)
    assert (xi.float() != want).float().mean() < 0.01


@pytest.mark.parametrize("qd", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_static_fp8_quant(backend, qd):
    x, r, w = _inputs()
    scale = torch.tensor([0.02])
    q = torch.empty(x.shape, dtype=qd)
    vllm.rms_norm_static_fp8_quant(q, x, w, scale, EPS)
    y, _ = _vllm_norm(x, None, w)
    d = assert_codes_within_one(q, _vllm_quant(y, qd, scale), "rms_norm_static_fp8_quant")
    assert (d > 0).float().mean() < 0.05
    xi, ri = x.clone(), r.clone()
    vllm.fused_add_rms_norm_static_fp8_quant(q, xi, ri, w, scale, EPS)
    y, res = _vllm_norm(x, r, w)
    assert torch.equal(ri, res) and torch.equal(xi, x)
    d = assert_codes_within_one(q, _vllm_quant(y, qd, scale), "fused_add_rms_norm_static_fp8_quant")
    assert (d > 0).float().mean() < 0.05


@pytest.mark.parametrize("qd", [torch.float8_e4m3fn, torch.int8], ids=["e4m3", "int8"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("ub", [None, 2.0])
def test_dynamic_per_token_quant(backend, qd, with_residual, ub):
    x, r, w = _inputs()
    q = torch.empty(x.shape, dtype=qd)
    scales = torch.empty(x.shape[0], 1)
    ri = r.clone() if with_residual else None
    scale_ub = None if ub is None else torch.tensor([ub])
    vllm.rms_norm_dynamic_per_token_quant(q, x, w, scales, EPS, scale_ub, ri)
    y, res = _vllm_norm(x, r if with_residual else None, w)
    amax = y.abs().amax(-1, keepdim=True)
    if ub is not None:
        amax = amax.clamp(max=ub)
    want_s = (amax / QMAX[qd]).clamp(min=1 / (QMAX[qd] * 512))
    # vLLM's amax is of y rounded to bf16: half a bf16 ulp from addnorm's float32 amax
    torch.testing.assert_close(scales, want_s, rtol=2**-8, atol=0)
    if with_residual:
        assert torch.equal(ri, res)
    d = assert_codes_within_one(q, _vllm_quant(y, qd, want_s), "rms_norm_dynamic_per_token_quant")
    # int8 has 7 bits against bf16's 8: vLLM's rounding of y to bf16 moves near-full-scale codes by half a code,
    # so one code apart is common there; FP8 (3 bits) rarely sees it
    assert (d > 0).float().mean() < (0.2 if qd == torch.int8 else 0.05)


def test_static_scaled_fp8_quant_divides():
    x = torch.randn(4, 64)
    scale = torch.tensor([0.3])
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    vllm.static_scaled_fp8_quant(q, x, scale)
    assert torch.equal(q.view(torch.uint8), (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(TypeError, match="out must be float8"):
        vllm.static_scaled_fp8_quant(torch.empty(4, 64, dtype=torch.int8), x, scale)


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
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scales must be a float32 tensor of shape \(num_tokens, 1\) = \(33, 1\)"):
        vllm.rms_norm_dynamic_per_token_quant(q, x, w, scales, EPS, None, None)
