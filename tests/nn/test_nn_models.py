"""Layers, models, config and presets: shapes, fusion, causality, masks, init scalings, validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from addnorm.nn import (
    PRESETS,
    EncoderLayer,
    MultiHeadAttention,
    ParallelBlock,
    TransformerConfig,
    TransformerEncoder,
    TransformerEncoderDecoder,
    TransformerLM,
    deepnorm_coefficients,
)

TINY = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=2, max_seq_len=16)


def _ids(b=2, t=10, v=50):
    return torch.randint(0, v, (b, t))


def _finite_grads(model):
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return all(g is not None and torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_runs_and_backprops(name):
    cfg = TransformerConfig.preset(name, **TINY)
    model = TransformerLM(cfg)
    logits = model(_ids())
    assert logits.shape == (2, 10, 50)
    F.cross_entropy(logits.flatten(0, 1), _ids().flatten()).backward()
    assert _finite_grads(model)


def test_preset_shapes_follow_the_families():
    """Seed 000 section 6: norm kind, placement, block shape per family."""
    expect = {
        "original": ("layernorm", "post", False),
        "bert": ("layernorm", "post", False),
        "gpt2": ("layernorm", "pre", False),
        "gpt3": ("layernorm", "pre", False),
        "palm": ("layernorm", "pre", True),
        "llama": ("rmsnorm", "pre", False),
        "mistral": ("rmsnorm", "pre", False),
        "qwen": ("rmsnorm", "pre", False),
        "deepseek": ("rmsnorm", "pre", False),
        "gemma": ("rmsnorm", "pre", False),
        "deepnet": ("layernorm", "deepnorm", False),
    }
    assert set(expect) == set(PRESETS)
    for name, (norm, placement, parallel) in expect.items():
        c = TransformerConfig.preset(name)
        assert (c.norm, c.placement, c.parallel) == (norm, placement, parallel), name
        assert c.use_final_norm == (placement == "pre"), name
    for name in ("llama", "mistral", "qwen", "deepseek"):
        assert TransformerConfig.preset(name).ffn == "swiglu"
    assert TransformerConfig.preset("gemma").zero_centered_weight
    lm = TransformerLM(TransformerConfig.preset("gemma", **TINY))
    assert lm.blocks[0].attn.norm.zero_centered_weight and torch.all(lm.blocks[0].attn.norm.weight == 0)
    assert isinstance(TransformerLM(TransformerConfig.preset("palm", **TINY)).blocks[0], ParallelBlock)
    assert TransformerLM(TransformerConfig.preset("bert", **TINY)).final_norm is None


def test_preset_overrides_and_errors():
    c = TransformerConfig.preset("llama", d_model=48, n_heads=6, n_layers=3)
    assert (c.d_model, c.n_heads, c.n_layers, c.norm) == (48, 6, 3, "rmsnorm")
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        TransformerConfig.preset("gpt5")
    with pytest.raises(ValueError, match="unknown TransformerConfig field"):
        TransformerConfig.preset("gpt2", width=3)


# where each preset's eps comes from: a transformers configuration class's default, or (None) torch.nn.LayerNorm's
PRESET_EPS_SOURCES = {
    "original": None,
    "bert": ("BertConfig", "layer_norm_eps"),
    "gpt2": ("GPT2Config", "layer_norm_epsilon"),
    "gpt3": ("GPT2Config", "layer_norm_epsilon"),  # built as GPT-2; transformers has no GPT-3 class
    "palm": None,
    "llama": ("LlamaConfig", "rms_norm_eps"),
    "mistral": ("MistralConfig", "rms_norm_eps"),
    "qwen": ("Qwen2Config", "rms_norm_eps"),
    "deepseek": ("DeepseekV3Config", "rms_norm_eps"),
    "gemma": ("GemmaConfig", "rms_norm_eps"),
    "deepnet": None,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_eps_is_its_sources_value(name):
    assert set(PRESET_EPS_SOURCES) == set(PRESETS)
    eps = TransformerConfig.preset(name).eps
    source = PRESET_EPS_SOURCES[name]
    if source is None:
        assert eps == torch.nn.LayerNorm(4).eps
        return
    transformers = pytest.importorskip("transformers")
    cls, attr = source
    assert eps == getattr(getattr(transformers, cls)(), attr)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_model_in_bf16_stays_close_to_fp32(name):
    # with eps=None an RMSNorm's eps is the dtype's epsilon, 7.8e-3 in bf16 against a stream whose mean square is
    # ~4e-4 at init: the llama preset's bf16 logits were off by ~80% of their scale (gemma's by ~20%)
    # backend "torch": the eps is the config's, whatever the backend; this avoids compiling bf16 kernels
    kw = dict(n_layers=2, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16, backend="torch")
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig.preset(name, **kw)).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        out = model.to(torch.bfloat16)(ids).float()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 rounding alone: < 1% here


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(d_model=30, n_heads=4), r"d_model \(30\) must be divisible by n_heads \(4\)"),
        (dict(norm="groupnorm"), "norm must be one of layernorm, rmsnorm"),
        (dict(placement="middle"), "placement must be one of .*mix"),
        (dict(ffn="tanh"), "ffn must be one of relu, gelu, swiglu"),
        (dict(positional="alibi"), "positional must be one of"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(dropout=1.5), "dropout must be in"),
        (dict(mix_ln_fraction=2.0), "mix_ln_fraction"),
        (dict(norm="dyt", zero_centered_weight=True), "zero_centered_weight needs norm"),
        (dict(parallel=True, placement="post"), "parallel blocks"),
        (dict(deepnorm_alpha=-1.0), "deepnorm_alpha must be"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_configs_raise_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**TINY, **overrides})


BOOL_FIELDS = [
    "final_norm",
    "parallel",
    "qk_norm",
    "zero_centered_weight",
    "tie_embeddings",
    "bias",
    "residual_init_scaling",
    "layernorm_scaling",
    "embed_norm",
    "embed_scale",
    "fuse_add_norm",
    "record_logits",
]


def test_bool_fields_are_all_listed():
    # a bool field added later is checked by __post_init__ (from its annotation); list it here too
    import dataclasses

    annotated = [f.name for f in dataclasses.fields(TransformerConfig) if f.type in ("bool", "bool | None")]
    assert annotated == BOOL_FIELDS


@pytest.mark.parametrize("value", ["no", "yes", 0, 1, None])
@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_bool_fields_refuse_non_bools(name, value):
    if value is None and name == "final_norm":  # None: on or off by placement
        assert TransformerConfig(**TINY, final_norm=None).use_final_norm
        return
    # "no" is truthy: accepted, it would turn the option on (final_norm="no" built a final LayerNorm)
    with pytest.raises(TypeError, match=rf"^{name} must be True or False.*, got {value!r}$"):
        TransformerConfig(**{**TINY, name: value})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(placement="mix", mix_ln_fraction=True), r"mix_ln_fraction must be in \[0, 1\], got True"),
        (dict(dropout=False), r"dropout must be in \[0, 1\), got False"),
        (dict(init_std=True), "init_std must be a finite number > 0, got True"),
        (dict(eps=False), "eps must be a finite number >= 0 or None, got False"),
        (dict(placement="deepnorm", deepnorm_alpha=True), "deepnorm_alpha must be a finite number > 0"),
        (dict(init_std=math.inf), "init_std must be a finite number > 0, got inf"),
        (dict(init_std=math.nan), "init_std must be a finite number > 0, got nan"),
        (dict(eps=math.inf), "eps must be a finite number >= 0 or None, got inf"),
        (dict(eps=math.nan), "eps must be a finite number >= 0 or None, got nan"),
    ],
)
def test_numeric_fields_refuse_bools_and_non_finite_values(overrides, match):
    # init_std=inf gave NaN logits; eps=inf passed here and failed later in make_norm
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**TINY, **overrides})


def test_d_ff_defaults():
    assert TransformerConfig(d_model=64).ffn_dim == 256
    assert TransformerConfig(d_model=64, ffn="swiglu").ffn_dim == 176  # 8/3 * 64 = 170.7, up to a multiple of 8
    assert TransformerConfig(d_model=64, d_ff=100).ffn_dim == 100


def test_mix_ln_puts_post_ln_first():
    cfg = TransformerConfig(**{**TINY, "n_layers": 4}, placement="mix", mix_ln_fraction=0.25)
    lm = TransformerLM(cfg)
    assert [b.placement for b in lm.blocks] == ["post", "pre", "pre", "pre"]
    assert lm.final_norm is not None
    lm(_ids()).sum().backward()
    assert _finite_grads(lm)


# ---------------------------------------------------------------------------------------------------- fusion


def _unfused_pre_layer(layer, x):
    """The textbook pre-norm layer, written out: two separate norm calls, two separate adds."""
    a, f = layer.attn, layer.ffn
    x = x + a.sublayer(a.norm(x))
    return x + f.sublayer(f.norm(x))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_pre_norm_layer_equals_the_unfused_code(norm, dtype):
    cfg = TransformerConfig(**TINY, norm=norm, placement="pre")
    layer = EncoderLayer(cfg, causal=True).to(dtype)
    x = torch.randn(2, 10, 32, dtype=dtype)
    fused, unfused = layer(x), _unfused_pre_layer(layer, x)
    if dtype == torch.float64:
        assert torch.equal(fused, unfused)
    else:
        torch.testing.assert_close(fused, unfused)


def test_fused_pre_norm_runs_one_add_norm_call_between_sublayers():
    layer = EncoderLayer(TransformerConfig(**TINY, placement="pre"))
    arity = []
    layer.ffn.norm.register_forward_hook(lambda m, args, out: arity.append(len(args)))
    layer(torch.randn(2, 5, 32))
    assert arity == [2]  # the FFN's norm received (attn_out, x): add and norm in one call


@pytest.mark.parametrize("placement", ["pre", "sandwich", "mix", "post", "none"])
def test_fused_and_unfused_models_agree(placement):
    kw = dict(**{**TINY, "n_layers": 4}, placement=placement)
    fused = TransformerLM(TransformerConfig(**kw, fuse_add_norm=True)).double()
    unfused = TransformerLM(TransformerConfig(**kw, fuse_add_norm=False)).double()
    unfused.load_state_dict(fused.state_dict())
    ids = _ids()
    assert torch.equal(fused(ids), unfused(ids))


def test_fused_decoder_layer_matches_unfused():
    kw = dict(**TINY, placement="pre")
    fused = TransformerEncoderDecoder(TransformerConfig(**kw)).double()
    unfused = TransformerEncoderDecoder(TransformerConfig(**kw, fuse_add_norm=False)).double()
    unfused.load_state_dict(fused.state_dict())
    src, tgt = _ids(t=7), _ids(t=5)
    assert torch.equal(fused(src, tgt), unfused(src, tgt))


# ---------------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("preset, record", [("gpt2", False), ("llama", False), ("palm", False), ("gpt2", True)])
def test_causal_lm_never_looks_ahead(preset, record):
    lm = TransformerLM(TransformerConfig.preset(preset, **TINY, record_logits=record)).eval()
    ids = _ids()
    changed = ids.clone()
    changed[:, 6] = (ids[:, 6] + 1) % 50
    a, b = lm(ids), lm(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.equal(a[:, 6:], b[:, 6:])


def test_encoder_is_bidirectional_and_ignores_padding():
    enc = TransformerEncoder(TransformerConfig.preset("bert", **TINY)).eval()
    ids = _ids()
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 7:] = True
    out = enc(ids, pad)
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % 50  # a padded token
    torch.testing.assert_close(enc(changed, pad)[0, :7], out[0, :7], rtol=1e-6, atol=1e-6)
    changed = ids.clone()
    changed[1, 9] = (ids[1, 9] + 1) % 50  # a real last token: earlier positions see it
    assert not torch.allclose(enc(changed, pad)[1, :9], out[1, :9])


def test_batchnorm_model_uses_the_padding_mask():
    cfg = TransformerConfig(**TINY, norm="batchnorm", placement="pre")
    enc = TransformerEncoder(cfg)  # training mode: batch statistics
    ids = _ids()
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 5:] = True
    out = enc(ids, pad)
    changed = ids.clone()
    changed[1, 6:] = (ids[1, 6:] + 7) % 50
    torch.testing.assert_close(enc(changed, pad)[~pad], out[~pad], rtol=1e-5, atol=1e-5)


def test_encoder_decoder_shapes_and_grads():
    cfg = TransformerConfig.preset("original", **TINY, n_decoder_layers=3)
    model = TransformerEncoderDecoder(cfg)
    assert (len(model.encoder_blocks), len(model.decoder_blocks)) == (2, 3)
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[0, 5:] = True
    logits = model(_ids(t=7), _ids(t=5), src_padding_mask=src_pad)
    assert logits.shape == (2, 5, 50)
    logits.sum().backward()
    assert _finite_grads(model)


# ---------------------------------------------------------------------------------------------------- attention


def test_recorded_max_logit_matches_a_manual_computation():
    attn = MultiHeadAttention(32, 4, causal=True, record_logits=True)
    fast = MultiHeadAttention(32, 4, causal=True)
    fast.load_state_dict(attn.state_dict())
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(attn(x), fast(x))  # the explicit path computes the same attention
    q = attn.q_proj(x).view(2, 6, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 6, 4, 8).transpose(1, 2)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(attn.max_logit, s.max())
    assert fast.max_logit is None


def test_qk_norm_bounds_the_attention_logits():
    """With normalized q and k (unit-RMS rows, weight 1), |q.k| / sqrt(dh) <= sqrt(dh) whatever the input scale."""
    lm = TransformerLM(TransformerConfig(**TINY, qk_norm=True, record_logits=True, norm="rmsnorm"))
    with torch.no_grad():
        lm.embed.tok.weight.mul_(1e3)
    lm(_ids())
    for block in lm.blocks:
        assert block.attn.sublayer.q_norm is not None
        assert block.attn.sublayer.max_logit <= math.sqrt(8) + 1e-4


# ---------------------------------------------------------------------------------------------------- init


def _named(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_deepnorm_beta_scales_only_ffn_value_and_output_weights():
    kw = dict(**{**TINY, "n_layers": 3})
    torch.manual_seed(1)
    scaled = _named(TransformerLM(TransformerConfig.preset("deepnet", **kw)))
    torch.manual_seed(1)
    base = _named(TransformerLM(TransformerConfig.preset("deepnet", **kw, deepnorm_beta=1.0)))
    beta = deepnorm_coefficients(num_decoder_layers=3).decoder_beta
    touched = ("v_proj.weight", "out_proj.weight", "fc_in.weight", "fc_out.weight")
    n_touched = 0
    for name, w in scaled.items():
        if name.startswith("blocks.") and name.endswith(touched):
            torch.testing.assert_close(w, base[name] * beta)
            n_touched += 1
        else:
            assert torch.equal(w, base[name]), name  # Q, K, biases, norms, embeddings untouched
    assert n_touched == 3 * 4


def test_deepnorm_alpha_reaches_every_residual():
    lm = TransformerLM(TransformerConfig.preset("deepnet", **{**TINY, "n_layers": 6}))
    alpha = deepnorm_coefficients(num_decoder_layers=6).decoder_alpha
    assert lm.deepnorm_alpha == pytest.approx(alpha)
    assert all(b.attn.alpha == b.ffn.alpha == pytest.approx(alpha) for b in lm.blocks)
    override = TransformerLM(TransformerConfig.preset("deepnet", **TINY, deepnorm_alpha=3.0))
    assert all(b.attn.alpha == 3.0 for b in override.blocks)


def test_encoder_decoder_deepnorm_uses_the_two_sided_formulas():
    model = TransformerEncoderDecoder(TransformerConfig.preset("deepnet", **TINY, n_decoder_layers=3))
    c = deepnorm_coefficients(2, 3)
    assert model.encoder_blocks[0].attn.alpha == pytest.approx(c.encoder_alpha)
    assert model.decoder_blocks[0].cross_attn.alpha == pytest.approx(c.decoder_alpha)
    assert model.deepnorm_beta == {"encoder": pytest.approx(c.encoder_beta), "decoder": pytest.approx(c.decoder_beta)}


def test_residual_init_scaling_divides_output_projections_by_sqrt_2L():
    kw = dict(**{**TINY, "n_layers": 4})
    torch.manual_seed(2)
    scaled = _named(TransformerLM(TransformerConfig.preset("gpt2", **kw)))
    torch.manual_seed(2)
    base = _named(TransformerLM(TransformerConfig.preset("gpt2", **kw, residual_init_scaling=False)))
    for name, w in scaled.items():
        if name.endswith(("out_proj.weight", "fc_out.weight")):
            torch.testing.assert_close(w, base[name] / math.sqrt(8))
        else:
            assert torch.equal(w, base[name]), name


def test_init_schemes():
    lm = TransformerLM(TransformerConfig(**TINY, init_std=0.05))
    w = lm.blocks[0].attn.sublayer.q_proj.weight
    assert 0.04 < w.std().item() < 0.06
    assert lm.lm_head.proj.weight is lm.embed.tok.weight  # tied
    xav = TransformerLM(TransformerConfig(**TINY, init="xavier", tie_embeddings=False))
    w = xav.blocks[0].ffn.sublayer.fc_in.weight  # (128, 32): xavier std sqrt(2 / (32 + 128))
    assert w.std().item() == pytest.approx(math.sqrt(2 / 160), rel=0.1)
    assert torch.all(xav.blocks[0].ffn.sublayer.fc_in.bias == 0)


def test_blocks_expose_the_residual_stream():
    lm = TransformerLM(TransformerConfig(**TINY))
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, out: seen.append(out)) for b in lm.blocks]
    ids = _ids()
    lm(ids)
    for h in hooks:
        h.remove()
    assert len(seen) == 2 and all(s.shape == (2, 10, 32) for s in seen)
    torch.testing.assert_close(lm.lm_head(lm.final_norm(seen[-1])), lm(ids))


def test_sequence_longer_than_max_seq_len_is_rejected():
    with pytest.raises(ValueError, match="exceeds max_seq_len 16"):
        TransformerLM(TransformerConfig(**TINY))(_ids(t=17))


# ---------------------------------------------------------------------------------------------------- more shapes


@pytest.mark.parametrize("placement", ["post", "pre", "deepnorm", "sandwich", "none", "post-noskip", "pre-noskip"])
def test_every_placement_builds_a_trainable_lm(placement):
    lm = TransformerLM(TransformerConfig(**TINY, placement=placement))
    assert all(b.placement == placement for b in lm.blocks)
    lm(_ids()).sum().backward()
    assert _finite_grads(lm)


def test_parallel_block_matches_its_equation():
    cfg = TransformerConfig.preset("palm", **TINY)
    block = ParallelBlock(cfg).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    h = block.norm(x)
    torch.testing.assert_close(block(x), x + block.attn(h) + block.ffn(h), rtol=1e-12, atol=1e-12)


def test_decoder_reads_the_source_through_cross_attention():
    model = TransformerEncoderDecoder(TransformerConfig.preset("original", **TINY)).eval()
    src, tgt = _ids(t=7), _ids(t=5)
    changed = src.clone()
    changed[:, 3] = (src[:, 3] + 1) % 50
    assert not torch.allclose(model(src, tgt), model(changed, tgt))


def test_padding_masks_must_be_bool():
    enc = TransformerEncoder(TransformerConfig(**TINY))
    with pytest.raises(TypeError, match="must be a bool tensor, True at padded positions"):
        enc(_ids(), torch.ones(2, 10, dtype=torch.long))


def test_embed_scale_multiplies_token_embeddings_by_sqrt_d():
    cfg = TransformerConfig(**TINY, positional="none", embed_scale=True)
    lm = TransformerLM(cfg)
    ids = _ids()
    torch.testing.assert_close(lm.embed(ids), lm.embed.tok(ids) * math.sqrt(32))


def test_attention_logit_helpers():
    from addnorm.nn import max_attention_logits, record_attention_logits

    lm = TransformerLM(TransformerConfig(**TINY))
    assert max_attention_logits(lm) == {}
    mods = record_attention_logits(lm)
    assert len(mods) == 2
    lm(_ids())
    logits = max_attention_logits(lm)
    assert set(logits) == {"blocks.0.attn.sublayer", "blocks.1.attn.sublayer"}
    assert all(math.isfinite(v) for v in logits.values())
    record_attention_logits(lm, False)
    assert max_attention_logits(lm) == {}


@pytest.mark.parametrize("model_cls", ["TransformerLM", "TransformerEncoder"])
def test_token_ids_outside_the_vocabulary_are_a_clear_error(model_cls):
    """torch's own error was a bare `IndexError: index out of range in self`."""
    import addnorm.nn as addnorm_nn

    model = getattr(addnorm_nn, model_cls)(
        TransformerConfig.preset("gpt2", n_layers=1, d_model=16, n_heads=2, vocab_size=50)
    )
    with pytest.raises(ValueError, match=r"vocab_size=50\): the largest is 57 \(ids range over \[0, 57\]\)"):
        model(torch.tensor([[0, 57, 3], [1, 2, 49]]))
    with pytest.raises(ValueError, match=r"vocab_size=50\): the smallest is -1"):
        model(torch.tensor([[0, -1, 3]]))
    assert model(torch.tensor([[0, 49, 3]])).shape == (1, 3, 50)  # the edge of the vocabulary is fine


def test_token_ids_outside_the_vocabulary_in_an_encoder_decoder():
    from addnorm.nn import TransformerEncoderDecoder

    model = TransformerEncoderDecoder(
        TransformerConfig.preset("original", n_layers=1, d_model=16, n_heads=2, vocab_size=20)
    )
    with pytest.raises(ValueError, match="the largest is 20"):
        model(torch.tensor([[1, 2]]), torch.tensor([[3, 20]]))
