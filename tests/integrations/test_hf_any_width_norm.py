"""Parameter-free RMSNorms of any width (nanochat's, HRM's: ``x * rsqrt(mean(x^2) + eps)`` in fp32, rounded once to
x's dtype, no weight and no normalized_shape): the probe recognises them only if they compute the same norm at two
widths, and hf.apply swaps in :class:`~addnorm.integrations.hf.norms.AnyWidthRMSNorm`, which normalizes any last dim
with the fused residual add. Checked against float64, forward and gradient, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from addnorm.integrations.hf import norm_probe
from addnorm.integrations.hf.norms import AnyWidthRMSNorm


class _WeightlessRMSNorm(nn.Module):
    """What nanochat and HRM define (no parameter, no width)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).type_as(x)


class _FixedDivisorNorm(_WeightlessRMSNorm):
    """Divides the sum of squares by 48 whatever the width: an RMSNorm at width 48 only."""

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / 48 + self.variance_epsilon)).type_as(x)


def _oracle(x, residual, dtype):
    """float64 norm of h, h = x + residual rounded to the stream's dtype first (the stream the op returns)."""
    h = x.double() if residual is None else (x.double() + residual.double()).to(dtype).double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), h


def test_the_probe_takes_a_weightless_norm_that_works_at_any_width():
    info = norm_probe.probe(_WeightlessRMSNorm())
    assert info is not None
    assert (info.kind, info.eps, info.weight, info.bias, info.width, info.addnorm) == (
        "rmsnorm",
        1e-6,
        False,
        False,
        None,
        "rmsnorm-any-width",
    )
    assert isinstance(norm_probe.make_addnorm(_WeightlessRMSNorm(), info, device="cpu"), AnyWidthRMSNorm)


def test_the_probe_refuses_a_parameter_free_module_that_is_a_norm_at_one_width_only():
    # at width 48 it is exactly an RMSNorm; at the second width it is not: no any-width match
    assert norm_probe.probe(_FixedDivisorNorm()) is None


def test_a_norm_with_a_width_keeps_its_width():
    info = norm_probe.probe(nn.LayerNorm(40, elementwise_affine=False))
    assert info.width == 40 and info.addnorm == "layernorm"


@pytest.mark.parametrize("n", [1, 33, 64, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
def test_any_width_rmsnorm_matches_float64_forward_and_backward(n, dtype, with_residual):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 5, n, generator=g) * 3).to(dtype).requires_grad_(True)
    r = (torch.randn(3, 5, n, generator=g)).to(dtype).requires_grad_(True) if with_residual else None
    dout = torch.randn(3, 5, n, generator=g).to(dtype)
    norm = AnyWidthRMSNorm(eps=1e-6)
    got = norm(x, r)
    out, h = got if with_residual else (got, None)
    want_out, want_h = _oracle(x.detach(), None if r is None else r.detach(), dtype)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    if with_residual:
        torch.testing.assert_close(h.double(), want_h, rtol=tol, atol=tol)
    # matches the HF module it replaces, bit for bit in both dtypes (fp32 statistics, one rounding)
    hf_in = x.detach() if r is None else (x.detach() + r.detach())
    assert torch.equal(out.detach(), _WeightlessRMSNorm()(hf_in))
    out.backward(dout)
    x64 = x.detach().double().requires_grad_(True)
    r64 = None if r is None else r.detach().double().requires_grad_(True)
    _oracle(x64, r64, torch.float64)[0].backward(dout.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol * 10, atol=tol * 10)
    if with_residual:
        torch.testing.assert_close(r.grad.double(), r64.grad, rtol=tol * 10, atol=tol * 10)


def test_any_width_rmsnorm_rejects_bad_input_by_name():
    norm = AnyWidthRMSNorm(eps=1e-6)
    with pytest.raises(ValueError, match="input"):
        norm(torch.tensor(1.0))
    with pytest.raises((ValueError, RuntimeError), match="residual"):
        norm(torch.randn(2, 8), torch.randn(2, 9))
    assert "any width" in repr(norm) and norm.variance_epsilon == 1e-6
