"""hf/chain.py: a norm on a branch's output fused with the residual add after it (``norm_add``) and with the norm
that reads the sum next (``norm_add_norm``): the branch-output layers (OLMo 2, OLMo 3, EXAONE 4) and the sandwich
ones (Gemma 2, Gemma 3); issue 37.

First on stacks written here in those shapes (no transformers needed): the patched stack gives the unpatched
output bit for bit, makes the fused calls it claims, per op, and falls back to the modules where the op would not
compute what they do. Then ``hf.apply`` on the five families built tiny from their configs: logits bitwise equal
to the norms-only patch in fp32 and to the unpatched model in bf16 (RMSNorm families: bitwise is the contract),
the same greedy tokens, and the ops each family's layers call.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from addnorm.integrations.hf import chain, handoff, links, rewrite
from addnorm.integrations.hf.norms import OnePlusWeightLayerNorm
from addnorm.nn.norms import LayerNorm, RMSNorm
from tests.integrations.stack_helpers import W
from tests.integrations.stack_helpers import randomize as _randomize


class Sandwich(nn.Module):
    """Gemma 2's layer: a norm before and after each branch, the next layer reading its input norm."""

    def __init__(self, norm=RMSNorm):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = norm(W, eps=1e-6), norm(W, eps=1e-6)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(W, eps=1e-6), norm(W, eps=1e-6)
        self.attn, self.mlp = nn.Linear(W, W), nn.Linear(W, W)
        for n in self.children():
            if not isinstance(n, nn.Linear):
                _randomize(n)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.attn(hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class BranchOutput(nn.Module):
    """OLMo 2's layer: no norm before a branch, one on its output."""

    def __init__(self, norm=RMSNorm):
        super().__init__()
        self.post_attention_layernorm, self.post_feedforward_layernorm = norm(W), norm(W)
        self.attn, self.mlp = nn.Linear(W, W), nn.Linear(W, W)
        _randomize(self.post_attention_layernorm)
        _randomize(self.post_feedforward_layernorm)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class Stack(nn.Module):
    def __init__(self, layer, n=3, norm=RMSNorm):
        super().__init__()
        self.layers = nn.ModuleList(layer(norm=norm) for _ in range(n))
        self.norm = norm(W)
        _randomize(self.norm)

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        hidden_states = self.norm(hidden_states)
        return hidden_states


def _patched(model: Stack) -> Stack:
    """A copy of ``model`` patched as hf.apply patches a transformers model: each layer's forward rewritten, then
    each layer linked to the norm that reads its sum next."""
    new = copy.deepcopy(model)
    original = {}
    for layer in new.layers:
        cls = type(layer)
        result = rewrite.rewrite_forward(cls, rewrite.norm_attributes(layer))
        assert result is not None and result.forward._addnorm_handoff
        layer.__class__ = type(f"Fused{cls.__name__}", (cls,), {"forward": result.forward})
        original[layer] = cls
    links.link(new, original)
    return new


def _ops(fn, *args):
    before = handoff.fused_ops()
    out = fn(*args)
    after = handoff.fused_ops()
    return out, {k: after[k] - before[k] for k in after if after[k] != before[k]}


# Per layer of 3: the sandwich chains its post-attention norm with the pre-MLP norm, and its post-MLP norm with the
# next layer's input norm (the last: the final norm). A branch-output layer has no norm after its adds but the
# final one: norm_add twice per layer, the last add chained with the final norm.
EXPECTED = {
    Sandwich: {"norm_add_norm": 6},
    BranchOutput: {"norm_add": 5, "norm_add_norm": 1},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", [RMSNorm, LayerNorm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("layer", [Sandwich, BranchOutput], ids=lambda c: c.__name__)
def test_output_bitwise_equal_with_the_chained_calls(layer, norm, dtype):
    torch.manual_seed(0)
    model = Stack(layer, norm=norm).to(dtype).eval()
    new = _patched(model)
    x = torch.randn(2, 5, W, dtype=dtype)
    with torch.no_grad():
        want = model(x)
        got, ops = _ops(new, x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert ops == EXPECTED[layer]


def test_the_rewritten_sandwich_calls_the_chain():
    result = rewrite.rewrite_forward(Sandwich, rewrite.norm_attributes(Sandwich()))
    assert "_addnorm_norm_add_norm(self.post_attention_layernorm, self.pre_feedforward_layernorm" in result.source
    assert "_addnorm_norm_add_handoff(self, self.post_feedforward_layernorm" in result.source
    assert set(result.fused) == {"post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"}


@pytest.mark.parametrize("layer", [Sandwich, BranchOutput], ids=lambda c: c.__name__)
def test_gradients_equal_the_original(layer):
    torch.manual_seed(2)
    model = Stack(layer).train()
    new = _patched(model)
    x = torch.randn(2, 5, W)
    probe = torch.randn(2, 5, W)
    grads = []
    for m in (model, new):
        xi = x.clone().requires_grad_()
        (m(xi) * probe).sum().backward()
        grads.append([xi.grad, *(p.grad for p in m.parameters())])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_hook_on_a_post_norm_runs_and_the_chain_steps_aside():
    """The op does not call the norm modules: where one has a hook, the modules are called as written."""
    torch.manual_seed(3)
    model = Stack(Sandwich).eval()
    new = _patched(model)
    seen = []
    new.layers[1].post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    x = torch.randn(3, W)
    with torch.no_grad():
        got, ops = _ops(new, x)
        want = model(x)
    assert torch.equal(got, want)
    assert seen == [(3, W)]
    # layer 1's attention sum: norm_add falls back too (the hooked norm is its post-norm), the pre-MLP norm alone
    assert ops == {"norm_add_norm": 5}


def test_a_pre_hook_replacing_the_consumers_input_is_seen():
    """The handoff's consumer is still called (its hooks run); a pre-hook that gives it another tensor makes it
    normalize that tensor, not return the chain's output."""
    torch.manual_seed(4)
    model = Stack(BranchOutput).eval()
    new = _patched(model)
    for m in (model, new):
        m.norm.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    x = torch.randn(3, W)
    with torch.no_grad():
        assert torch.equal(new(x), model(x))


def test_norms_the_op_cannot_express_are_called_as_written():
    """A gain formed otherwise (Nemotron's weight + 1), a weight of another dtype than the input (HF's weight * x
    promotes): no fused call, the modules' own output."""
    torch.manual_seed(5)
    y, a = torch.randn(4, W), torch.randn(4, W)
    plus_one = OnePlusWeightLayerNorm(W)
    _randomize(plus_one)
    assert _ops(chain.norm_add, plus_one, y, a)[1] == {}
    assert torch.equal(chain.norm_add(plus_one, y, a), a + plus_one(y))
    post, pre = RMSNorm(W), RMSNorm(W, dtype=torch.float64)
    _randomize(post)
    _randomize(pre)
    (n, h), ops = _ops(chain.norm_add_norm, post, pre, y, a)
    assert ops == {"norm_add": 1}  # the first half still fuses
    assert torch.equal(h, a + post(y)) and torch.equal(n, pre(h))
    (n, h), ops = _ops(chain.norm_add_norm, post, post, y, a.double())  # operands of two dtypes: HF's promotion
    assert ops == {} and h.dtype == torch.float64 and torch.equal(h, a.double() + post(y))


def test_unlinked_handoff_is_norm_add():
    torch.manual_seed(6)
    layer, post = nn.Linear(W, W), RMSNorm(W)
    _randomize(post)
    y, a = torch.randn(4, W), torch.randn(4, W)
    out, ops = _ops(chain.norm_add_handoff, layer, post, y, a)
    assert ops == {"norm_add": 1} and torch.equal(out, a + post(y))


# --------------------------------------------------------------------------------------------------------------
# hf.apply on the families, built tiny from their configs
# --------------------------------------------------------------------------------------------------------------

# the ops each family's layers call (per forward of 2 layers): the branch-output layers norm_add, their last add
# chained with the final norm; the sandwich layers norm_add_norm only, each post-norm chained with the next norm
FAMILIES = {
    "olmo2": {"norm_add": 3, "norm_add_norm": 1},
    "olmo3": {"norm_add": 3, "norm_add_norm": 1},
    "exaone4": {"norm_add": 3, "norm_add_norm": 1},
    "gemma2": {"norm_add_norm": 4},
    "gemma3": {"norm_add_norm": 4},
}


@pytest.fixture(scope="module")
def transformers():
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    return t


def _model(family: str, dtype=torch.float32):
    from addnorm.integrations import hf
    from addnorm.integrations.hf.norm_probe import randomize_norms

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf.tiny_model(family)
    randomize_norms(model)
    return model.to(dtype)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _apply(model, fuse_residual=True):
    from addnorm.integrations import hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.apply(model, fuse_residual=fuse_residual)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_fp32_logits_bitwise_equal_to_the_norms_only_patch(transformers, family):
    from addnorm.integrations import hf

    model = _model(family)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    _apply(model, fuse_residual=False)
    norms_only = _logits(model, ids)
    hf.revert(model)
    _apply(model)
    got, ops = _ops(_logits, model, ids)
    assert ops == FAMILIES[family]
    assert torch.equal(got, norms_only)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()  # the norms' own summation order


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_bf16_logits_and_greedy_tokens_unchanged(transformers, family, monkeypatch):
    """In bf16 the RMSNorm families' contract is bitwise: the fused model's logits equal the unpatched model's."""
    from addnorm.integrations import hf

    monkeypatch.setenv("ADDNORM_BACKEND", "torch")
    model = _model(family, torch.bfloat16).eval()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    ref = _logits(model, ids)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_tokens = model.generate(ids, **kw)
    _apply(model)
    got, ops = _ops(_logits, model, ids)
    assert ops == FAMILIES[family]
    assert torch.equal(got, ref)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens, ops = _ops(lambda: model.generate(ids, **kw))
    assert torch.equal(tokens, ref_tokens)
    assert set(ops) == set(FAMILIES[family])  # the decode steps run the same fused ops
    hf.revert(model)
