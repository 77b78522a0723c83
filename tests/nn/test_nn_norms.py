"""Drop-in norms: same signatures, parameters and state_dicts as torch.nn; fused residual forward."""

import pytest
import torch

import addnorm
from addnorm.nn import LayerNorm, RMSNorm


@pytest.mark.parametrize("shape", [16, (16,), (4, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_torch_and_shares_state_dict(shape, bias):
    ours, theirs = LayerNorm(shape, eps=1e-6, bias=bias), torch.nn.LayerNorm(shape, eps=1e-6, bias=bias)
    torch.nn.init.normal_(theirs.weight)
    if bias:
        torch.nn.init.normal_(theirs.bias)
    ours.load_state_dict(theirs.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    trailing = (shape,) if isinstance(shape, int) else shape
    x = torch.randn(3, 5, *trailing)
    torch.testing.assert_close(ours(x), theirs(x))
    theirs.load_state_dict(ours.state_dict())  # and back


@pytest.mark.parametrize("shape", [16, (4, 6)])
def test_rms_norm_matches_torch_and_shares_state_dict(shape):
    ours, theirs = RMSNorm(shape), torch.nn.RMSNorm(shape)
    torch.nn.init.normal_(theirs.weight)
    ours.load_state_dict(theirs.state_dict())
    trailing = (shape,) if isinstance(shape, int) else shape
    x = torch.randn(2, 3, *trailing)
    torch.testing.assert_close(ours(x), theirs(x))
    assert ours.eps is None and theirs.eps is None


def test_no_affine_has_no_parameters():
    assert list(LayerNorm(8, elementwise_affine=False).parameters()) == []
    assert list(RMSNorm(8, elementwise_affine=False).parameters()) == []
    x = torch.randn(2, 8)
    torch.testing.assert_close(RMSNorm(8, elementwise_affine=False)(x), torch.nn.functional.rms_norm(x, (8,)))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_residual_forward_returns_out_and_residual_out(cls):
    norm = cls(12)
    x, r = torch.randn(2, 3, 12), torch.randn(2, 3, 12)
    out, res = norm(x, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, norm(x + r))
    assert isinstance(norm(x), torch.Tensor)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_zero_centered_weight_starts_at_identity_scale(cls):
    norm = cls(10, zero_centered_weight=True)
    assert torch.equal(norm.weight, torch.zeros(10))
    plain = cls(10)
    x = torch.randn(4, 10)
    torch.testing.assert_close(norm(x), plain(x))
    with torch.no_grad():
        norm.weight.fill_(0.5)
        plain.weight.fill_(1.5)
    torch.testing.assert_close(norm(x), plain(x))


def test_residual_dtype_and_backend_options():
    norm = RMSNorm(8, residual_dtype=torch.float32, backend="reference", dtype=torch.bfloat16)
    out, res = norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and res.dtype == torch.float32


def test_gradients_flow_to_parameters_and_inputs():
    norm = LayerNorm(6)
    x = torch.randn(3, 6, requires_grad=True)
    r = torch.randn(3, 6, requires_grad=True)
    out, res = norm(x, r)
    (out.square().sum() + res.sum()).backward()
    for t in (x.grad, r.grad, norm.weight.grad, norm.bias.grad):
        assert t is not None and torch.isfinite(t).all() and t.abs().sum() > 0


def test_wrong_trailing_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNorm((4, 6))(torch.randn(2, 6, 4))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_cast_before_weight_option_reaches_the_op(cls):
    x, r = torch.randn(6, 32).bfloat16(), torch.randn(6, 32).bfloat16()
    norm = cls(32, eps=1e-5, cast_before_weight=True, dtype=torch.bfloat16, backend="reference")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(32))
    assert norm.cast_before_weight and not cls(32).cast_before_weight
    params = (norm.weight, norm.bias) if cls is LayerNorm else (norm.weight,)
    fn = addnorm.add_layer_norm if cls is LayerNorm else addnorm.add_rms_norm
    want = fn(x, r, *params, 1e-5, cast_before_weight=True, backend="reference")
    got = norm(x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(norm(x), fn(x, None, *params, 1e-5, cast_before_weight=True, backend="reference")[0])


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_repr_shows_addnorm_options_that_differ_from_the_default(cls):
    assert repr(cls(8)) == repr(getattr(torch.nn, cls.__name__)(8))  # plain: exactly torch.nn's
    text = repr(cls(8, zero_centered_weight=True, residual_dtype=torch.float32, backend="torch"))
    assert "zero_centered_weight=True" in text and "residual_dtype=torch.float32" in text and "backend='torch'" in text
    assert "cast_before_weight=True" in repr(cls(8, cast_before_weight=True))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_pickle_and_deepcopy_keep_the_options(cls):
    import copy
    import pickle

    norm = cls(8, zero_centered_weight=True, residual_dtype=torch.float32, backend="reference")
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    for clone in (copy.deepcopy(norm), pickle.loads(pickle.dumps(norm))):
        assert (clone.zero_centered_weight, clone.residual_dtype, clone.backend) == (True, torch.float32, "reference")
        got, want = clone(x, r), norm(x, r)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].dtype == torch.float32
