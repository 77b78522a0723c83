"""The quantized add + norm on a CUDA GPU (skipped without one): the Triton kernels with the hardware FP8
conversion (sm_89+) against the torch backend on the same GPU, every mode and dtype; the hardware encoder bitwise
against torch's conversion. benchmarks/gpu_check.sh runs this file where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops.quant.contract import QMAX
from tests.ops.quant_oracle import QDTYPES, QIDS, assert_codes_within_one

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fp8_ok() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("qd", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("mode", ["static", "token", "group", "group-npow2", "token-ub"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("x_dtype, r_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_triton_matches_torch_on_the_gpu(qd, mode, is_rms, x_dtype, r_dtype):
    if qd != torch.int8 and not _fp8_ok():
        pytest.skip("FP8 conversion needs sm_89+")
    g = torch.Generator().manual_seed(0)
    m, n = 67, 3 * 128 * 5  # N = 1920: no power of two; 15 groups of 128, 24 of 80
    x = torch.randn(m, n, generator=g).to("cuda", x_dtype)
    r = torch.randn(m, n, generator=g).to("cuda", r_dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to("cuda", x_dtype)
    b = (0.2 * torch.randn(n, generator=g)).to("cuda", x_dtype)
    kw = {
        "static": dict(scale=torch.tensor([0.01], device="cuda")),
        "token": {},
        "group": dict(group_size=128),
        "group-npow2": dict(group_size=80),
        "token-ub": dict(scale_ub=1.0),
    }[mode]
    fn = addnorm.add_rms_norm_quant if is_rms else addnorm.add_layer_norm_quant
    args = (x, r, w) if is_rms else (x, r, w, b)
    q, res, s = fn(*args, quant_dtype=qd, backend="triton", **kw)
    q0, res0, s0 = fn(*args, quant_dtype=qd, backend="torch", **kw)
    assert torch.equal(res, res0)
    assert_codes_within_one(q.cpu(), q0.cpu(), "triton vs torch on cuda")
    torch.testing.assert_close(s, s0, rtol=4 * 2**-23, atol=0)
    # in place: the sum lands in residual
    ri = r.clone()
    fn_ = addnorm.add_rms_norm_quant_ if is_rms else addnorm.add_layer_norm_quant_
    q2, _, _ = fn_(*((x, ri, w) if is_rms else (x, ri, w, b)), quant_dtype=qd, backend="triton", **kw)
    assert torch.equal(ri, res) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("qd", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_hardware_encoder_is_torchs_conversion(qd):
    if not _fp8_ok():
        pytest.skip("FP8 conversion needs sm_89+")
    from addnorm.ops.triton.quant import encode_kernel

    qmax = QMAX[qd]
    hi = torch.tensor(qmax, dtype=torch.float32).view(torch.int32).item()
    v = torch.arange(0, hi + 1, 13, dtype=torch.int32).view(torch.float32)
    v = torch.cat([v, -v, torch.tensor([float("nan"), float("inf"), -float("inf"), qmax * 2])]).cuda()
    want = v.clamp(-qmax, qmax).to(qd).view(torch.uint8)
    got = torch.empty_like(want)
    block = 1 << 16
    encode_kernel[(-(-v.numel() // block),)](
        v, got, v.numel(), qmax, KIND=0 if qd == torch.float8_e4m3fn else 1, BITWISE=False, BLOCK=block
    )
    bad = (got != want).nonzero().flatten()
    # NaN's sign bit is the hardware's choice: compare NaN as NaN
    nan = v[bad].isnan()
    assert bad[~nan].numel() == 0, [(v[i].item(), hex(want[i].item()), hex(got[i].item())) for i in bad[:5]]
