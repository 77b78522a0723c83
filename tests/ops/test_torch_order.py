"""The cpu backend sums RMSNorm's squares in PyTorch's own order (addnorm.ops.cpu.torch_order), so its rstd is
PyTorch's bit for bit: checked against ``torch.sum`` over row lengths that take every branch of ATen's cascade sum
(shorter than a vector, leftover vectors, leftover values, one and several cascade steps, a wider cascade step), on
every storage type, and through the public ops against the torch backend (``F.rms_norm``'s kernel) and FlashInfer's
reference formula. Before this order the kernels' reassociated 8-lane sum differed from PyTorch's in the last bit of
some rows' rstd (FlashInfer's own tests then saw one bf16 element one ulp off now and then)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from addnorm import add_rms_norm
from addnorm.ops import backends

pytestmark = pytest.mark.skipif(
    backends.unavailable_reason("cpu", torch.device("cpu")) is not None, reason="the cpu backend needs numba"
)

# 1-7: shorter than one fp32 vector (ATen's scalar form); 8-31: vectors but no whole row of 4; 32 + k: leftover
# vectors and values; 512 / 2048 + 13: one and several cascade steps; 2^22 + 37: a cascade step of 2^5 rows
LENGTHS = [*range(1, 40), 63, 64, 65, 100, 255, 511, 512, 513, 1000, 2048 + 13, 4096, 16384 + 7, 100_000]
STORAGE = {torch.float32: None, torch.float64: None, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


@pytest.fixture
def one_thread(torch_threads):
    # ATen splits one row of >= 32768 values across threads (a two-pass sum); on one thread every row is serial,
    # the order the kernels follow
    torch_threads(1)


def _numpy_rows(x):
    bits = STORAGE[x.dtype]
    return (x.view(bits) if bits is not None else x).numpy()


@pytest.mark.parametrize("dtype", list(STORAGE), ids=lambda d: str(d).removeprefix("torch."))
def test_sum_of_squares_is_torch_sum_bit_for_bit(dtype, one_thread):
    from addnorm.ops.cpu.torch_order import row_sum_sq

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    zero = np.float64(0) if acc == torch.float64 else np.float32(0)
    gen = torch.Generator().manual_seed(5)
    mismatches = []
    for n in LENGTHS:
        x = (torch.randn(3, n, generator=gen) * 3 + 0.7).to(dtype)
        want = x.to(acc).pow(2).sum(-1).tolist()
        rows = _numpy_rows(x)
        got = [float(row_sum_sq(rows[i], n, zero)) for i in range(3)]
        if got != want:
            mismatches.append((n, got, want))
    assert not mismatches, mismatches[:5]


def test_a_wide_cascade_step(one_thread):
    # 2^22 + 37 values: rows of 4 vectors number 2^17, so the cascade's step is 2^5 rows, not the usual 2^4
    from addnorm.ops.cpu.torch_order import row_sum_sq

    x = torch.randn(1, (1 << 22) + 37, generator=torch.Generator().manual_seed(1))
    assert row_sum_sq(x.numpy()[0], x.shape[1], np.float32(0)) == x.pow(2).sum(-1).item()


SHAPES = [(1, 4096), (19, 1024), (99, 3072), (7, 111), (33, 5), (300, 512)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cpu_rms_norm_is_the_torch_backends_bit_for_bit(dtype):
    # the torch backend runs ATen's own RMSNorm kernel (F.rms_norm); with PyTorch's order the cpu kernel's rstd is
    # that kernel's, so every output element is too, with and without a residual and a weight
    gen = torch.Generator().manual_seed(2)
    for m, n in SHAPES:
        x, r = (torch.randn(m, n, generator=gen).to(dtype) for _ in range(2))
        w = torch.randn(n, generator=gen).to(dtype)
        for residual, weight in ((r, w), (None, w), (r, None)):
            cpu = add_rms_norm(x, residual, weight, eps=1e-6, backend="cpu")
            ref = add_rms_norm(x, residual, weight, eps=1e-6, backend="torch")
            for a, b in zip(cpu, ref):  # (out, residual_out)
                assert torch.equal(a, b), (m, n, residual is None, weight is None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flashinfer_reference_formula_bit_for_bit(dtype, monkeypatch):
    # FlashInfer's tests compare against rstd = rsqrt(mean(x.float()^2) + eps), x * rstd * w in fp32, rounded once,
    # with a tolerance below one half-precision ulp: the cpu backend now meets it on every element, not most
    import addnorm.compat.flashinfer as flashinfer

    monkeypatch.setenv("ADDNORM_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(3)
    eps = 1e-6
    for m, n in [(19, 1024), (99, 3072), (989, 512), (1, 16384)]:
        for _ in range(3):
            x = torch.randn(m, n, generator=gen).to(dtype)
            w = torch.randn(n, generator=gen).to(dtype)
            xf = x.float()
            ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)
            out = flashinfer.rmsnorm(x, w, eps)
            assert torch.equal(out, ref), (m, n, int((out != ref).sum()))


def test_rms_rstd_is_the_formulas():
    # the saved rstd itself, over lengths on both sides of a vector, and through the guard's entry point
    from addnorm.ops.cpu.stats import guarded_row_stats, row_stats

    x = torch.randn(6, 777, generator=torch.Generator().manual_seed(4))
    want = torch.rsqrt(x.pow(2).mean(-1) + 1e-6).tolist()
    assert [row_stats(x.numpy()[i], 777, True, np.float32(1e-6), np.float32(0))[1] for i in range(6)] == want
    assert [guarded_row_stats(x.numpy()[i], 777, True, np.float32(1e-6), np.float32(0))[1] for i in range(6)] == want
    y = torch.randn(3, 5, generator=torch.Generator().manual_seed(7))
    want = torch.rsqrt(y.pow(2).mean(-1) + 1e-6).tolist()
    assert [row_stats(y.numpy()[i], 5, True, np.float32(1e-6), np.float32(0))[1] for i in range(3)] == want
