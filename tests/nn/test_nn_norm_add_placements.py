"""The sandwich and branch-output placements call the fused norm-then-add ops (``addnorm.norm_add``, and
``addnorm.norm_add_norm`` where a sandwich step's sum feeds the next sublayer's norm), with the same bits as the
plain path: the norm module's call, then the add (or the fused add+norm of the next norm).

The plain path is the one a norm with hooks takes (a hooked norm is called as a module so its hooks see it), which
is the code these placements ran before they called the ops; a no-op hook on every norm selects it, and the spies
check that it then calls neither op, so the comparisons compare two different paths."""

import pytest
import torch
from torch import nn

import addnorm.nn.residual as residual_mod
from addnorm.nn import (
    DecoderLayer,
    EncoderLayer,
    LayerNorm,
    Residual,
    RMSNorm,
    TransformerConfig,
    TransformerEncoderDecoder,
    TransformerLM,
)
from addnorm.ops import norm_add, norm_add_norm

TINY = dict(vocab_size=40, d_model=24, n_heads=4, n_layers=2, max_seq_len=16)


@pytest.fixture
def calls(monkeypatch):
    """Counts of the ops' calls from addnorm.nn (the real ops still run)."""
    seen = {"norm_add": 0, "norm_add_norm": 0}

    def spy(name, op):
        def counted(*args, **kwargs):
            seen[name] += 1
            return op(*args, **kwargs)

        monkeypatch.setattr(residual_mod, name, counted)

    spy("norm_add", norm_add)
    spy("norm_add_norm", norm_add_norm)
    return seen


def _hook_every_norm(model):
    """A no-op forward hook on every norm: each is then called as a module (the plain path)."""
    for m in model.modules():
        if isinstance(m, (LayerNorm, RMSNorm)):
            m.register_forward_hook(lambda mod, args, out: None)


def _randomize_norms(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (LayerNorm, RMSNorm)):
                for p in m.parameters():
                    p.add_(torch.randn_like(p) * 0.3)
    return model


def _run(model, *inputs):
    torch.manual_seed(1)
    out = model(*inputs)
    (out.float().square().mean() * 100).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _twins(cls, config, dtype):
    """Two copies of one model: ``fused`` as built, ``plain`` with every norm hooked."""
    fused = _randomize_norms(cls(config)).to(dtype)
    plain = cls(config).to(dtype)
    plain.load_state_dict(fused.state_dict())
    _hook_every_norm(plain)
    return fused, plain


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


OPTIONS = {
    "default": {},
    "zero-centered": {"zero_centered_weight": True},
    "cast-before-weight": {"norm_kwargs": {"cast_before_weight": True}},
    "no-bias, eps": {"bias": False, "eps": 1e-3},
    "qk-norm, swiglu": {"qk_norm": True, "ffn": "swiglu"},
    "unfused chain": {"fuse_add_norm": False},
}


@pytest.mark.parametrize("placement", ["sandwich", "branch-output"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lm_with_the_ops_equals_the_plain_path(placement, norm, option, dtype, calls):
    config = TransformerConfig(**TINY, placement=placement, norm=norm, **OPTIONS[option])
    fused, plain = _twins(TransformerLM, config, dtype)
    ids = torch.randint(0, 40, (2, 9))
    fused_run = _run(fused, ids)
    n_ops = dict(calls)
    plain_run = _run(plain, ids)
    # 2 layers of 2 sublayers; with the chain fused, a sandwich layer's first sum feeds the second's Norm_in
    chained = placement == "sandwich" and config.fuse_add_norm
    assert n_ops == {"norm_add": 2 if chained else 4, "norm_add_norm": 2 if chained else 0}
    assert calls == n_ops  # the hooked twin called neither op
    if dtype == torch.float32 or not chained:
        _assert_same(fused_run, plain_run)
    else:
        _assert_bf16_chain_as_accurate(fused, fused_run, plain_run, ids)


def _assert_bf16_chain_as_accurate(fused, fused_run, plain_run, ids):
    """bf16 through norm_add_norm: the forward is the same bits; the gradients are not. The plain path's fused
    add+norm sums the stream's gradient and its norm's input gradient in fp32 and rounds once; norm_add_norm's
    backward rounds otherwise (its composition rounds the norm's input gradient to bf16 before the sum, a fused
    kernel passes both roundings through): a last-bit difference per element, which the bf16 backward carries on
    (~1% of a gradient's norm here). So each gradient must be as close to the fp64 model's as the plain path's is:
    within 1.5 times its error, plus 2^-9 of the gradient's norm (bf16's half ulp, a floor for errors of 0). The
    gradients that are 0 in exact arithmetic (K's bias, the K-norm's bias: softmax ignores a shift common to a
    query's scores) are rounding noise in both paths and are left out."""
    assert torch.equal(fused_run[0], plain_run[0])
    oracle = fused.__class__(fused.config).double()
    oracle.load_state_dict(fused.state_dict())
    _, grads64 = _run(oracle, ids)
    scale = max(g.norm() for g in grads64.values())
    for name, g64 in grads64.items():
        if g64.norm() < 1e-12 * scale:
            assert name.endswith(("k_proj.bias", "k_norm.bias")), name  # no other gradient is 0
            continue
        err_ops = (fused_run[1][name].double() - g64).norm()
        err_plain = (plain_run[1][name].double() - g64).norm()
        assert err_ops <= 1.5 * err_plain + 2**-9 * g64.norm(), name


@pytest.mark.parametrize("placement", ["sandwich", "branch-output"])
def test_encoder_decoder_with_the_ops_equals_the_plain_path_bitwise(placement, calls):
    config = TransformerConfig(**TINY, placement=placement, norm="rmsnorm")
    fused, plain = _twins(TransformerEncoderDecoder, config, torch.float32)
    src, tgt = torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (2, 5))
    fused_run = _run(fused, src, tgt)
    n_ops = dict(calls)
    _assert_same(fused_run, _run(plain, src, tgt))
    # encoder layers: 2 sublayers, decoder layers: 3 (self-attention -> cross-attention -> FFN)
    if placement == "sandwich":
        assert n_ops == {"norm_add": 4, "norm_add_norm": 2 * 1 + 2 * 2}
    else:
        assert n_ops == {"norm_add": 2 * 2 + 2 * 3, "norm_add_norm": 0}


def test_sandwich_layer_passes_each_norm_to_the_chain_op(monkeypatch):
    """The chain op gets the step's Norm_out first and the next step's Norm_in second, each with its own options."""
    config = TransformerConfig(**TINY, placement="sandwich", norm="layernorm", zero_centered_weight=True)
    layer = EncoderLayer(config, causal=True)
    layer.attn.norm_out.eps, layer.ffn.norm.eps = 1e-3, 1e-2
    layer.ffn.norm.cast_before_weight = True
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return norm_add_norm(*args, **kwargs)

    monkeypatch.setattr(residual_mod, "norm_add_norm", spy)
    layer(torch.randn(2, 5, 24))
    ((args, kwargs),) = seen
    y, x, w1, w2, b1, b2, eps1, eps2 = args
    assert w1 is layer.attn.norm_out.weight and w2 is layer.ffn.norm.weight
    assert b1 is layer.attn.norm_out.bias and b2 is layer.ffn.norm.bias
    assert (eps1, eps2) == (1e-3, 1e-2)
    assert kwargs["norm"] == kwargs["norm2"] == "layer"
    assert kwargs["zero_centered_weight"] == (True, True)
    assert kwargs["cast_before_weight"] == (False, True)


def test_residual_forward_calls_norm_add(calls):
    for placement in ("sandwich", "branch-output"):
        r = _randomize_norms(Residual(nn.Linear(24, 24), 24, placement=placement, norm="rmsnorm"))
        x = torch.randn(3, 24)
        out = r(x)
        h = r.norm(x) if r.norm is not None else x
        assert torch.equal(out, x + r.norm_out(r.sublayer(h)))
    assert calls == {"norm_add": 2, "norm_add_norm": 0}


def _layer_calls(calls, layer, x, *inputs):
    before = dict(calls)
    out = layer(x, *inputs)
    return out, {k: calls[k] - before[k] for k in calls}


def test_live_dropout_keeps_the_plain_path(calls):
    """Dropout runs between Norm_out and the add: the ops cannot take it, so training with dropout adds as before;
    in eval (or with p = 0) the ops run."""
    layer = EncoderLayer(TransformerConfig(**TINY, placement="sandwich", norm="rmsnorm", dropout=0.2), causal=True)
    x = torch.randn(2, 5, 24)
    _, n = _layer_calls(calls, layer.train(), x)
    assert n == {"norm_add": 0, "norm_add_norm": 0}
    _, n = _layer_calls(calls, layer.eval(), x)
    assert n == {"norm_add": 1, "norm_add_norm": 1}


@pytest.mark.parametrize("norm", ["dyt", "batchnorm", "scalenorm", "none"])
def test_norms_the_ops_do_not_describe_keep_the_plain_path(norm, calls):
    for placement in ("sandwich", "branch-output"):
        layer = EncoderLayer(TransformerConfig(**TINY, placement=placement, norm=norm), causal=True)
        layer(torch.randn(2, 5, 24))
    assert calls == {"norm_add": 0, "norm_add_norm": 0}


def test_a_residual_dtype_keeps_the_plain_path(calls):
    """A norm's residual_dtype sets the dtype it normalizes (and RMSNorm's default eps): not the ops' contract."""
    config = TransformerConfig(
        **TINY, placement="sandwich", norm="rmsnorm", norm_kwargs={"residual_dtype": torch.float64}
    )
    EncoderLayer(config, causal=True)(torch.randn(2, 5, 24))
    assert calls == {"norm_add": 0, "norm_add_norm": 0}


def test_hooks_on_a_norm_still_see_its_calls(calls):
    layer = EncoderLayer(TransformerConfig(**TINY, placement="sandwich", norm="layernorm"), causal=True)
    seen = []
    layer.attn.norm_out.register_forward_hook(lambda m, args, out: seen.append(len(args)))
    layer(torch.randn(2, 5, 24))
    assert seen == [1]  # Norm_out(F(h)) called as a module: the chain fell back for the attention step
    assert calls == {"norm_add": 1, "norm_add_norm": 0}  # the FFN step's Norm_out is unhooked: norm_add


class _Widen(nn.Module):
    """A sublayer whose output is fp32 while the stream is bf16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(24, 24)

    def forward(self, h):
        return self.lin(h.float())


def test_a_branch_of_another_dtype_keeps_the_fused_add_norm_call(calls):
    """norm_add_norm's sum has the promoted dtype and its second output the sum's dtype, where the fused add+norm
    keeps the stream's and the branch's: with a branch in another dtype the chain keeps that call (same bits)."""

    def steps(model):
        return [(model[0], (), {}), (model[1], (), {})]

    from addnorm.nn.layers import residual_chain

    def make():
        torch.manual_seed(3)
        return nn.ModuleList(Residual(_Widen(), 24, placement="sandwich", norm="rmsnorm") for _ in range(2))

    fused, plain = make(), make()
    _hook_every_norm(plain)
    x = torch.randn(2, 5, 24).bfloat16()
    out = residual_chain(x, steps(fused))
    assert calls == {"norm_add": 1, "norm_add_norm": 0}
    assert out.dtype == torch.float32  # x + Norm_out(y): the promoted dtype, as before
    assert torch.equal(out, residual_chain(x, steps(plain)))


def test_decoder_layer_sandwich_chains_three_steps(calls):
    layer = DecoderLayer(TransformerConfig(**TINY, placement="sandwich", norm="rmsnorm"))
    layer(torch.randn(2, 5, 24), torch.randn(2, 4, 24))
    assert calls == {"norm_add": 1, "norm_add_norm": 2}
