"""The float64 oracle of add + norm + quantize, and code comparisons, shared by the tests/ops/test_quant*.py files."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops.quant.contract import QMAX, min_scale
from addnorm.reference import add_norm_ref, layer_norm_ref, rms_norm_ref

ALL = ["torch", "reference", "cpu", "triton"]
QDTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
QIDS = ["e4m3", "e5m2", "int8"]


def skip_unavailable(backend: str) -> None:
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def inputs(shape, x_dtype, r_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(x_dtype)
    r = (2 * torch.randn(shape, generator=g)).to(r_dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(x_dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(x_dtype)
    return x, r, w, b


def oracle(
    x, r, w, b, *, is_rms, eps, quant_dtype, scale=None, group_size=None, scale_ub=None, cast=False, zc=False, rd=None
):
    """(q codes as float64 values before encoding: the saturated y / scale in fp64, scales in fp64, residual_out).

    residual_out is the contract's (the add rounded once, from the library's reference); everything after it is
    float64: the norm of the stored residual_out, the weight, amax, the scale and the division."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), None if r is None else r.reshape(-1, n)
    _, res, _, _ = add_norm_ref(x2, r2, None, None, eps=1e-5, is_rms=True, residual_dtype=rd)
    h = res.double()
    e = torch.finfo(res.dtype).eps if eps is None else eps
    if is_rms:
        xhat = rms_norm_ref(h, None, e, compute_dtype=torch.float64, out_dtype=torch.float64)[0]
    else:
        xhat = layer_norm_ref(h, None, None, e, compute_dtype=torch.float64, out_dtype=torch.float64)[0]
    if cast and (w is not None or b is not None):
        xhat = xhat.to(x.dtype).double()
    y = xhat
    if w is not None:
        y = y * (w.double() + 1 if zc else w.double())
    if b is not None and not is_rms:
        y = y + b.double()
    qmax = QMAX[quant_dtype]
    if scale is not None:
        s = torch.full((y.shape[0], 1), float(scale), dtype=torch.float64)
        group = n
    else:
        group = group_size or n
        amax = y.reshape(y.shape[0], n // group, group).abs().amax(-1)
        if scale_ub is not None:
            amax = amax.clamp(max=float(scale_ub))
        s = (amax / qmax).clamp(min=min_scale(quant_dtype))
    v = (y / s.repeat_interleave(group, -1)).clamp(-qmax, qmax)
    return v, s, res


def ordinal(q: torch.Tensor) -> torch.Tensor:
    """Codes as integers whose difference counts representable values between them (fp8 is sign-magnitude)."""
    if q.dtype == torch.int8:
        return q.to(torch.int64)
    bits = q.view(torch.uint8).to(torch.int64)
    mag = bits & 0x7F
    return torch.where(bits >= 0x80, -mag, mag)


def encode_ref(v: torch.Tensor, quant_dtype) -> torch.Tensor:
    """fp64 values (saturated) -> codes: round to nearest even through float32."""
    if quant_dtype == torch.int8:
        return v.round().to(torch.int8)
    return v.to(torch.float32).to(quant_dtype)


def assert_codes_within_one(q, expected, what=""):
    d = (ordinal(q).reshape(expected.shape) - ordinal(expected)).abs()
    assert d.numel() == 0 or d.max().item() <= 1, f"{what}: codes {d.max().item()} apart"
    return d
