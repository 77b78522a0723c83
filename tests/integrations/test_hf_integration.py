"""addnorm.integrations.hf against the unpatched transformers models: logits, gradients, generation, revert, fusion.

Every model is a tiny random one built from a config (nothing is downloaded). Norm weights and biases are
randomised before each comparison, since HF initialises them to constants (ones, or zeros for Gemma), which would
hide a weight applied in the wrong place or order.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import addnorm.ops.add_norm as add_norm_ops  # noqa: E402
from addnorm.integrations import hf  # noqa: E402
from addnorm.integrations.hf import chain, norm_probe, norms, patch  # noqa: E402
from addnorm.nn import LayerNorm, RMSNorm  # noqa: E402

FAMILIES = hf.FAMILIES
DECODERS = [f for f in FAMILIES if f != "bert"]
LAYERS = 2  # tiny_config's num_hidden_layers
# fused residual-add + norm calls per forward, two per layer: a decoder layer fuses its attention add with its
# post-attention norm and hands its MLP add to the next layer's input norm (the last one's to the final norm,
# hf/handoff.py); BERT fuses both post-norms of each layer
FUSED_PER_FORWARD = {f: 2 * LAYERS for f in FAMILIES}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads; on a shared machine extra threads only wait for each other."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_randomize_norms = norm_probe.randomize_norms


def _model(family: str, dtype=torch.float32) -> nn.Module:
    model = hf.tiny_model(family)
    _randomize_norms(model)
    return model.to(dtype)


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(2))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _assert_rel(actual, expected, rel, what, *, floor=1e-30):
    """Max abs difference within ``rel`` times the expected tensor's scale (its largest magnitude, at least
    ``floor``)."""
    scale = max(expected.abs().max().item(), floor)
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * scale, f"{what}: max abs err {err:.3g} > {rel} * scale {scale:.3g}"


def _assert_grads(got, ref, what):
    """Each gradient within 1e-5 of its own scale. A gradient that is zero in exact arithmetic (BERT's key bias:
    softmax ignores a shift shared by all keys) holds only rounding noise, ~1e-12 either way, which another order of
    summation changes completely; so the scale is floored at 1e-4 of the model's largest gradient."""
    assert got.keys() == ref.keys()
    floor = 1e-4 * max(g.abs().max().item() for g in ref.values())
    for name in ref:
        _assert_rel(got[name], ref[name], 1e-5, f"{what} grad {name}", floor=floor)


def _snapshot(model):
    return {name: type(m) for name, m in model.named_modules()}


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_and_norms_are_swapped(family):
    model = _model(family)
    ids = _ids()
    ref = _logits(model, ids)
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert hf.apply(model) is model
    # every HF norm is now an addnorm module, holding the very same Parameter objects under the same keys
    left = [
        n
        for n, m in model.named_modules()
        if type(m) is nn.LayerNorm
        or type(m).__name__.endswith("RMSNorm")
        and type(m).__module__.startswith("transformers.")
    ]
    assert left == []
    assert any(isinstance(m, (LayerNorm, RMSNorm)) for m in model.modules())
    assert all(p is params[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    _assert_rel(_logits(model, ids), ref, 1e-5, f"{family} fp32 logits")


LAYER_NORM_FAMILIES = ("gpt2", "bert")


def _bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |got - ref| in bf16 ulps of ref's largest magnitude (the spacing of bf16 numbers there)."""
    top = ref.abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 2.0**-133
    return (got.double() - ref.double()).abs().max().item() / ulp


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_match(family, backend, monkeypatch):
    """What the README claims for bf16: bitwise for the RMSNorm families with the torch backend; GPT-2 and BERT
    (LayerNorm, whose fp32 statistics addnorm sums in another order than torch's kernel) within one bf16 ulp of the
    logits' largest magnitude; with the numba cpu backend every family within two. The seeds include inputs where
    the LayerNorm families do differ (seeds 0 and 11 for GPT-2 at this batch; 0, 10 and 11 for BERT)."""
    monkeypatch.setenv("ADDNORM_BACKEND", backend)
    for seed in (0, 10, 11):  # the norms' weights and the ids (tiny_model's own init is seed 0)
        model = hf.tiny_model(family)
        _randomize_norms(model, seed)
        model = model.to(torch.bfloat16)
        ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(seed))
        ref = _logits(model, ids)
        hf.apply(model)
        got = _logits(model, ids)
        if backend == "torch" and family not in LAYER_NORM_FAMILIES:
            assert torch.equal(got, ref), f"{family} seed {seed}: {_bf16_ulps(got, ref):.3g} ulps"
        else:
            limit = 1.0 if backend == "torch" else 2.0
            assert _bf16_ulps(got, ref) <= limit, f"{family} seed {seed} ({backend})"


def _grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # train mode: dropout draws the same numbers in both runs
    out = model(ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_gradients_match(family):
    model = _model(family).train()
    ids = _ids()
    loss_ref, ref = _grads(model, ids, ids)
    hf.apply(model)
    loss, got = _grads(model, ids, ids)
    _assert_rel(loss, loss_ref, 1e-5, f"{family} loss")
    _assert_grads(got, ref, family)


def test_gradients_through_a_kernel_backend(monkeypatch):
    """The same check with a kernel backend behind the custom ops (here the reference one, available everywhere)."""
    monkeypatch.setenv("ADDNORM_BACKEND", "reference")
    model = _model("llama").train()
    ids = _ids(seq=8)
    _, ref = _grads(model, ids, ids)
    hf.apply(model)
    _, got = _grads(model, ids, ids)
    _assert_grads(got, ref, "llama/reference")


def test_gradient_checkpointing_still_works():
    model = _model("llama").train()
    # transformers 5 renamed gradient_checkpointing_enable; either turns on the wrapper the fused class must keep
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids = _ids(seq=8)
    _, ref = _grads(model, ids, ids)
    hf.apply(model)
    calls = []
    model.model.layers[0]._gradient_checkpointing_func = lambda fn, *a, **k: calls.append(1) or fn(*a, **k)
    _, got = _grads(model, ids, ids)
    assert calls, "the fused layer class lost transformers' gradient checkpointing wrapper"
    _assert_grads(got, ref, "llama/checkpointed")


@pytest.mark.parametrize("family", DECODERS)
def test_generate_gives_the_same_tokens(family):
    model = _model(family)
    ids = _ids(batch=1, seq=6)
    kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        hf.apply(model)
        got = model.generate(ids, **kw)
    assert ref.shape[1] == ids.shape[1] + 5
    assert torch.equal(got, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_revert_restores_classes_parameters_and_outputs(family):
    model = _model(family)
    ids = _ids()
    ref = _logits(model, ids)
    classes = _snapshot(model)
    params = {name: p for name, p in model.named_parameters()}
    hf.apply(model)
    assert _snapshot(model) != classes
    assert hf.revert(model) is model
    assert _snapshot(model) == classes
    assert all(p is params[name] for name, p in model.named_parameters())
    assert torch.equal(_logits(model, ids), ref)
    assert not hf.is_applied(model)
    hf.apply(model)  # and it can be applied again
    _assert_rel(_logits(model, ids), ref, 1e-5, f"{family} re-applied")


def _count_fused_calls(monkeypatch) -> list[int]:
    """Counts calls of addnorm's add + norm that come with a residual (every public add + norm function goes through
    addnorm.ops.add_norm.run_add_norm), and of addnorm.norm_add / addnorm.norm_add_norm made by hf/chain.py (the
    sandwich's post-norm, add and next norm: one call, whatever the op runs inside)."""
    calls, inside = [0], [0]
    real = add_norm_ops.run_add_norm

    def counting(x, residual, *args):
        calls[0] += residual is not None and not inside[0]
        return real(x, residual, *args)

    def counting_op(op):
        def run(*args, **kwargs):
            calls[0] += 1
            inside[0] += 1
            try:
                return op(*args, **kwargs)
            finally:
                inside[0] -= 1

        return run

    monkeypatch.setattr(add_norm_ops, "run_add_norm", counting)
    for name in ("_norm_add_op", "_norm_add_norm_op"):
        monkeypatch.setattr(chain, name, counting_op(getattr(chain, name)))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_fuse_residual_runs_the_fused_op(family, monkeypatch):
    calls = _count_fused_calls(monkeypatch)
    ids = _ids()
    model = hf.apply(_model(family), fuse_residual=True)
    _logits(model, ids)
    assert calls[0] == FUSED_PER_FORWARD[family]
    calls[0] = 0
    unfused = hf.apply(_model(family), fuse_residual=False)
    ref = _logits(unfused, ids)
    assert calls[0] == 0
    assert not any(type(m).__name__.startswith("AddNormFused") for m in unfused.modules())
    _assert_rel(_logits(model, ids), ref, 1e-5, f"{family} fused vs unfused")


def test_gpt2_cross_attention_fuses_both_norms(monkeypatch):
    model = hf.tiny_model("gpt2", add_cross_attention=True)
    _randomize_norms(model)
    ids, enc = _ids(), torch.randn(2, 5, 64)
    with torch.no_grad():
        ref = model(ids, encoder_hidden_states=enc).logits
        hf.apply(model)
        calls = _count_fused_calls(monkeypatch)
        got = model(ids, encoder_hidden_states=enc).logits
    assert calls[0] == 3 * LAYERS  # ln_cross_attn and ln_2 of every block, its last add with the next ln_1 / ln_f
    _assert_rel(got, ref, 1e-5, "gpt2 cross-attention logits")


def test_layers_that_match_no_structure_are_left_alone(monkeypatch):
    """apply fuses only layers whose forward matches a template; with none matching (as with a transformers version
    that rewrote its layers, and no add next to a norm that hf/rewrite.py can rewrite) the layers keep HF's forward,
    with a warning, and the model computes what it did."""
    from addnorm.integrations.hf import layer_match, rewrite

    monkeypatch.setattr(layer_match, "_TEMPLATE_CANON", {})
    monkeypatch.setattr(layer_match, "_CACHE", {})
    monkeypatch.setattr(rewrite, "rewrite_forward", lambda cls, norms: None)
    model = _model("llama")
    ids = _ids()
    ref = _logits(model, ids)
    with pytest.warns(UserWarning, match="no layer of LlamaForCausalLM matches a structure addnorm fuses"):
        hf.apply(model)
    assert not any(type(m).__name__.startswith("AddNormFused") for m in model.modules())
    assert isinstance(model.model.norm, hf.CastBeforeWeightRMSNorm)  # the norms are still swapped
    _assert_rel(_logits(model, ids), ref, 1e-5, "unfused llama")


def test_without_templates_the_rewritten_forward_fuses_llama(monkeypatch):
    """hf/rewrite.py alone (the templates switched off) fuses Llama's layer from its own source: the same logits bit
    for bit in fp32, two fused calls per layer (the attention add with post_attention_layernorm; the add it returns
    with the next layer's input_layernorm, or the final norm: hf/handoff.py), generate() the same tokens."""
    from addnorm.integrations.hf import layer_match, rewrite

    monkeypatch.setattr(layer_match, "_TEMPLATE_CANON", {})
    monkeypatch.setattr(layer_match, "_CACHE", {})
    monkeypatch.setattr(patch, "_FUSED_CLASSES", {})  # a class fused by a template earlier in the session
    # and the name the fused class is pickled under, given back to the template's class afterwards
    monkeypatch.setattr(patch, "AddNormFusedLlamaDecoderLayer", None, raising=False)
    # bit for bit is the torch backend's property (HF's own ops); auto runs the numba cpu backend on CPU tensors of
    # every size (batch invariance), whose fp32 sums take another order
    monkeypatch.setenv("ADDNORM_BACKEND", "torch")
    model = _model("llama")
    ids = _ids()
    ref = _logits(model, ids)
    ref_tokens = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.apply(model)
    layer = model.model.layers[0]
    assert rewrite.is_rewritten(type(layer)) and type(layer)._addnorm_roles == {
        "post_attention_layernorm": "post_attention_layernorm"
    }
    before = rewrite.fused_runs()
    got = _logits(model, ids)
    assert rewrite.fused_runs() - before == 2 * LAYERS
    assert torch.equal(got, ref)
    tokens = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)
    hf.revert(model)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_norms_addnorm_does_not_reproduce_are_left_alone(monkeypatch):
    """A norm whose numerics no addnorm module reproduces (here: every norm, as the probe is told) stays HF's; a
    model with no reproducible norm at all is refused with a clear error, and left untouched."""
    from addnorm.integrations.hf import norm_probe

    real = norm_probe.probe
    monkeypatch.setattr(norm_probe, "probe", lambda m: None if type(m).__name__ == "LlamaRMSNorm" else real(m))
    model = _model("llama")
    with pytest.raises(ValueError, match="no norm module that addnorm reproduces"):
        hf.apply(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and not hf.is_applied(model)
    # a GPT-2 with one LayerNorm class made unreproducible: the rest is patched; ln_2 stays HF's, so no fusion there
    gpt2 = _model("gpt2")
    ids = _ids()
    ref = _logits(gpt2, ids)
    monkeypatch.setattr(norm_probe, "probe", lambda m: None if m is gpt2.transformer.h[0].ln_2 else real(m))
    hf.apply(gpt2)
    assert type(gpt2.transformer.h[0].ln_2) is nn.LayerNorm
    assert type(gpt2.transformer.h[0]).__name__ == "GPT2Block"  # not fused: its ln_2 is not an addnorm norm
    assert type(gpt2.transformer.h[1]).__name__ == "AddNormFusedGPT2Block"
    _assert_rel(_logits(gpt2, ids), ref, 1e-5, "partly patched gpt2")


def test_from_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    for family in ("llama", "gemma2"):
        model = _model(family)
        model.save_pretrained(tmp_path / family)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
        ids = _ids()
        ref = _logits(model, ids)
        hf.apply(loaded)
        _assert_rel(_logits(loaded, ids), ref, 1e-5, f"{family} from_pretrained")
        # and a patched model saves what loads into an unpatched one
        loaded.save_pretrained(tmp_path / f"{family}-patched")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-patched").eval()
        assert torch.equal(_logits(again, ids), ref)
        assert not hf.is_applied(again)  # the patch is not saved: apply again after loading (apply's docstring)


def test_patched_model_deepcopies_and_pickles():
    model = hf.apply(_model("llama"))
    ids = _ids()
    ref = _logits(model, ids)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(_logits(clone, ids), ref)
        hf.revert(clone)  # the copy carries its own record of what to undo
        assert not any(type(m).__module__ == patch.__name__ for m in clone.modules())
        _assert_rel(_logits(clone, ids), ref, 1e-5, "reverted copy")


def test_torch_compile_traces_the_patched_model_without_graph_breaks():
    model = hf.apply(_model("llama"))
    ids = _ids(seq=8)
    ref = _logits(model, ids)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    _assert_rel(_logits(compiled, ids), ref, 1e-6, "compiled")


def test_past_key_values_keyword_still_reaches_attention():
    """transformers renames the deprecated past_key_values= to cache= on the original forward; the fused one too."""
    transformers = pytest.importorskip("transformers")
    model = hf.apply(_model("llama"))
    layer = model.model.layers[0]
    seen = {}
    real = layer.self_attn.forward
    layer.self_attn.forward = lambda *a, **k: seen.update(k) or real(*a, **k)
    cache = transformers.DynamicCache(config=model.config)
    x = torch.randn(1, 3, 64)
    pos = model.model.rotary_emb(x, torch.arange(3)[None])
    layer(x, past_key_values=cache, position_embeddings=pos, attention_mask=None)
    assert seen.get("cache") is cache
    # positional arguments bind to the original forward's parameters, in its order
    other = transformers.DynamicCache(config=model.config)
    layer(x, None, None, other, False, pos)
    assert seen["cache"] is other and seen["attention_mask"] is None
    with pytest.raises(TypeError, match="positional arguments"):
        layer(x, None, None, None, False, pos, "one too many")
    with pytest.raises(TypeError, match="multiple values for argument 'attention_mask'"):
        layer(x, None, attention_mask=None, position_embeddings=pos)


def test_cast_before_weight_matches_llama_rmsnorm_in_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    old = LlamaRMSNorm(96, eps=1e-6).bfloat16()
    with torch.no_grad():
        old.weight.copy_(1 + 0.5 * torch.randn(96))
    new = norms.cast_before_weight_norm(old)
    assert new.weight is old.weight and new.variance_epsilon == new.eps == 1e-6
    x, r = (torch.randn(64, 96) * 3).bfloat16(), torch.randn(64, 96).bfloat16()
    for got, want in ((new(x), old(x)), (new(x, r)[0], old(x + r))):
        # Llama's two roundings reproduced: equal up to the rare element where an fp32 rsqrt differs in its last bit
        # (addnorm's fused contract, one rounding after the weight, differs in about a quarter of the elements)
        assert (got != want).float().mean().item() < 0.01
        _assert_rel(got, want, 2**-7, "cast-before-weight")
    assert torch.equal(new(x, r)[1], x + r)


def test_cast_before_weight_norm_is_one_fused_call_and_keeps_hfs_dtype_promotion(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    calls = []
    real = add_norm_ops.run_add_norm  # (x, residual, weight, bias, eps, is_rms, p, residual_dtype, zc, cbw, ...)
    monkeypatch.setattr(add_norm_ops, "run_add_norm", lambda *a: calls.append((a[2], a[9])) or real(*a))
    old = LlamaRMSNorm(32, eps=1e-6).bfloat16()
    new = norms.cast_before_weight_norm(old)
    x, r = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    new(x, r)
    ((weight, cast_before_weight),) = calls
    assert weight is not None and cast_before_weight  # the weight is applied inside the fused op
    # an fp32 weight with bf16 activations: HF's output is fp32 (type promotion), and so is addnorm's
    old32 = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        old32.weight.copy_(1 + 0.5 * torch.randn(32))
    got, want = norms.cast_before_weight_norm(old32)(x), old32(x)
    assert got.dtype == want.dtype == torch.float32
    assert (got != want).float().mean().item() < 0.01


def test_gemma_norm_is_zero_centered_with_eps_from_hf():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    old = GemmaRMSNorm(32, eps=1e-3)
    with torch.no_grad():
        old.weight.normal_()
    new = norms.zero_centered_norm(old)
    assert new.eps == 1e-3 and new.zero_centered_weight and new.weight is old.weight
    x = torch.randn(5, 32)
    _assert_rel(new(x), old(x), 1e-5, "gemma norm")


def test_bad_input():
    model = _model("llama")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        hf.apply("llama")
    with pytest.raises(TypeError, match="fuse_residual must be a bool"):
        hf.apply(model, fuse_residual="yes")
    with pytest.raises(ValueError, match="Linear has no norm module that addnorm reproduces"):
        hf.apply(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not patched"):
        hf.revert(model)
    hf.apply(model)
    with pytest.raises(ValueError, match="already applied"):
        hf.apply(model, fuse_residual=False)  # not a silent no-op: the second call asks for something else
    hf.revert(model)
    with pytest.raises(ValueError, match="not patched"):
        hf.revert(model)  # reverting twice
    with pytest.raises(ValueError, match="family must be a model_type of the installed transformers"):
        hf.tiny_config("no-such-family")


def test_tiny_config_overrides():
    assert hf.tiny_config("llama", num_hidden_layers=3).num_hidden_layers == 3
    assert hf.tiny_config("gpt2").n_layer == LAYERS


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'addnorm\[hf\]'"):
        hf.tiny_config("llama")
    with pytest.raises(ImportError, match=r"pip install 'addnorm\[hf\]'"):
        hf.apply(nn.Linear(2, 2))


# Every family the survey fuses (docs/survey.json) is checked in tests/integrations/test_hf_every_family.py.


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("family", ["llama", "gemma", "bert"])
def test_apply_to_a_model_already_on_the_gpu(family):
    """hf.apply recognizes the norms of a model that lives on a GPU (the probe runs a CPU copy of each norm) and the
    patched model, on the Triton backend, gives the unpatched logits (fp32, within the kernels' 1e-5)."""
    model = _model(family).cuda()
    ids = _ids().cuda()
    with torch.no_grad():
        ref = model(ids).logits
        hf.apply(model)
        assert hf.apply_status(model) == "fused", family
        assert all(p.is_cuda for p in model.parameters())
        got = model(ids).logits
    _assert_rel(got, ref, 1e-5, f"{family} logits on the GPU")


def test_keyword_only_binding_fast_path_binds_and_refuses_like_the_general_one():
    """generate() calls a layer with keywords only: the one-merge path of _bound_arguments gives the general path's
    dict, and an unknown or a missing argument still raises its TypeError."""
    from addnorm.integrations.hf import forwards

    def forward(self, hidden_states, mask, position=None, cache=None):
        return hidden_states

    layer = type("Layer", (), {"_addnorm_signature": forwards.Signature.of(forward)})()
    bound = forwards._bound_arguments(layer, None, (), {"mask": 1, "cache": 2})
    assert bound == {"mask": 1, "position": None, "cache": 2}
    assert forwards._bound_arguments(layer, None, (1,), {"cache": 2}) == bound  # the general path
    # the old keyword is renamed as transformers' deprecate_kwarg does
    assert forwards._bound_arguments(layer, None, (), {"mask": 1, "past_key_values": 2}) == bound
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        forwards._bound_arguments(layer, None, (), {"mask": 1, "bogus": 3})
    with pytest.raises(TypeError, match="missing required arguments: mask"):
        forwards._bound_arguments(layer, None, (), {"cache": 2})
