"""Hugging Face transformers: run a model's norms on addnorm, and its residual add + next norm as one fused call.

    model = addnorm.integrations.hf.apply(model)     # in place; returns the model
    addnorm.integrations.hf.revert(model)            # the original modules and forwards, exactly

Nothing here is keyed by a family's name. ``apply`` recognises what to patch from the model itself:

- **Norms** by what they compute (:mod:`addnorm.integrations.norm_probe` runs each candidate module on random rows
  in fp32 and bf16): every norm that an addnorm module reproduces exactly is swapped for one holding the *same*
  Parameter objects (so optimizers, tied weights and state_dict keys are untouched), with the family's cast order:

    Llama, Mistral, Qwen, T5, ...   y = weight * to(x.dtype)(x * rstd)           rstd in fp32; cast BEFORE the weight
    Gemma, Gemma2, Gemma3, ...      y = to(x.dtype)(x * rstd * (1 + weight))     all in fp32, one rounding
    nn.LayerNorm, OLMo, Cohere ...  y = to(x.dtype)((x - mean) * rstd * w + b)   all in fp32, one rounding

  These are options of addnorm's contract: ``cast_before_weight`` for Llama (in bf16/fp16 it rounds the normalized
  value to the input dtype, then multiplies by the weight and rounds again), ``zero_centered_weight`` for Gemma.
  When weight and input dtypes differ, HF's ``weight * x`` promotes the output's dtype, which a kernel writing x's
  dtype cannot; :class:`CastBeforeWeightRMSNorm` then normalizes without the weight and multiplies as HF does. For
  fp64 inputs HF normalizes in fp32, addnorm in fp64 (the more accurate of the two), on purpose. The RMSNorm
  families match bit for bit in bf16/fp16 when weight and input share a dtype; LayerNorm's fp32 mean and variance
  are summed in another order than in torch's kernel, so a GPT-2/BERT output can land on the neighbouring bf16
  number (one ulp).

- **Layers** by the structure of their forward (:mod:`addnorm.integrations.layer_match`: the source parsed and
  compared with a template after renaming attributes and locals). With ``fuse_residual=True`` a layer that matches
  gets a forward computing the residual add and the next norm in one call, ``h, residual = norm(branch, residual)``:

    pre          x + attn(N1(x)), then + mlp(N2(.)): the attention add fused with N2 (Llama, Mistral, Qwen, ...)
    pre-scaled   the same with each branch times a scalar attribute (Granite's residual_multiplier)
    sandwich     x + N2(attn(N1(x))), then N3: the attention add fused with N3 (Gemma2, Gemma3)
    post-output  N(dropout(dense(h)) + x) (BERT and the many families that copy its output sublayers)
    GPT-2 block  ln_2 (and ln_cross_attn) fused with the add before it (matched by its source lines)

The add that ends each layer stays a plain add: fusing it with the next layer's input norm would change what the
layers pass each other, which generation, hooks and hidden-state outputs rely on. The new forward keeps the
original's signature and return value, so generation with a KV cache and gradient checkpointing keep working. HF's
dropout modules are kept and the fused op runs with ``dropout_p=0``, so training draws the same random numbers as
the unpatched model. Hooks registered on the replaced norm modules do not move to the new ones; register them after
``apply``. Which families of the installed transformers fuse: ``addnorm survey`` (docs/survey.md).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from addnorm.integrations import layer_match, norm_probe
from addnorm.nn.norms import LayerNorm, RMSNorm
from addnorm.ops.add_norm import add_rms_norm

__all__ = [
    "apply",
    "revert",
    "is_applied",
    "apply_status",
    "fused_layer_classes",
    "tiny_config",
    "tiny_model",
    "FAMILIES",
    "CastBeforeWeightRMSNorm",
    "HFRMSNorm",
]

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


class _VarianceEpsilonAlias:
    """``variance_epsilon``, the name HF's RMSNorm code reads and writes, as an alias of ``eps``."""

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value


class CastBeforeWeightRMSNorm(_VarianceEpsilonAlias, RMSNorm):
    """RMSNorm with the cast order of Llama, Mistral and Qwen: ``weight * to(x.dtype)(x * rstd)``, rstd in fp32.

    ``forward(x, residual)`` fuses the residual add as :class:`addnorm.nn.RMSNorm` does. ``variance_epsilon`` is an
    alias of ``eps``, the name HF code reads.
    """

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


class HFRMSNorm(_VarianceEpsilonAlias, RMSNorm):
    """addnorm's RMSNorm with ``variance_epsilon``, the name HF code reads, as an alias of ``eps``."""


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
    new = LayerNorm(
        old.normalized_shape,
        eps=old.eps,
        elementwise_affine=old.elementwise_affine,
        bias=old.bias is not None,
        device="meta",
    )
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


def _role(self, name: str) -> nn.Module:
    return getattr(self, self._addnorm_roles[name])


def _pre_forward(self, hidden_states, *args, **kwargs):
    """Template "pre" (and "pre-scaled"): x + attn(norm1(x)), then + mlp(norm2(.)), norm2 fused with the add."""
    # the original passes every argument but hidden_states on to the attention (layer_match checked it)
    attn_kwargs = _bound_arguments(self, hidden_states, args, kwargs)
    scale = self._addnorm_roles.get("scale")
    residual = hidden_states
    hidden_states = _role(self, "norm1")(hidden_states)
    hidden_states, _ = _role(self, "attn")(hidden_states=hidden_states, **attn_kwargs)
    if scale is not None:
        hidden_states = hidden_states * getattr(self, scale)  # residual + h * m == h * m + residual, bit for bit
    hidden_states, residual = _role(self, "norm2")(hidden_states, residual)
    hidden_states = _role(self, "mlp")(hidden_states)
    if scale is not None:
        hidden_states = hidden_states * getattr(self, scale)
    return residual + hidden_states


def _sandwich_forward(self, hidden_states, *args, **kwargs):
    """Template "sandwich": x + norm2(attn(norm1(x))); then norm3 (before the MLP) fused with that add."""
    attn_kwargs = _bound_arguments(self, hidden_states, args, kwargs)
    residual = hidden_states
    hidden_states = _role(self, "norm1")(hidden_states)
    hidden_states, _ = _role(self, "attn")(hidden_states=hidden_states, **attn_kwargs)
    hidden_states = _role(self, "norm2")(hidden_states)
    hidden_states, residual = _role(self, "norm3")(hidden_states, residual)
    hidden_states = _role(self, "mlp")(hidden_states)
    hidden_states = _role(self, "norm4")(hidden_states)
    return residual + hidden_states


def _post_output_forward(self, hidden_states, input_tensor):
    """Template "post-output" (BERT's output sublayers): norm(dropout(dense(h)) + input) as one fused add + norm."""
    hidden_states = _role(self, "dropout")(_role(self, "dense")(hidden_states))
    return _role(self, "norm")(hidden_states, input_tensor)[0]


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
            hidden_states,
            cache=cache,
            attention_mask=mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_mask,
        )
    hidden_states, residual = self.ln_2(branch, residual)
    return residual + self.mlp(hidden_states)


# --------------------------------------------------------------------------------------------------------------
# What to patch: recognised from the model's structure
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerRule:
    forward: object
    fused_norms: tuple[str, ...]  # roles of the norms called with a residual: they must be addnorm modules


_TEMPLATE_RULES = {
    "pre": _LayerRule(_pre_forward, ("norm2",)),
    "pre-scaled": _LayerRule(_pre_forward, ("norm2",)),
    "sandwich": _LayerRule(_sandwich_forward, ("norm3",)),
    "post-output": _LayerRule(_post_output_forward, ("norm",)),
}

# GPT-2's block (self- and cross-attention, several return paths) is matched by the lines the fused forward rewrites
# and its exact parameters; the attribute names are GPT-2's own.
_GPT2_LINES = (
    "hidden_states = attn_output + residual",
    "hidden_states = self.ln_2(hidden_states)",
    "hidden_states = residual + cross_attn_output",
    "hidden_states = residual + feed_forward_hidden_states",
)
_GPT2_PARAMS = (
    "self",
    "hidden_states",
    "cache",
    "attention_mask",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "use_cache",
    "kwargs",
)
_GPT2_ROLES = {"norm1": "ln_1", "attn": "attn", "norm2": "ln_2", "mlp": "mlp"}


def _normalized_source(fn) -> str | None:
    try:
        src = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    return "\n".join(" ".join(line.split()) for line in src.splitlines())


def _is_gpt2_block(cls: type) -> bool:
    if tuple(inspect.signature(cls.forward).parameters) != _GPT2_PARAMS:
        return False
    src = _normalized_source(cls.forward)
    return src is not None and all(line in src for line in _GPT2_LINES)


def _from_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


def _layer_rule(module: nn.Module) -> tuple[_LayerRule, dict[str, str]] | None:
    """The fused forward for ``module``'s class and its roles -> attribute names, or None."""
    cls = type(module)
    if not _from_transformers(cls):
        return None
    found = layer_match.match(cls)
    if found is not None:
        return _TEMPLATE_RULES[found.template], found.roles
    if _is_gpt2_block(cls):
        cross = {"norm_cross": "ln_cross_attn"} if hasattr(module, "ln_cross_attn") else {}
        return _LayerRule(_gpt2_forward, ("norm2",) + tuple(cross)), {**_GPT2_ROLES, **cross}
    return None


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type, rule: _LayerRule, roles: dict[str, str]) -> type:
    """A subclass of ``cls`` whose forward is ``rule.forward``. Made once per class (its roles follow from its
    forward's source, so they are the same every time) and kept in this module's namespace under its name, so
    models holding it pickle. Subclassing (rather than setting an instance forward) keeps what transformers adds to
    a layer class, e.g. GradientCheckpointingLayer wraps a subclass's forward."""
    if cls not in _FUSED_CLASSES:
        name = f"AddNormFused{cls.__name__}"
        sub = type(
            name,
            (cls,),
            {
                "forward": rule.forward,
                "__module__": __name__,
                "__qualname__": name,
                "_addnorm_signature": _Signature.of(cls.forward),
                "_addnorm_roles": dict(roles),
            },
        )
        globals()[name] = sub
        _FUSED_CLASSES[cls] = sub
    return _FUSED_CLASSES[cls]


def _swappable(module: nn.Module) -> norm_probe.NormInfo | None:
    cls = type(module)
    if not (cls is nn.LayerNorm or _from_transformers(cls)) or not norm_probe.is_candidate(module):
        return None
    info = norm_probe.probe(module)
    return info if info is not None and info.addnorm is not None else None


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
    layer's residual add with the norm after it where the layer's structure allows. In place; returns ``model``.
    Undo with :func:`revert`. See the module docstring for what is recognised, and how.

    A model with no norm that addnorm reproduces raises ``ValueError``. With ``fuse_residual``, a model none of
    whose layers matches a known structure keeps its layers (its norms are still swapped), with a warning.

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
    patch = _Patch(fuse_residual=fuse_residual)

    # 1. norms. Collect first, then swap, so the module walk never sees a half-patched tree.
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            info = _swappable(child)
            if info is not None:
                swaps.append((parent, name, child, info))
    if not swaps:
        raise ValueError(
            f"model: {type(model).__name__} has no norm module that addnorm reproduces exactly "
            "(LayerNorm, RMSNorm in Llama's or Gemma's cast order); nothing to apply"
        )
    for parent, name, old, info in swaps:
        new = norm_probe.make_addnorm(old, info)
        setattr(parent, name, new)
        patch.modules.append((parent, name, old, new))

    # 2. fused forwards, only where every norm they call with a residual is now an addnorm module
    if fuse_residual:
        for module in model.modules():
            found = _layer_rule(module)
            if found is None:
                continue
            rule, roles = found
            if not all(isinstance(getattr(module, roles[r], None), (LayerNorm, RMSNorm)) for r in rule.fused_norms):
                continue  # a norm it calls with the residual was not swapped: the fused call needs addnorm's
            cls = type(module)
            module.__class__ = _fused_class(cls, rule, roles)
            patch.classes.append((module, cls))
        if not patch.classes:
            warnings.warn(
                f"addnorm: no layer of {type(model).__name__} matches a structure addnorm fuses (pre, "
                "sandwich, post-output, GPT-2 block); its norms were swapped, its adds left as they are",
                stacklevel=2,
            )

    object.__setattr__(model, _PATCH_ATTR, patch)
    return model


def apply_status(model: nn.Module) -> str:
    """ "fused" (some residual add runs fused with its norm), "norms" (norms swapped only) or "none" (not applied)."""
    if not is_applied(model):
        return "none"
    return "fused" if getattr(model, _PATCH_ATTR).classes else "norms"


def fused_layer_classes(model: nn.Module) -> list[str]:
    """Names of the transformers classes whose forward :func:`apply` replaced in ``model``."""
    if not is_applied(model):
        return []
    return sorted({cls.__name__ for _, cls in getattr(model, _PATCH_ATTR).classes})


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

_DECODER_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


# Families with hand-sized tiny configs (tests, benchmarks, docs); tiny_config builds any other model_type too.
FAMILIES = ("gpt2", "bert", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


def _config_classes():
    import transformers as t

    return {
        "gpt2": (
            t.GPT2Config,
            dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2),
        ),
        "bert": (
            t.BertConfig,
            dict(
                vocab_size=128,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=128,
            ),
        ),
        "llama": (t.LlamaConfig, _DECODER_SIZES),
        "mistral": (t.MistralConfig, _DECODER_SIZES),
        "qwen2": (t.Qwen2Config, _DECODER_SIZES),
        "qwen3": (t.Qwen3Config, {**_DECODER_SIZES, "head_dim": 16}),
        "gemma": (t.GemmaConfig, {**_DECODER_SIZES, "head_dim": 16}),
        "gemma2": (t.Gemma2Config, {**_DECODER_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16}),
        "gemma3": (t.Gemma3TextConfig, {**_DECODER_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16}),
    }


def tiny_config(family: str, **overrides):
    """A tiny config of ``family``: one of :data:`FAMILIES` (2 layers, hidden 64, 4 heads, vocab 128), or any other
    model_type of the installed transformers, shrunk by the survey's rules (addnorm.integrations.survey.tiny);
    ``overrides`` are config fields, e.g. ``num_hidden_layers=4``."""
    _require_transformers()
    classes = _config_classes()
    if family in classes:
        cls, sizes = classes[family]
        return cls(**{**sizes, **overrides})
    from addnorm.integrations.survey import tiny

    if not isinstance(family, str) or family not in tiny.config_names():
        raise ValueError(
            f"family must be a model_type of the installed transformers (e.g. {', '.join(classes)}), got {family!r}"
        )
    try:
        return tiny.tiny_config(family, **overrides)
    except tiny.SkipModel as e:
        raise ValueError(f"family {family!r}: {e}") from e


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A randomly initialised model of :func:`tiny_config` (a causal LM where the family has one; BERT: masked LM;
    else the base model), in eval mode."""
    transformers = _require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(family, **overrides)
    if family == "bert":
        auto = transformers.AutoModelForMaskedLM
    elif config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = transformers.AutoModelForCausalLM
    else:
        auto = transformers.AutoModel
    torch.manual_seed(seed)
    model = auto.from_config(config)
    return model.to(dtype).eval()
