"""LayerNorm Scaling (Sun et al. 2025): in Pre-LN layer l (1-based) the norm on each branch's input is multiplied
by 1/sqrt(l), on the fused and the unfused path alike; the config refuses it where it has no meaning."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.nn import TransformerConfig, TransformerLM
from addnorm.nn.residual import Residual


def _lm(**kw) -> TransformerLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=11, d_model=8, n_layers=3, n_heads=2, max_seq_len=6, backend="torch")
    return TransformerLM(TransformerConfig(**{**cfg, **kw}))


def _scaled_by_hand(net: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    """The forward pass written out: x + F(Norm(x) / sqrt(l)) for each sublayer of layer l."""
    x = net.embed(ids)
    for i, block in enumerate(net.blocks):
        s = 1.0 / math.sqrt(i + 1)
        x = x + block.attn.sublayer(block.attn.norm(x) * s)
        x = x + block.ffn.sublayer(block.ffn.norm(x) * s)
    return net.lm_head(net.final_norm(x))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_each_layers_norm_output_is_scaled_by_one_over_sqrt_of_its_depth(fused, norm):
    net = _lm(layernorm_scaling=True, fuse_add_norm=fused, norm=norm).eval()
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    assert [b.attn.norm_output_scale for b in net.blocks] == pytest.approx([1.0, 1 / math.sqrt(2), 1 / math.sqrt(3)])
    assert [b.ffn.norm_output_scale for b in net.blocks] == [b.attn.norm_output_scale for b in net.blocks]
    torch.testing.assert_close(net(ids), _scaled_by_hand(net, ids))
    plain = _lm(fuse_add_norm=fused, norm=norm).eval()  # the same weights (same seed), no scaling: differs
    assert not torch.allclose(plain(ids), net(ids))
    assert all(b.attn.norm_output_scale == 1.0 for b in plain.blocks)


def test_gradients_flow_through_the_scaled_norms():
    net = _lm(layernorm_scaling=True)
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(2))
    net(ids).sum().backward()
    g = net.blocks[2].ffn.norm.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_layernorm_scaling_needs_sequential_pre_ln_and_residual_checks_its_scale():
    for bad in (dict(placement="post"), dict(placement="sandwich"), dict(placement="mix"), dict(parallel=True)):
        with pytest.raises(ValueError, match="layernorm_scaling"):
            TransformerConfig(layernorm_scaling=True, **bad)
    with pytest.raises(ValueError, match="norm_output_scale .*placement 'post'"):
        Residual(torch.nn.Identity(), 4, placement="post", norm_output_scale=0.5)
    with pytest.raises(ValueError, match="norm_output_scale must be a finite number"):
        Residual(torch.nn.Identity(), 4, placement="pre", norm_output_scale=float("nan"))
    assert "norm_output_scale=0.5" in repr(Residual(torch.nn.Identity(), 4, placement="pre", norm_output_scale=0.5))


def test_batched_training_applies_it_rather_than_ignoring_it():
    """StackedLM (batched training) scales each branch's normalized input as the modules do: its forward equals
    theirs, and differs from a stack that ignored the scale (tests/train/test_train_batched.py trains it too)."""
    from addnorm.nn import TransformerLM
    from addnorm.train.stacked import StackedLM

    config = TransformerConfig(vocab_size=16, d_model=8, n_layers=3, n_heads=2, max_seq_len=8, layernorm_scaling=True)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(TransformerLM(config))
    ids = torch.randint(0, 16, (2, 3, 8), generator=torch.Generator().manual_seed(0))
    want = torch.stack([m(x) for m, x in zip(models, ids)])
    stacked = StackedLM(models)
    torch.testing.assert_close(stacked(ids), want, rtol=1e-4, atol=1e-5)
    stacked.input_scale = {}  # what ignoring LayerNorm Scaling would compute
    assert not torch.allclose(stacked(ids), want, rtol=1e-3, atol=1e-4)
