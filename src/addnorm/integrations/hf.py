"""Hugging Face transformers: run a model's norms on addnorm, and its residual add + next norm as one fused call.

    model = addnorm.integrations.hf.apply(model)     # in place; returns the model
    addnorm.integrations.hf.revert(model)            # the original modules and forwards, exactly

``apply`` swaps every norm for an addnorm module holding the *same* Parameter objects (so optimizers, tied weights
and state_dict keys are untouched) and reproduces each family's own numerics:

    Llama, Mistral, Qwen2, Qwen3   y = weight * to(x.dtype)(x * rstd)           rstd in fp32; cast BEFORE the weight
    Gemma, Gemma2, Gemma3          y = to(x.dtype)(x * rstd * (1 + weight))     all in fp32, one rounding
    GPT-2, BERT (nn.LayerNorm)     y = to(x.dtype)((x - mean) * rstd * w + b)   all in fp32, one rounding

All three are options of addnorm's contract: ``cast_before_weight`` for Llama (in bf16/fp16 it rounds the normalized
value to the input dtype, then multiplies by the weight and rounds again), ``zero_centered_weight`` for Gemma. So
the fused kernels reproduce each family's rounding, bit for bit for the RMSNorm families when weight and input
share a dtype (the usual case). LayerNorm's fp32 mean and variance are summed in another order than in torch's
kernel, so a GPT-2/BERT output can land on the neighbouring bf16 number (one ulp). When the dtypes differ, HF's ``weight * x`` promotes the output's dtype, which a kernel writing x's dtype cannot;
:class:`CastBeforeWeightRMSNorm` then normalizes without the weight and multiplies as HF does. One difference
remains, on purpose: for fp64 inputs HF normalizes in fp32, addnorm in fp64 (the more accurate of the two).

With ``fuse_residual=True`` the decoder layers are given a forward that computes the residual add and the next norm
in one call, ``h, residual = norm(branch_out, residual)`` (``residual += branch_out; h = norm(residual)``):

    Llama-like       the attention residual add + post_attention_layernorm (Llama, Mistral, Qwen2, Qwen3, Gemma)
    Gemma2/Gemma3    the attention residual add + pre_feedforward_layernorm (sandwich norms)
    GPT-2            the attention residual add + ln_2 (and ln_cross_attn with cross-attention)
    BERT (post-norm) LayerNorm(dropout(dense(h)) + input) in BertSelfOutput and BertOutput

The add that ends each layer stays a plain add: fusing it with the next layer's input norm would change what the
layers pass each other, which generation, hooks and hidden-state outputs rely on. The new forward keeps the
original's signature and return value (checked against the installed transformers when applied, see
``_FAMILIES``), so generation with a KV cache and gradient checkpointing keep working. HF's dropout modules are kept
and the fused op runs with ``dropout_p=0``, so training draws the same random numbers as the unpatched model.
Hooks registered on the replaced norm modules do not move to the new ones; register them after ``apply``.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from addnorm.nn.norms import LayerNorm, RMSNorm
from addnorm.ops.add_norm import add_rms_norm

__all__ = ["apply", "revert", "is_applied", "tiny_config", "tiny_model", "FAMILIES", "CastBeforeWeightRMSNorm"]

_INSTALL_HINT = "pip install 'addnorm[hf]'"
_PATCH_ATTR = "_addnorm_hf_patch"


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"addnorm.integrations.hf needs Hugging Face transformers: {_INSTALL_HINT}") from e
    return transformers


# --------------------------------------------------------------------------------------------------------------
# Norm modules
# --------------------------------------------------------------------------------------------------------------


class CastBeforeWeightRMSNorm(RMSNorm):
    """RMSNorm with the cast order of Llama, Mistral and Qwen: ``weight * to(x.dtype)(x * rstd)``, rstd in fp32.

    ``forward(x, residual)`` fuses the residual add as :class:`addnorm.nn.RMSNorm` does. ``variance_epsilon`` is an
    alias of ``eps``, the name HF code reads.
    """

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def __init__(self, *args, **kwargs):
        super().__init__(*args, cast_before_weight=True, **kwargs)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        w = self.weight
        if w is None or torch.promote_types(w.dtype, x.dtype) == x.dtype:
            # HF's ``w * x.to(dtype)`` stays in x's dtype: the fused call with cast_before_weight is its value
            return super().forward(x, residual)
        # a weight of a wider dtype than x (an fp32 weight with bf16 activations) makes HF's output that wider
        # dtype; the kernel writes x's dtype, so normalize without the weight and multiply as HF does
        result = self._forward(add_rms_norm, x, residual, (None, self.eps))
        if residual is None:
            return w * result
        out, residual_out = result
        return w * out, residual_out


def _rms_eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ValueError(f"cannot read eps from {type(module).__name__}: no variance_epsilon or eps attribute")


def _share_params(new: nn.Module, old: nn.Module, names=("weight", "bias")) -> nn.Module:
    """Give ``new`` the very Parameter objects of ``old`` (or None where old has none)."""
    for name in names:
        if hasattr(new, name) or hasattr(old, name):
            setattr(new, name, getattr(old, name, None))
    return new


def _cast_before_weight_norm(old: nn.Module) -> nn.Module:
    n = old.weight.shape[0]
    new = CastBeforeWeightRMSNorm(n, eps=_rms_eps(old), device="meta")  # meta: no throwaway weight allocated
    return _share_params(new, old, ("weight",))


def _zero_centered_norm(old: nn.Module) -> nn.Module:
    n = old.weight.shape[0]
    new = RMSNorm(n, eps=_rms_eps(old), zero_centered_weight=True, device="meta")
    return _share_params(new, old, ("weight",))


def _layer_norm(old: nn.LayerNorm) -> nn.Module:
    new = LayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                    bias=old.bias is not None, device="meta")  # fmt: skip
    return _share_params(new, old)


# --------------------------------------------------------------------------------------------------------------
# Fused forwards. Each replaces a forward of the installed transformers (read from its source) line for line,
# except that "residual = residual + out; h = norm(residual)" becomes one call "h, residual = norm(out, residual)".
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Signature:
    """The original forward's parameters after (self, hidden_states), read once per class: binding by hand keeps the
    fused forward free of inspect calls (cheap per layer call, and nothing for torch.compile to trip on)."""

    names: tuple[str, ...]  # named parameters, in order
    defaults: dict  # name -> default, for those that have one
    var_keyword: bool  # whether the original takes **kwargs

    @classmethod
    def of(cls, fn) -> _Signature:
        params = list(inspect.signature(fn).parameters.values())[2:]
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return cls(
            names=tuple(p.name for p in named),
            defaults={p.name: p.default for p in named if p.default is not p.empty},
            var_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
        )


def _bound_arguments(self, hidden_states, args, kwargs) -> dict:
    """The original forward's arguments after hidden_states, by name, defaults filled in, **kwargs flattened."""
    sig: _Signature = self._addnorm_signature
    where = f"{type(self).__name__}.forward()"
    if len(args) > len(sig.names):
        raise TypeError(f"{where} takes {len(sig.names) + 1} positional arguments, got {len(args) + 1}")
    out = dict(sig.defaults)
    out.update(zip(sig.names, args))
    for name, value in kwargs.items():
        if name == "past_key_values" and "cache" in sig.names and "past_key_values" not in sig.names:
            # transformers' deprecate_kwarg wraps the original forward and renames the old keyword the same way
            if "cache" in kwargs:
                continue
            name = "cache"
        if name in sig.names[: len(args)]:
            raise TypeError(f"{where} got multiple values for argument {name!r}")
        if name not in sig.names and not sig.var_keyword:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        out[name] = value
    missing = [n for n in sig.names if n not in out]
    if missing:
        raise TypeError(f"{where} missing required arguments: {', '.join(missing)}")
    return out


def _llama_like_forward(self, hidden_states, *args, **kwargs):
    """Llama, Mistral, Qwen2, Qwen3, Gemma: x + attn(norm1(x)), then + mlp(norm2(.)), norm2 fused with the add."""
    # the original passes every argument but hidden_states on to self_attn
    attn_kwargs = _bound_arguments(self, hidden_states, args, kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attn_kwargs)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _sandwich_forward(self, hidden_states, *args, **kwargs):
    """Gemma2, Gemma3: x + post_attn_norm(attn(norm(x))); then the pre-feedforward norm fused with that add."""
    attn_kwargs = _bound_arguments(self, hidden_states, args, kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attn_kwargs)
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    return residual + hidden_states


def _gpt2_forward(self, hidden_states, *args, **kwargs):
    """GPT2Block: ln_2 (and ln_cross_attn) fused with the residual add before it."""
    a = _bound_arguments(self, hidden_states, args, kwargs)
    cache, mask, use_cache = a.pop("cache"), a.pop("attention_mask"), a.pop("use_cache")
    encoder_hidden_states, encoder_mask = a.pop("encoder_hidden_states"), a.pop("encoder_attention_mask")
    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    branch, _ = self.attn(hidden_states, cache=cache, attention_mask=mask, use_cache=use_cache, **a)
    if encoder_hidden_states is not None:
        if not hasattr(self, "crossattention"):
            raise ValueError(
                f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
                "cross-attention layers by setting `config.add_cross_attention=True`"
            )
        hidden_states, residual = self.ln_cross_attn(branch, residual)
        branch, _ = self.crossattention(
            hidden_states, cache=cache, attention_mask=mask, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_mask,
        )  # fmt: skip
    hidden_states, residual = self.ln_2(branch, residual)
    return residual + self.mlp(hidden_states)


def _bert_output_forward(self, hidden_states, input_tensor):
    """BertSelfOutput / BertOutput (post-norm): LayerNorm(dropout(dense(h)) + input) as one fused add + norm."""
    hidden_states = self.dropout(self.dense(hidden_states))
    return self.LayerNorm(hidden_states, input_tensor)[0]


# --------------------------------------------------------------------------------------------------------------
# What to patch, per class of the installed transformers
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NormRule:
    make: object  # old module -> new addnorm module
    source_has: tuple[str, ...]  # lines of the HF forward whose numerics the new module reproduces


@dataclass(frozen=True)
class _LayerRule:
    forward: object
    source_has: tuple[str, ...]  # lines of the original forward that the fused one rewrites
    params: tuple[str, ...] | None = None  # the original forward's parameters exactly (None: any, see _LLAMA_PARAMS)


_LLAMA_NORM = _NormRule(_cast_before_weight_norm, ("return self.weight * hidden_states.to(input_dtype)",))
_GEMMA_NORM = _NormRule(_zero_centered_norm, ("output = output * (1.0 + self.weight.float())",))
_LAYER_NORM = _NormRule(_layer_norm, ())

# Parameters a Llama-like layer may have; all of them go on to self_attn. Anything else (older transformers had
# output_attentions and returned tuples) means the layer is not the one this module knows: it is left unfused.
_LLAMA_PARAMS = {"self", "hidden_states", "attention_mask", "position_ids", "cache", "use_cache",
                 "position_embeddings", "kwargs"}  # fmt: skip

_LLAMA_LAYER = _LayerRule(
    _llama_like_forward,
    ("hidden_states, _ = self.self_attn(", "hidden_states = residual + hidden_states", "residual = hidden_states",
     "hidden_states = self.post_attention_layernorm(hidden_states)", "hidden_states = self.mlp(hidden_states)",
     "return hidden_states"),
)  # fmt: skip
_SANDWICH_LAYER = _LayerRule(
    _sandwich_forward,
    ("hidden_states, _ = self.self_attn(", "hidden_states = self.post_attention_layernorm(hidden_states)",
     "hidden_states = residual + hidden_states", "residual = hidden_states",
     "hidden_states = self.pre_feedforward_layernorm(hidden_states)",
     "hidden_states = self.post_feedforward_layernorm(hidden_states)", "return hidden_states"),
)  # fmt: skip
_GPT2_LAYER = _LayerRule(
    _gpt2_forward,
    ("hidden_states = attn_output + residual", "hidden_states = self.ln_2(hidden_states)",
     "hidden_states = residual + cross_attn_output", "hidden_states = residual + feed_forward_hidden_states"),
    ("self", "hidden_states", "cache", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
     "use_cache", "kwargs"),
)  # fmt: skip
_BERT_OUTPUT = _LayerRule(
    _bert_output_forward,
    ("hidden_states = self.dense(hidden_states)", "hidden_states = self.dropout(hidden_states)",
     "hidden_states = self.LayerNorm(hidden_states + input_tensor)"),
    ("self", "hidden_states", "input_tensor"),
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]  # config.model_type values
    norms: dict[str, _NormRule]  # HF class name -> rule ("LayerNorm" means torch.nn.LayerNorm itself)
    layers: dict[str, _LayerRule] = field(default_factory=dict)  # HF class name -> fused forward


_FAMILIES: dict[str, Family] = {
    "gpt2": Family(("gpt2",), {"LayerNorm": _LAYER_NORM}, {"GPT2Block": _GPT2_LAYER}),
    "bert": Family(("bert",), {"LayerNorm": _LAYER_NORM}, {"BertSelfOutput": _BERT_OUTPUT, "BertOutput": _BERT_OUTPUT}),
    **{
        name: Family((name,), {f"{prefix}RMSNorm": _LLAMA_NORM}, {f"{prefix}DecoderLayer": _LLAMA_LAYER})
        for name, prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))
    },
    "gemma": Family(("gemma",), {"GemmaRMSNorm": _GEMMA_NORM}, {"GemmaDecoderLayer": _LLAMA_LAYER}),
    "gemma2": Family(("gemma2",), {"Gemma2RMSNorm": _GEMMA_NORM}, {"Gemma2DecoderLayer": _SANDWICH_LAYER}),
    "gemma3": Family(("gemma3_text",), {"Gemma3RMSNorm": _GEMMA_NORM}, {"Gemma3DecoderLayer": _SANDWICH_LAYER}),
}
FAMILIES = tuple(_FAMILIES)


def _family_of(model: nn.Module) -> Family:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in _FAMILIES.values():
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for f in _FAMILIES.values() for t in f.model_types)
    raise ValueError(f"model: config.model_type {model_type!r} is not supported; supported: {supported}")


def _normalized_source(fn) -> str | None:
    try:
        src = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    return "\n".join(" ".join(line.split()) for line in src.splitlines())


def _source_matches(fn, lines: tuple[str, ...]) -> bool:
    if not lines:
        return True
    src = _normalized_source(fn)
    return src is not None and all(line in src for line in lines)


def _from_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


def _layer_rule_fits(cls: type, rule: _LayerRule) -> bool:
    params = tuple(inspect.signature(cls.forward).parameters)
    if rule.params is not None and params != rule.params:
        return False
    if rule.params is None and (params[:2] != ("self", "hidden_states") or not set(params) <= _LLAMA_PARAMS):
        return False
    return _source_matches(cls.forward, rule.source_has)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type, rule: _LayerRule) -> type:
    """A subclass of ``cls`` whose forward is ``rule.forward``. Made once per class and kept in this module's
    namespace under its name, so models holding it pickle. Subclassing (rather than setting an instance forward)
    keeps what transformers adds to a layer class, e.g. GradientCheckpointingLayer wraps a subclass's forward."""
    if cls not in _FUSED_CLASSES:
        name = f"AddNormFused{cls.__name__}"
        sub = type(name, (cls,), {
            "forward": rule.forward, "__module__": __name__, "__qualname__": name,
            "_addnorm_signature": _Signature.of(cls.forward),
        })  # fmt: skip
        globals()[name] = sub
        _FUSED_CLASSES[cls] = sub
    return _FUSED_CLASSES[cls]


# --------------------------------------------------------------------------------------------------------------
# apply / revert
# --------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Patch:
    """What apply changed, to undo it: swapped modules and swapped classes."""

    modules: list[tuple[nn.Module, str, nn.Module, nn.Module]] = field(default_factory=list)  # parent, name, old, new
    classes: list[tuple[nn.Module, type]] = field(default_factory=list)  # module, its original class
    fuse_residual: bool = True


def is_applied(model: nn.Module) -> bool:
    """Whether :func:`apply` has patched ``model`` (and :func:`revert` has not undone it)."""
    return isinstance(getattr(model, _PATCH_ATTR, None), _Patch)


def apply(model: nn.Module, fuse_residual: bool = True) -> nn.Module:
    """Swap ``model``'s norms for addnorm's (same Parameters, same numerics) and, with ``fuse_residual``, fuse each
    decoder layer's residual add with the norm after it. In place; returns ``model``. Undo with :func:`revert`.

    Supported: GPT-2, BERT, Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3 (text). A layer whose forward in the
    installed transformers differs from the one this module rewrites is left unfused, with a warning.

    Applying to a model that is already patched raises ``ValueError`` rather than doing nothing: a second call may
    ask for another ``fuse_residual``, which a silent no-op would ignore. Check with :func:`is_applied`, or
    :func:`revert` first. The patch is not saved: ``save_pretrained`` writes the usual keys and
    ``from_pretrained`` returns an unpatched model (apply again after loading).
    """
    _require_transformers()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if not isinstance(fuse_residual, bool):
        raise TypeError(f"fuse_residual must be a bool, got {type(fuse_residual).__name__}")
    if is_applied(model):
        raise ValueError("model: addnorm.integrations.hf.apply was already applied; call revert(model) first")
    family = _family_of(model)
    patch = _Patch(fuse_residual=fuse_residual)

    # 1. norms. Collect first, then swap, so the module walk never sees a half-patched tree.
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            cls = type(child)
            key = "LayerNorm" if cls is nn.LayerNorm else (cls.__name__ if _from_transformers(cls) else None)
            rule = family.norms.get(key)
            if rule is None:
                continue
            if not _source_matches(cls.forward, rule.source_has):
                warnings.warn(f"addnorm: {cls.__name__}.forward in this transformers version is not the one addnorm "
                              "reproduces; left as is", stacklevel=2)  # fmt: skip
                continue
            swaps.append((parent, name, child))
    for parent, name, old in swaps:
        new = _family_norm(family, old)
        setattr(parent, name, new)
        patch.modules.append((parent, name, old, new))

    # 2. fused forwards, only where every norm they call with a residual is now an addnorm module
    if fuse_residual:
        for module in model.modules():
            cls = type(module)
            rule = family.layers.get(cls.__name__) if _from_transformers(cls) else None
            if rule is None:
                continue
            if not _norms_swapped(module):
                continue  # a norm it calls was left as is (warned above): the fused call needs addnorm's
            if not _layer_rule_fits(cls, rule):
                warnings.warn(f"addnorm: {cls.__name__}.forward in this transformers version differs from the one "
                              "addnorm fuses; left unfused", stacklevel=2)  # fmt: skip
                continue
            module.__class__ = _fused_class(cls, rule)
            patch.classes.append((module, cls))

    object.__setattr__(model, _PATCH_ATTR, patch)
    return model


def _family_norm(family: Family, old: nn.Module) -> nn.Module:
    key = "LayerNorm" if type(old) is nn.LayerNorm else type(old).__name__
    return family.norms[key].make(old)


def _norms_swapped(layer: nn.Module) -> bool:
    return all(isinstance(m, (LayerNorm, RMSNorm)) for n, m in layer.named_children()
               if "norm" in n.lower() or n.startswith("ln_"))  # fmt: skip


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the original norm modules (given back the current Parameters) and layer classes.

    Reverting a model that is not patched (never applied, or already reverted) raises ``ValueError``: it usually
    means the wrong model object (a copy made before ``apply``, or one reloaded with ``from_pretrained``). Guard
    with :func:`is_applied` where a model may be either.
    """
    if not is_applied(model):
        raise ValueError("model: not patched by addnorm.integrations.hf.apply (nothing to revert)")
    patch: _Patch = getattr(model, _PATCH_ATTR)
    for module, cls in reversed(patch.classes):
        module.__class__ = cls
    for parent, name, old, new in reversed(patch.modules):
        # the new module may hold other Parameter objects by now (e.g. after model.to_empty); hand them back
        for pname in ("weight", "bias"):
            if isinstance(getattr(new, pname, None), nn.Parameter):
                setattr(old, pname, getattr(new, pname))
        setattr(parent, name, old)
    object.__delattr__(model, _PATCH_ATTR)
    return model


# --------------------------------------------------------------------------------------------------------------
# Tiny random models, for tests, benchmarks and docs (nothing is downloaded)
# --------------------------------------------------------------------------------------------------------------

_DECODER_SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip


def _config_classes():
    import transformers as t

    return {
        "gpt2": (t.GPT2Config, dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
                                    eos_token_id=2)),  # fmt: skip
        "bert": (t.BertConfig, dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, max_position_embeddings=128)),  # fmt: skip
        "llama": (t.LlamaConfig, _DECODER_SIZES),
        "mistral": (t.MistralConfig, _DECODER_SIZES),
        "qwen2": (t.Qwen2Config, _DECODER_SIZES),
        "qwen3": (t.Qwen3Config, {**_DECODER_SIZES, "head_dim": 16}),
        "gemma": (t.GemmaConfig, {**_DECODER_SIZES, "head_dim": 16}),
        "gemma2": (t.Gemma2Config, {**_DECODER_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16}),
        "gemma3": (t.Gemma3TextConfig, {**_DECODER_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16}),
    }


def tiny_config(family: str, **overrides):
    """A tiny config (2 layers, hidden 64, 4 heads, vocab 128) of ``family`` (one of :data:`FAMILIES`);
    ``overrides`` are config fields, e.g. ``num_hidden_layers=4``."""
    _require_transformers()
    classes = _config_classes()
    if family not in classes:
        raise ValueError(f"family must be one of {', '.join(classes)}, got {family!r}")
    cls, sizes = classes[family]
    return cls(**{**sizes, **overrides})


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A randomly initialised model of :func:`tiny_config` (a causal LM; BERT: masked LM), in eval mode."""
    transformers = _require_transformers()
    config = tiny_config(family, **overrides)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(config)
    return model.to(dtype).eval()
