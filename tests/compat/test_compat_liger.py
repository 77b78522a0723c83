"""addnorm.compat.liger against the float64 oracle, forward and every gradient, on torch/reference/cpu/triton
(Triton in its interpreter), for each casting mode and offset."""

from __future__ import annotations

import pytest
import torch

from addnorm.compat.liger import LigerFusedAddRMSNorm, LigerFusedAddRMSNormFunction, liger_fused_add_rms_norm
from addnorm.ops import backends
from addnorm.testing import assert_close


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu", "triton"])
@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("offset", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_function_matches_the_float64_oracle(backend, casting_mode, offset, dtype):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(7)
    X = torch.randn(2, 5, 64, generator=g).to(dtype).requires_grad_(True)
    R = torch.randn(2, 5, 64, generator=g).to(dtype).requires_grad_(True)
    W = (0.5 + 0.2 * torch.randn(64, generator=g)).to(dtype).requires_grad_(True)
    Y, S = LigerFusedAddRMSNormFunction.apply(X, R, W, 1e-6, offset, casting_mode, False, backend=backend)
    assert Y.dtype == S.dtype == dtype and Y.shape == X.shape
    dY, dS = torch.randn(Y.shape, generator=g).to(dtype), torch.randn(S.shape, generator=g).to(dtype)
    torch.autograd.backward([Y, S], [dY, dS])
    Xd, Rd = X.detach().double().requires_grad_(True), R.detach().double().requires_grad_(True)
    Wd = W.detach().double().requires_grad_(True)
    Sd = Xd + Rd
    S_st = Sd + (Sd.detach().to(dtype).double() - Sd.detach())
    xhat = S_st * torch.rsqrt(S_st.square().mean(-1, keepdim=True) + 1e-6)
    if casting_mode == "llama":
        xhat = xhat + (xhat.detach().to(dtype).double() - xhat.detach())
    Yd = xhat * (Wd + offset)
    torch.autograd.backward([Yd, S_st], [dY.double(), dS.double()])
    assert_close(S, S_st.detach(), "S")
    assert_close(Y, Yd.detach(), "Y")
    assert_close(X.grad, Xd.grad, "dX", grad=True)
    assert_close(R.grad, Rd.grad, "dR", grad=True)
    assert_close(W.grad, Wd.grad, "dW", grad=True, reduced_rows=10)


def test_llama_mode_is_cast_before_weight_and_differs_from_gemma_in_bf16():
    """The casting modes are not silently the same computation: in bf16 llama rounds twice, gemma once."""
    g = torch.Generator().manual_seed(1)
    X, R = torch.randn(64, 256, generator=g).bfloat16(), torch.randn(64, 256, generator=g).bfloat16()
    W = (1 + 0.3 * torch.randn(256, generator=g)).bfloat16()
    y_llama, _ = liger_fused_add_rms_norm(X, R, W, 1e-6, casting_mode="llama", backend="torch")
    y_gemma, _ = liger_fused_add_rms_norm(X, R, W, 1e-6, casting_mode="gemma", backend="torch")
    assert not torch.equal(y_llama, y_gemma)
    import addnorm

    expected, _ = addnorm.add_rms_norm(X, R, W, 1e-6, cast_before_weight=True, backend="torch")
    assert torch.equal(y_llama, expected)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_module_forward_backward_and_offset_one_is_zero_centered(backend):
    m = LigerFusedAddRMSNorm(32, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros", backend=backend)
    x, r = torch.randn(3, 32, requires_grad=True), torch.randn(3, 32)
    y, s = m(x, r)
    assert torch.equal(s, x.detach() + r)
    ref = torch.nn.functional.rms_norm(s, (32,), None, 1e-6)  # zero weight + offset 1 = identity scale
    assert_close(y, ref.double(), "Y")
    y.sum().backward()
    assert m.weight.grad is not None and x.grad is not None
    assert "offset=1.0" in repr(m) and "casting_mode=gemma" in repr(m)


def test_inputs_are_not_overwritten_with_in_place():
    """Liger's in_place concerns its backward only: X and R are left as they were."""
    X, R, W = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    X0, R0 = X.clone(), R.clone()
    liger_fused_add_rms_norm(X, R, W, 1e-6, in_place=True)
    assert torch.equal(X, X0) and torch.equal(R, R0)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="offset"):
        liger_fused_add_rms_norm(torch.randn(2, 4), torch.randn(2, 4), torch.ones(4), 1e-6, offset="1")
    with pytest.raises(ValueError, match="casting_mode"):
        LigerFusedAddRMSNorm(4, casting_mode="fp8")


def test_casting_mode_and_hidden_size_as_liger_checks_them():
    """Liger's ``fused_add_rms_norm_forward`` (linkedin/Liger-Kernel src/liger_kernel/ops/fused_add_rms_norm.py at
    0ece4877) takes a casting mode by name or by its integer code (llama 0, gemma 1, none -1), asserts anything else
    ("Invalid casting mode: ..."), and asserts W's length against X's hidden size: AssertionErrors there and here."""
    X, R, W = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5
    for code, name in ((0, "llama"), (1, "gemma"), (-1, "none")):
        got = liger_fused_add_rms_norm(X, R, W, 1e-6, casting_mode=code, backend="torch")
        want = liger_fused_add_rms_norm(X, R, W, 1e-6, casting_mode=name, backend="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for bad in ("fp8", 2, None):
        with pytest.raises(AssertionError, match="Invalid casting mode"):
            LigerFusedAddRMSNormFunction.apply(X, R, W, 1e-6, 0.0, bad)
    with pytest.raises(AssertionError, match="Incompatible hidden size dimension"):
        liger_fused_add_rms_norm(X, R, torch.ones(4), 1e-6)
