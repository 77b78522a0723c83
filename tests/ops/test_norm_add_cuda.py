"""The fused norm-then-add Triton kernels on a GPU (skipped without CUDA; benchmarks/gpu_check.sh runs them): model
widths up to the kernels' widest row, the float64 oracle forward and backward, the composition's forward bits, the
in-place forms, and a row's bits whatever the batch (the interpreter, which the CPU tests use, shows no GPU bits)."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops.add_norm import add_rms_norm
from addnorm.ops.norm_add import norm_add_norm, norm_add_norm_
from addnorm.ops.norm_add_ops import MAX_N
from addnorm.testing import assert_close
from tests.ops.test_norm_add_fused import _check_grads, _inputs, chain_oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(t):
    return {k: (v.detach().cuda().requires_grad_(True) if v is not None else None) for k, v in t.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [4096, 5120, MAX_N["triton"]])
def test_chain_on_the_gpu_matches_the_oracle(dtype, n):
    t = _cuda(_inputs((37, n), dtype, 1, b1=True, b2=False))
    out2, h = norm_add_norm(t["y"], t["residual"], t["w1"], t["w2"], t["b1"], None, 1e-5, 1e-6, norm="layer",
                            norm2="rms", backend="triton")  # fmt: skip
    leaves, want2, want_h = chain_oracle(t, eps1=1e-5, eps2=1e-6, rms1=False, rms2=True)
    assert_close(h, want_h, "h")
    assert_close(out2, want2, "out2")
    g = torch.Generator(device="cuda").manual_seed(2)
    c2, ch = (torch.randn(h.shape, generator=g, device="cuda").to(dtype) for _ in range(2))
    torch.autograd.backward((out2, h), (c2, ch))
    torch.autograd.backward((want2, want_h), (c2.double(), ch.double()))
    _check_grads(t, leaves, 37)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_forward_on_the_gpu_is_the_composition_and_in_place_agrees(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    y, r = (torch.randn(64, 4096, generator=g, device="cuda").to(dtype) for _ in range(2))
    w1, w2 = (torch.randn(4096, generator=g, device="cuda").to(dtype) for _ in range(2))
    with torch.no_grad():
        want_h = r + add_rms_norm(y, None, w1, 1e-6, backend="triton")[0]
        want2 = add_rms_norm(want_h, None, w2, 1e-6, backend="triton")[0]
        out2, h = norm_add_norm(y, r, w1, w2, None, None, 1e-6, 1e-6, backend="triton")
        # the unfused kernel may reduce a row in another order: equal within an ulp where not bitwise
        assert_close(h, want_h.double(), "h vs the composition")
        assert_close(out2, want2.double(), "out2 vs the composition")
        yi, ri = y.clone(), r.clone()
        norm_add_norm_(yi, ri, w1, w2, None, None, 1e-6, 1e-6, backend="triton")
        assert torch.equal(ri, h) and torch.equal(yi, out2)


def test_a_rows_bits_on_the_gpu_do_not_depend_on_the_batch():
    g = torch.Generator(device="cuda").manual_seed(4)
    n = 4096
    row_y, row_r = (torch.randn(n, generator=g, device="cuda").bfloat16() for _ in range(2))
    w = torch.randn(n, generator=g, device="cuda").bfloat16()
    got = []
    for m in (1, 3, 64, 1000):
        y, r = (torch.randn(m, n, generator=g, device="cuda").bfloat16() for _ in range(2))
        y[m // 2], r[m // 2] = row_y, row_r
        out2, h = norm_add_norm(y, r, w, w, None, None, 1e-6, 1e-6, backend="triton")
        got.append((h[m // 2], out2[m // 2]))
    for h, o in got[1:]:
        assert torch.equal(h, got[0][0]) and torch.equal(o, got[0][1])
