"""add_rms_norm_quant / add_layer_norm_quant against the float64 oracle, on every backend: each mode (static, per
token, per group), each quantized dtype, dtypes of x and of the residual stream, awkward shapes; and the backends
against one another (codes at most one apart where the contract's fp32 sums differ, scales within a few ulps)."""

from __future__ import annotations

import pytest
import torch

import addnorm
from tests.ops.quant_oracle import (
    ALL,
    QDTYPES,
    QIDS,
    assert_codes_within_one,
    encode_ref,
    inputs,
    oracle,
    skip_unavailable,
)

# scales: fp32 y differs from the fp64 oracle's by a few fp32 ulps (the sums), so amax / QMAX does too
SCALE_RTOL = 1e-5

MODES = {
    "static": dict(scale=torch.tensor([0.01])),
    "token": dict(),
    "group": dict(group_size=128),
    "token-ub": dict(scale_ub=1.5),
}


def _call(is_rms, x, r, w, b, **kw):
    if is_rms:
        return addnorm.add_rms_norm_quant(x, r, w, None, **kw)
    return addnorm.add_layer_norm_quant(x, r, w, b, 1e-5, **kw)


def _check_against_oracle(q, res, scales, x, r, w, b, is_rms, qd, mode_kw, **okw):
    eps = None if is_rms else 1e-5
    v, s, res_ref = oracle(x, r, w, b, is_rms=is_rms, eps=eps, quant_dtype=qd, **mode_kw, **okw)
    n = x.shape[-1]
    assert q.dtype == qd and q.shape == x.shape
    assert torch.equal(res.reshape(-1, n), res_ref), "residual_out is the add + norm op's, bit for bit"
    if "scale" in mode_kw:
        assert scales is mode_kw["scale"]
    else:
        lead = x.shape[:-1]
        assert scales.dtype == torch.float32 and scales.shape == (*lead, s.shape[-1])
        torch.testing.assert_close(scales.reshape(s.shape).double(), s, rtol=SCALE_RTOL, atol=0)
    d = assert_codes_within_one(q.reshape(-1, n), encode_ref(v, qd), "vs the float64 oracle")
    # one code apart only where fp32 and fp64 y straddle a rounding boundary: rare
    assert d.numel() == 0 or (d > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("qd", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "x_dtype, r_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16", "bf16-fp32stream"],
)
def test_matches_float64_oracle(backend, is_rms, qd, mode, x_dtype, r_dtype):
    skip_unavailable(backend)
    x, r, w, b = inputs((6, 384), x_dtype, r_dtype)  # N = 3 x 128: no power of two, three groups
    q, res, scales = _call(is_rms, x, r, w, b, quant_dtype=qd, backend=backend, **MODES[mode])
    _check_against_oracle(q, res, scales, x, r, w, b, is_rms, qd, MODES[mode])


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize(
    "x_dtype, r_dtype, cast, zc",
    [
        (torch.float16, torch.float32, False, False),
        (torch.float64, torch.float64, False, False),
        (torch.bfloat16, torch.bfloat16, True, False),
        (torch.bfloat16, torch.float32, True, True),
    ],
    ids=["fp16-fp32stream", "fp64", "bf16-cast", "bf16-fp32stream-cast-gemma"],
)
def test_options_match_oracle(backend, x_dtype, r_dtype, cast, zc):
    """cast_before_weight (rounded to x's dtype, then weighted), zero-centered weight, fp16 and fp64 input."""
    skip_unavailable(backend)
    x, r, w, b = inputs((5, 256), x_dtype, r_dtype, seed=1)
    for is_rms in (True, False):
        kw = dict(quant_dtype=torch.float8_e4m3fn, group_size=64)
        q, res, s = _call(is_rms, x, r, w, b, cast_before_weight=cast, zero_centered_weight=zc, backend=backend, **kw)
        _check_against_oracle(q, res, s, x, r, w, b, is_rms, kw["quant_dtype"], {"group_size": 64}, cast=cast, zc=zc)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize(
    "shape, group",
    [((0, 256), 128), ((1, 96), 32), ((3, 100), 25), ((2, 3, 100), None), ((4, 5000), 1000)],
    ids=["0rows", "1row", "group25", "3d", "wide-group1000"],
)
def test_awkward_shapes(backend, shape, group):
    skip_unavailable(backend)
    x, r, w, b = inputs(shape, torch.bfloat16, torch.float32, seed=2)
    for is_rms in (True, False):
        q, res, s = _call(is_rms, x, r, w, b, group_size=group, quant_dtype=torch.int8, backend=backend)
        _check_against_oracle(q, res, s, x, r, w, b, is_rms, torch.int8, {"group_size": group})


@pytest.mark.parametrize("backend", ALL)
def test_strided_rows(backend):
    """Rows of x and of the residual taken from wider buffers (last dim contiguous, row stride > N)."""
    skip_unavailable(backend)
    xb, rb, w, b = inputs((6, 300), torch.bfloat16, torch.bfloat16, seed=3)
    x, r, w, b = xb[:, :256], rb[:, 20:276], w[:256], b[:256]
    assert not x.is_contiguous() and not r.is_contiguous()
    for mode, kw in MODES.items():
        q, res, s = _call(False, x, r, w, b, backend=backend, **kw)
        _check_against_oracle(q, res, s, x, r, w, b, False, torch.float8_e4m3fn, kw)
        q2, res2, s2 = _call(False, x.contiguous(), r.contiguous(), w, b, backend=backend, **kw)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(res, res2), mode


@pytest.mark.parametrize("qd", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_backends_agree(qd, mode):
    """q at most one code apart and scales within a few fp32 ulps across backends; residual_out bitwise."""
    x, r, w, b = inputs((9, 640), torch.bfloat16, torch.float32, seed=4)
    for is_rms in (True, False):
        ref = _call(is_rms, x, r, w, b, quant_dtype=qd, backend="torch", **MODES[mode])
        for backend in ("reference", "cpu", "triton"):
            if addnorm.ops.backends.unavailable_reason(backend, torch.device("cpu")) is not None:
                continue
            got = _call(is_rms, x, r, w, b, quant_dtype=qd, backend=backend, **MODES[mode])
            assert_codes_within_one(got[0], ref[0], backend)
            assert torch.equal(got[1], ref[1])
            torch.testing.assert_close(got[2], ref[2], rtol=4 * 2**-23, atol=0)


def test_auto_backend_and_default_dtype():
    x, r, w, _ = inputs((64, 1024), torch.bfloat16, torch.bfloat16)
    q, res, s = addnorm.add_rms_norm_quant(x, r, w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)
    q2, res2, s2 = addnorm.add_rms_norm_quant(x, r, w, backend="torch")
    assert_codes_within_one(q, q2)
    assert torch.equal(res, res2)
