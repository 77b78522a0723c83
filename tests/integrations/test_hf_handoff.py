"""hf/handoff.py: the add a layer returns, fused with the next layer's input norm (or the final norm), which then
returns the output computed in that fused call.

The stacks below are written here in the shapes of transformers' parallel blocks (GPT-NeoX, Phi, Cohere) and
one-mixer blocks (Nemotron-H), no transformers needed; the patched stack must give the unpatched one's output bit for
bit, make one fused call per layer, and fall back to the plain norm whenever the tensor it is given is not, unchanged,
the one the fused call normalized. hf.apply on the real families: test_hf_every_family (driven by the survey).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from addnorm.integrations.hf import handoff, links, rewrite
from addnorm.nn.norms import LayerNorm, RMSNorm
from tests.integrations.stack_helpers import W
from tests.integrations.stack_helpers import randomize as _randomize


class Parallel(nn.Module):
    """GPT-NeoX's parallel layer: two norms of one input, attention and MLP added to it."""

    def __init__(self, norm=LayerNorm):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = norm(W), norm(W)
        self.attention, self.mlp = nn.Linear(W, W), nn.Linear(W, W)
        _randomize(self.input_layernorm)
        _randomize(self.post_attention_layernorm)

    def forward(self, hidden_states, scale=1.0):
        attn_output = self.attention(self.input_layernorm(hidden_states))
        if scale != 0:
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            hidden_states = mlp_output + attn_output + hidden_states
        else:
            hidden_states = attn_output + hidden_states
        return hidden_states


class OneMixer(nn.Module):
    """Nemotron-H's block: one norm (its input cast to the norm's dtype), one mixer, one add."""

    def __init__(self, norm=RMSNorm):
        super().__init__()
        self.norm = norm(W, eps=1e-6)
        self.mixer = nn.Linear(W, W)
        _randomize(self.norm)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
        return residual + self.mixer(hidden_states)


class Stack(nn.Module):
    def __init__(self, layer=Parallel, n=3, **kw):
        super().__init__()
        self.layers = nn.ModuleList(layer(**kw) for _ in range(n))
        self.final_norm = LayerNorm(W)
        _randomize(self.final_norm)

    def forward(self, hidden_states):
        for layer in self.layers[:3]:
            hidden_states = layer(hidden_states)
        hidden_states = self.final_norm(hidden_states)
        return hidden_states


def _patched(model: Stack) -> tuple[Stack, list]:
    """A copy of ``model`` patched as hf.apply patches a transformers model: each layer's class given the rewritten
    forward, then linked."""
    new = copy.deepcopy(model)
    original = {}
    for layer in new.layers:
        cls = type(layer)
        result = rewrite.rewrite_forward(cls, rewrite.norm_attributes(layer))
        assert result is not None and result.forward._addnorm_handoff
        name = f"Fused{cls.__name__}"
        if name not in globals():  # a module-level name, as hf.apply's classes have: the model pickles
            globals()[name] = type(name, (cls,), {"forward": result.forward, "__module__": __name__})
        layer.__class__ = globals()[name]
        original[layer] = cls
    return new, links.link(new, original)


def _runs(fn, *args):
    before = rewrite.fused_runs()
    out = fn(*args)
    return out, rewrite.fused_runs() - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", [Parallel, OneMixer], ids=lambda c: c.__name__)
def test_output_bitwise_equal_with_one_fused_call_per_layer(layer, dtype):
    torch.manual_seed(0)
    model = Stack(layer).to(dtype).eval()
    new, linked = _patched(model)
    # each layer is linked to the next one's input norm, the last to the norm after the loop
    assert [type(norm).__name__ for _, norm, _ in linked] == [
        f"AddNormHandoff{type(n).__name__}"
        for n in (
            *(getattr(lay, "input_layernorm", getattr(lay, "norm", None)) for lay in model.layers[1:]),
            model.final_norm,
        )
    ]
    x = torch.randn(2, 5, W, dtype=dtype)
    with torch.no_grad():
        want = model(x)
        got, runs = _runs(new, x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert runs == 3
    assert all(norm.__dict__.get("_addnorm_ready") is None for _, norm, _ in linked)  # each consumed, none held


def test_the_consumer_returns_the_fused_calls_output():
    """The saving is real: the next norm's own computation is not run when the handoff is taken."""
    torch.manual_seed(1)
    new, linked = _patched(Stack())
    calls = []
    base = LayerNorm.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            LayerNorm,
            "forward",
            lambda self, x, residual=None: calls.append(residual is None) or base(self, x, residual),
        )
        with torch.no_grad():
            new(torch.randn(3, W))
    # per layer: one fused call (residual given) and the post-attention norm; the input norms and the final norm
    # (three plain calls) come from the handoff, only layer 0's input norm is computed plainly
    assert calls.count(False) == 3 and calls.count(True) == 1 + 3


@pytest.mark.parametrize("mode", ["new tensor", "in place", "in place, inference_mode"])
def test_a_hook_changing_the_sum_is_seen(mode):
    """A forward hook on a layer that returns another tensor or changes its output in place: the next norm
    normalizes what it is given (in inference_mode, where tensors have no version counter, a hook turns the handoff
    off)."""
    torch.manual_seed(2)
    model = Stack().eval()
    new, _ = _patched(model)

    def hook(module, args, out):
        if mode == "new tensor":
            return out * 2
        out.mul_(2)

    for m in (model, new):
        m.layers[0].register_forward_hook(hook)
    x = torch.randn(2, W)
    ctx = torch.inference_mode() if "inference" in mode else torch.no_grad()
    with ctx:
        want, (got, runs) = model(x), _runs(new, x)
    assert torch.equal(got, want)
    assert runs == (2 if "inference" in mode else 3)  # inference_mode: layer 0 (hooked) hands nothing off


def test_a_weight_changed_after_the_fused_call_is_seen():
    torch.manual_seed(3)
    new, linked = _patched(Stack())
    layer, norm, _ = linked[0]
    x = torch.randn(2, W)
    with torch.no_grad():
        s = layer(x)  # the layer alone: its handoff waits in the next layer's input norm
        norm.weight.mul_(3)
        want = LayerNorm.forward(norm, s)
        assert torch.equal(norm(s), want)
        assert not torch.equal(norm(layer(x)), LayerNorm.forward(norm, torch.zeros_like(s)))  # it still hands off


def test_gradients_equal_the_original():
    torch.manual_seed(4)
    model = Stack().train()
    new, _ = _patched(model)
    x = torch.randn(2, 3, W)
    grads = []
    for m in (model, new):
        xi = x.clone().requires_grad_()
        m.zero_grad()
        (m(xi) * torch.linspace(-1, 1, W)).sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_no_handoff_with_gradient_checkpointing_or_under_compile():
    torch.manual_seed(5)
    model = Stack().train()
    new, _ = _patched(model)
    x = torch.randn(2, W)
    for layer in new.layers:
        layer.gradient_checkpointing = True  # what transformers' gradient_checkpointing_enable sets
    _, runs = _runs(new, x)
    assert runs == 0
    with torch.no_grad():
        _, runs = _runs(new, x)  # no recomputation without grad: the handoff is made
    assert runs == 3
    new.eval()
    compiled = torch.compile(new, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_waiting_handoff_copies_and_pickles_and_unlink_restores():
    torch.manual_seed(6)
    model = Stack()
    new, linked = _patched(model)
    x = torch.randn(2, W)
    with torch.no_grad():
        new.layers[0](x)  # leaves a handoff (a weakref) waiting in layer 1's input norm
        for clone in (copy.deepcopy(new), pickle.loads(pickle.dumps(new))):
            assert torch.equal(clone(x), model(x))
    links.unlink(linked)
    assert type(new.layers[1].input_layernorm) is LayerNorm and "_addnorm_next" not in new.layers[0].__dict__
    with torch.no_grad():
        _, runs = _runs(new, x)
    assert runs == 0


def test_input_and_final_norm_read_from_the_source():
    assert links.input_norm(Parallel, {"input_layernorm", "post_attention_layernorm"}) == "input_layernorm"
    assert links.input_norm(OneMixer, {"norm"}) == "norm"  # through .to(dtype=...)
    assert links.final_norm(Stack, "layers", {"final_norm"}) == "final_norm"
    assert links.final_norm(Stack, "other", {"final_norm"}) is None

    class Rebound(nn.Module):
        def forward(self, x):
            x = x * 2  # the norm below reads another tensor than the layer's input
            return self.norm(x)

    assert links.input_norm(Rebound, {"norm"}) is None


def test_operands_of_other_dtypes_add_unfused():
    torch.manual_seed(7)
    new, linked = _patched(Stack(OneMixer))
    layer = new.layers[0]
    a, b = torch.randn(2, W), torch.randn(2, W, dtype=torch.float64)
    out, runs = _runs(handoff.add_handoff, layer, a, b)
    assert runs == 0 and out.dtype == torch.float64 and torch.equal(out, a + b)


# ---- hf.apply on a parallel family of the installed transformers -------------------------------------------------


@pytest.fixture
def phi():
    pytest.importorskip("transformers")
    from addnorm.integrations import hf
    from addnorm.integrations.hf.norm_probe import randomize_norms

    model = hf.tiny_model("phi", num_hidden_layers=3)
    randomize_norms(model)
    return model


def test_phi_links_each_layer_and_the_final_norm_and_reverts(phi):
    from addnorm.integrations import hf

    ids = torch.randint(0, phi.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = phi(ids).logits
    ref_tokens = phi.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.apply(phi)
    consumers = [type(layer.input_layernorm).__name__ for layer in phi.model.layers[1:]]
    assert consumers == ["AddNormHandoffLayerNorm"] * 2
    assert type(phi.model.final_layernorm).__name__ == "AddNormHandoffLayerNorm"
    with torch.no_grad():
        got, runs = _runs(lambda: phi(ids).logits)
    assert runs == 3 and (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    tokens = phi.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)
    for clone in (copy.deepcopy(phi), pickle.loads(pickle.dumps(phi))):
        with torch.no_grad():
            assert torch.equal(clone(ids).logits, got)
    hf.revert(phi)
    assert not any(type(m).__name__.startswith("AddNorm") for m in phi.modules())
    assert not any("_addnorm_next" in m.__dict__ for m in phi.modules())


def test_phi_gradient_checkpointing_trains_as_unpatched(phi):
    from addnorm.integrations import hf

    ids = torch.randint(0, phi.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    grads = []
    for patched in (False, True):
        model = copy.deepcopy(phi)
        if patched:
            hf.apply(model)
        model.activation_checkpointing_enable()  # sets gradient_checkpointing on each layer
        model.train()
        model.config.use_cache = False
        torch.manual_seed(0)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_handoff_raises_nothing_under_inference_mode():
    """Reading ._version of an inference tensor raises a c10::Error whose backtrace costs 10-40 us; the handoff's
    state check once caught it on every call, and under inference_mode (how generate() and servers decode) that
    made a fused Llama decode step ~5% slower than the unpatched one. No exception may be raised, caught or not, in
    the handoff's code while a patched model runs (traced with sys.settrace's exception events)."""
    import sys

    pytest.importorskip("transformers")
    from addnorm.integrations import hf

    model = hf.apply(hf.tiny_model("llama").eval())
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    raised: list[str] = []

    def tracer(frame, event, arg):
        if event == "exception" and frame.f_code.co_filename == handoff.__file__:
            raised.append(f"{frame.f_code.co_name}: {arg[0].__name__}")
        return tracer

    before = handoff.fused_runs()
    with torch.inference_mode():
        sys.settrace(tracer)
        try:
            model(ids)
        finally:
            sys.settrace(None)
    assert handoff.fused_runs() > before  # the handoff ran (the template layers hand their last add off)
    assert raised == []
