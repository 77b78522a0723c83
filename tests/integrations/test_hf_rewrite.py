"""hf/rewrite.py: a layer's own forward rewritten so that its residual add runs fused with the norm next to it.

Each layer below is written here in the shapes transformers' families use (no transformers needed); its rewritten
forward must give the original's output bit for bit (fp32 and bf16), make the fused calls it claims
(``fused_runs``), and leave alone what it cannot prove equivalent.
"""

from __future__ import annotations

import functools
import inspect
import traceback

import pytest
import torch
from torch import nn

from addnorm.integrations.hf import rewrite
from addnorm.integrations.hf.norms import CastBeforeWeightRMSNorm, OnePlusWeightLayerNorm
from addnorm.nn.norms import LayerNorm, RMSNorm

W = 24


class _Base(nn.Module):
    def __init__(self, norm=LayerNorm):
        super().__init__()
        self.attn = nn.Linear(W, W)
        self.mlp = nn.Linear(W, W)
        self.norm1, self.norm2 = norm(W), norm(W)
        with torch.no_grad():  # gains away from 1 and biases away from 0: a misplaced weight shows
            for n in (self.norm1, self.norm2):
                n.weight.copy_(1 + 0.3 * torch.randn(W))
                if getattr(n, "bias", None) is not None:
                    n.bias.copy_(0.2 * torch.randn(W))


class PreNorm(_Base):
    def forward(self, hidden_states, scale=1.0):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states * scale
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class Nested(_Base):
    """StableLM's shape: the norm called inside the MLP's call, on the stream's name."""

    def forward(self, x):
        residual = x
        out = self.attn(self.norm1(x))
        residual = residual + out
        return residual + self.mlp(self.norm2(residual))


class Reshaped(_Base):
    """OPT's shape: the sum's shape read, the rows flattened, then the norm; and an ``if`` choosing the order."""

    def forward(self, hidden_states, norm_before=True):
        residual = hidden_states
        hidden_states = self.attn(self.norm1(hidden_states))
        hidden_states = residual + hidden_states
        if not norm_before:
            hidden_states = self.norm1(hidden_states)
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        residual = hidden_states
        if norm_before:
            hidden_states = self.norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return (residual + hidden_states).view(shape)


class CrossBlock(_Base):
    """GPT-BigCode's and XGLM's shape: an optional block between the add and the next norm."""

    def forward(self, hidden_states, encoder=None):
        residual = hidden_states
        hidden_states = self.attn(self.norm1(hidden_states))
        hidden_states = hidden_states + residual
        if encoder is not None:
            residual = hidden_states
            hidden_states = self.norm1(hidden_states)
            hidden_states = self.attn(hidden_states + encoder)
            hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return residual + self.mlp(hidden_states)


class BranchNorm(_Base):
    """OLMo 2's shape: the norm on the branch's output, then the add (norm then add)."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(hidden_states)
        hidden_states = self.norm1(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.norm2(hidden_states)
        hidden_states = hidden_states + residual
        return hidden_states


def _renaming(fn):
    """A decorator like transformers' deprecate_kwarg: an old keyword renamed before the call."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if "old_scale" in kwargs:
            kwargs["scale"] = kwargs.pop("old_scale")
        return fn(self, *args, **kwargs)

    return wrapper


class Decorated(PreNorm):
    @_renaming
    def forward(self, hidden_states, scale=1.0):
        residual = hidden_states
        hidden_states = self.attn(self.norm1(hidden_states))
        hidden_states = residual + hidden_states * scale
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return residual + self.mlp(hidden_states)


def _patched(layer: nn.Module) -> tuple[nn.Module, rewrite.RewriteResult]:
    """A copy of ``layer`` whose class runs the rewritten forward (as hf.apply installs it: a subclass)."""
    import copy

    result = rewrite.rewrite_forward(type(layer), rewrite.norm_attributes(layer))
    assert result is not None, f"{type(layer).__name__} was not rewritten"
    new = copy.deepcopy(layer)
    new.__class__ = type(f"Fused{type(layer).__name__}", (type(layer),), {"forward": result.forward})
    return new, result


def _same(layer, new, *args, **kwargs) -> int:
    """Asserts equal outputs bit for bit; returns the fused calls the new forward made."""
    with torch.no_grad():
        want = layer(*args, **kwargs)
        before = rewrite.fused_runs()
        got = new(*args, **kwargs)
        runs = rewrite.fused_runs() - before
    assert got.dtype == want.dtype and torch.equal(got, want)
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "cls, fused, runs",
    [
        (PreNorm, ("norm2",), 1),
        (Nested, ("norm2",), 1),
        (BranchNorm, ("norm1", "norm2"), 2),
        (Decorated, ("norm2",), 1),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_rewritten_forward_equals_the_original_bitwise(cls, fused, runs, dtype):
    torch.manual_seed(0)
    layer = cls().to(dtype).eval()
    new, result = _patched(layer)
    assert result.fused == fused
    x = torch.randn(2, 5, W).to(dtype)
    assert _same(layer, new, x) == runs


def test_decorators_of_the_original_still_wrap_the_rewritten_forward():
    torch.manual_seed(1)
    layer = Decorated().eval()
    new, _ = _patched(layer)
    assert inspect.unwrap(type(new).forward) is not inspect.unwrap(Decorated.forward)
    x = torch.randn(3, W)
    assert _same(layer, new, x, old_scale=0.5) == 1  # the decorator's renaming ran before the rewritten body
    assert inspect.signature(type(new).forward) == inspect.signature(Decorated.forward)


@pytest.mark.parametrize("norm_before", [True, False])
def test_reshape_and_if_both_branches(norm_before):
    """OPT's pre-norm path fuses norm2 across the shape read and the row-keeping reshape; the post-norm path fuses
    norm1 inside the if: each branch equal to the original, with one fused call."""
    torch.manual_seed(2)
    layer = Reshaped().eval()
    new, result = _patched(layer)
    assert set(result.fused) == {"norm1", "norm2"}
    assert _same(layer, new, torch.randn(2, 3, W), norm_before=norm_before) == 1


@pytest.mark.parametrize("with_encoder", [False, True])
def test_optional_block_between_add_and_norm(with_encoder):
    torch.manual_seed(3)
    layer = CrossBlock().eval()
    new, result = _patched(layer)
    assert set(result.fused) == {"norm1", "norm2"}
    enc = torch.randn(2, 4, W) if with_encoder else None
    assert _same(layer, new, torch.randn(2, 4, W), encoder=enc) == (2 if with_encoder else 1)


def test_gradients_equal_the_original():
    torch.manual_seed(4)
    layer = BranchNorm()
    new, _ = _patched(layer)
    x = torch.randn(3, 4, W, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    cot = torch.randn(3, 4, W)
    layer(x).backward(cot)
    new(x2).backward(cot)
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(layer.named_parameters(), new.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name


def test_operands_of_other_dtypes_or_shapes_run_unfused_as_written():
    """HF's promotion (a bf16 branch onto an fp32 stream) and broadcasting are kept: no fused call then."""
    norm = LayerNorm(W)
    a, b = torch.randn(3, W), torch.randn(3, W).to(torch.bfloat16)
    before = rewrite.fused_runs()
    out, s = rewrite.add_norm(norm, a, b)
    assert s.dtype == torch.float32 and torch.equal(s, a + b) and torch.equal(out, norm(a + b))
    out, s = rewrite.add_norm(norm, torch.randn(3, W), torch.randn(W))
    assert s.shape == (3, W)
    got = rewrite.norm_add(norm, b, a)
    assert torch.equal(got, a + norm(b))
    assert rewrite.fused_runs() == before


def test_norm_add_keeps_each_norm_modules_numerics():
    """norm_add's fused path for the cast-before-weight RMSNorm (Llama's order) and the unfused one for a norm
    that forms its gain itself (Nemotron's weight + 1): both equal ``a + norm(y)`` bitwise in bf16."""
    torch.manual_seed(5)
    y, a = torch.randn(4, W).to(torch.bfloat16), torch.randn(4, W).to(torch.bfloat16)
    for norm in (CastBeforeWeightRMSNorm(W, eps=1e-6), RMSNorm(W, eps=1e-6), OnePlusWeightLayerNorm(W)):
        with torch.no_grad():
            norm.weight.copy_(0.3 * torch.randn(W) + (0.0 if isinstance(norm, OnePlusWeightLayerNorm) else 1.0))
        norm.to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(rewrite.norm_add(norm, y, a), a + norm(y)), type(norm).__name__


class Super(_Base):
    def forward(self, x):
        x = super().forward if False else x  # a zero-argument super() makes the forward a closure
        residual = x
        x = residual + self.attn(x)
        return self.norm2(x)


class Conditional(_Base):
    def forward(self, x, flag=True):
        residual = x
        x = residual + self.attn(x)
        return self.norm2(x) if flag else x


class MovedNameInTest(_Base):
    def forward(self, x):
        residual = x
        x = residual + self.attn(x)
        residual = x
        if residual.sum() > 0:
            x = self.mlp(x)
        return self.norm2(x)


class NoNorm(_Base):
    def forward(self, x):
        return x + self.attn(x)


@pytest.mark.parametrize("cls", [Super, Conditional, MovedNameInTest, NoNorm], ids=lambda c: c.__name__)
def test_what_cannot_be_proven_equivalent_is_left_alone(cls):
    layer = cls()
    assert rewrite.rewrite_forward(cls, rewrite.norm_attributes(layer)) is None


def test_a_norm_that_is_not_addnorms_is_not_fused():
    layer = PreNorm()
    layer.norm2 = nn.LayerNorm(W)
    assert "norm2" not in rewrite.norm_attributes(layer)
    result = rewrite.rewrite_forward(PreNorm, rewrite.norm_attributes(layer))
    # only the add it returns is rewritten (handed to the next layer's input norm once linked); norm2 is not fused
    assert result.fused == () and result.forward._addnorm_handoff
    assert "_addnorm_add_norm(" not in result.source


def test_tracebacks_show_the_rewritten_source():
    layer = PreNorm()
    new, result = _patched(layer)
    assert "_addnorm_add_norm(self.norm2, residual, hidden_states * scale)" in result.source
    try:
        new(torch.randn(2, W + 1))  # the wrong width fails inside the rewritten forward
    except ValueError:
        text = traceback.format_exc()
    assert "<addnorm fused" in text and "hidden_states = self.norm1(hidden_states)" in text


@pytest.mark.parametrize("cls", [PreNorm, BranchNorm], ids=lambda c: c.__name__)
def test_torch_compile_traces_the_rewritten_forward_whole(cls):
    """fullgraph: the helpers (and their fused-call counter) trace without a graph break."""
    torch.manual_seed(6)
    layer = cls().eval()
    new, _ = _patched(layer)
    x = torch.randn(2, 3, W)
    compiled = torch.compile(new, backend="eager", fullgraph=True)
    before = rewrite.fused_runs()
    with torch.no_grad():
        got, want = compiled(x), layer(x)
    assert rewrite.fused_runs() > before
    # traced, addnorm runs its torch backend, whose fp32 sums may differ from the eager kernel's in the last bit
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
