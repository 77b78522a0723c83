"""The bit-level FP8 encoders (numba's, and the Triton interpreter's) against torch's ``.to(float8_*)``, bitwise,
over float32 bit patterns spread through each format's whole range (subnormals, every binade, ties, QMAX, NaN);
the Triton one also saturates values beyond QMAX and Inf."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops.quant.contract import QMAX
from tests.ops.quant_oracle import skip_unavailable

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KIND = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.int8: 2}


def _patterns(qd, stride: int) -> torch.Tensor:
    """Every ``stride``-th float32 pattern in [0, QMAX], the boundary cases, NaN; both signs."""
    hi = torch.tensor(QMAX[qd], dtype=torch.float32).view(torch.int32).item()
    bits = torch.arange(0, hi + 1, stride, dtype=torch.int64)
    # ties and their neighbours near the smallest subnormal, the subnormal/normal boundary and QMAX
    special = [hi, hi - 1, 0x7FC00000, 0x7F800001, 1, 0x00800000]
    for v in (2.0**-10, 2.0**-9, 2.0**-7, 2.0**-6, 1.0 + 1 / 16, 2.0**-17, 2.0**-16, 2.0**-15, 2.0**-14, 1.125):
        b = torch.tensor(v, dtype=torch.float32).view(torch.int32).item()
        special += [b - 1, b, b + 1]
    bits = torch.cat([bits, torch.tensor(special, dtype=torch.int64)]).to(torch.int32)
    v = bits.view(torch.float32)
    return torch.cat([v, -v])


@pytest.mark.parametrize("qd", FP8, ids=["e4m3", "e5m2"])
def test_numba_encoder_is_torchs_conversion(qd):
    skip_unavailable("cpu")
    from addnorm.ops.cpu.quant import encode_fp8

    v = _patterns(qd, 997)  # ~1.1M patterns of each sign: every binade, most mantissas' neighbourhoods
    want = v.to(qd).view(torch.uint8)
    got = torch.empty_like(want)
    encode_fp8(v.numpy(), got.numpy(), KIND[qd])
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(v[i].item(), hex(want[i].item()), hex(got[i].item())) for i in bad[:5]]


@pytest.mark.parametrize("qd", [*FP8, torch.int8], ids=["e4m3", "e5m2", "int8"])
def test_triton_encoder_is_torchs_conversion_saturated(qd):
    skip_unavailable("triton")
    from addnorm.ops.triton.quant import _INTERPRETED, encode_kernel

    qmax = QMAX[qd]
    v = _patterns(qd if qd != torch.int8 else torch.float8_e4m3fn, 9973)
    big = torch.tensor([qmax * 1.01, qmax + 1, 1e30, float("inf"), 127.5, 126.5, -0.5, 0.5, 1.5, 2.5])
    v = torch.cat([v, big, -big])
    sat = v.clamp(-qmax, qmax)
    if qd == torch.int8:
        want = torch.where(sat.isnan(), 0.0, sat).round().to(torch.int8).view(torch.uint8)
    else:
        want = sat.to(qd).view(torch.uint8)
    got = torch.empty_like(want)
    block = 1 << 14
    encode_kernel[(triton_cdiv(v.numel(), block),)](
        v, got, v.numel(), qmax, KIND=KIND[qd], BITWISE=_INTERPRETED, BLOCK=block
    )
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(v[i].item(), hex(want[i].item()), hex(got[i].item())) for i in bad[:5]]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_interpreter_conversion_is_wrong_without_the_encoder():
    """Why the interpreter needs its own encoder: its float32 -> e4m3 cast differs from torch's (issue 26 measured
    7.96875 -> 4.0, 500 -> 256, NaN -> 384 with Triton 3.9). When a Triton release fixes it this test says so, and
    the bit-level path can go."""
    skip_unavailable("triton")
    from addnorm.ops.triton.quant import _INTERPRETED, encode_kernel

    if not _INTERPRETED:
        pytest.skip("only the interpreter's conversion is in question")
    v = torch.tensor([7.96875, 448.0, 0.3, -100.0, 2.0**-8, float("nan")])
    got = torch.empty(v.numel(), dtype=torch.uint8)
    encode_kernel[(1,)](v, got, v.numel(), 448.0, KIND=0, BITWISE=False, BLOCK=8)
    assert not torch.equal(got, v.to(torch.float8_e4m3fn).view(torch.uint8))
