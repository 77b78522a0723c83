"""Hugging Face transformers: run a model's norms on addnorm, and its residual add + next norm as one fused call.

    model = addnorm.integrations.hf.apply(model)     # in place; returns the model
    addnorm.integrations.hf.revert(model)            # the original modules and forwards, exactly

Nothing here is keyed by a family's name. ``apply`` recognises what to patch from the model itself:

- **Norms** by what they compute (:mod:`addnorm.integrations.hf.norm_probe` runs each candidate module on random rows
  in fp32 and bf16): every norm that an addnorm module reproduces exactly is swapped for one holding the *same*
  Parameter objects (so optimizers, tied weights and state_dict keys are untouched), with the family's cast order:

    Llama, Mistral, Qwen, T5, ...   y = weight * to(x.dtype)(x * rstd)           rstd in fp32; cast BEFORE the weight
    Gemma, Gemma2, Gemma3, ...      y = to(x.dtype)(x * rstd * (1 + weight))     all in fp32, one rounding
    nn.LayerNorm, OLMo, Cohere ...  y = to(x.dtype)((x - mean) * rstd * w + b)   all in fp32, one rounding
    Nemotron (LayerNorm1P)          the same with w = (weight + 1) formed in the weight's dtype (norms.py)

  These are options of addnorm's contract: ``cast_before_weight`` for Llama (in bf16/fp16 it rounds the normalized
  value to the input dtype, then multiplies by the weight and rounds again), ``zero_centered_weight`` for Gemma.
  When weight and input dtypes differ, HF's ``weight * x`` promotes the output's dtype, which a kernel writing x's
  dtype cannot; :class:`CastBeforeWeightRMSNorm` then normalizes without the weight and multiplies as HF does. For
  fp64 inputs HF normalizes in fp32, addnorm in fp64 (the more accurate of the two), on purpose. The RMSNorm
  families match bit for bit in bf16/fp16 when weight and input share a dtype; LayerNorm's fp32 mean and variance
  are summed in another order than in torch's kernel, so a GPT-2/BERT output can land on the neighbouring bf16
  number (one ulp).

- **Layers** by the structure of their forward (:mod:`addnorm.integrations.hf.layer_match`: the source parsed and
  compared with a template after renaming attributes and locals). With ``fuse_residual=True`` a layer that matches
  gets a forward computing the residual add and the next norm in one call, ``h, residual = norm(branch, residual)``:

    pre          x + attn(N1(x)), then + mlp(N2(.)): the attention add fused with N2 (Llama, Mistral, Qwen, ...)
    pre-scaled   the same with each branch times a scalar attribute (Granite's residual_multiplier)
    sandwich     x + N2(attn(N1(x))), then N3: N2, the add and N3 one addnorm.norm_add_norm call; the same for
                 the MLP's post-norm, its add and the next layer's input norm (Gemma2, Gemma3; hf/chain.py)
    post-output  N(dropout(dense(h)) + x) (BERT and the many families that copy its output sublayers)
    GPT-2 block  ln_2 (and ln_cross_attn) fused with the add before it (matched by its source lines)
    rewritten    any other forward with an add next to a norm: its own source with that add and norm made one
                 call (add then norm; norm then add via addnorm.norm_add, and addnorm.norm_add_norm when a
                 norm of the sum follows): OPT, MPT, StarCoder, OLMo 2, EXAONE 4, GLM-4, ...
                 (:mod:`addnorm.integrations.hf.rewrite`)

A fused layer (template or rewritten) also hands the add it returns to the norm that reads it next (the next layer's
input norm, or the norm after the loop over the layers): one fused call computes the sum and that norm's output, the
layer returns the sum as before, and the norm returns the output it was given when called on that very, unchanged,
tensor (:mod:`addnorm.integrations.hf.handoff`, linked by :mod:`addnorm.integrations.hf.links`). So every norm of a
Llama stack but the first runs as a fused add + norm, and parallel blocks fuse (GPT-NeoX, Phi, Cohere, GPT-J: ``x +
attn(N(x)) + mlp(N(x))`` has no norm after an add inside the layer). Adds made out of the layer's forward are handed
off the same way: by a child module whose output the layer normalizes or returns (BLOOM's attention and MLP), or
inside a helper function of the layer's module (BLOOM's ``dropout_add``, GPT-NeoX-Japanese's ``bias_dropout_add``:
:mod:`addnorm.integrations.hf.helper_rewrite`). The new forward keeps the original's signature and return value, so
generation with a KV cache and gradient checkpointing keep working (with checkpointing on, and under torch.compile,
there is no handoff). HF's dropout modules are kept and the fused op runs with ``dropout_p=0``, so training draws
the same random numbers as the unpatched model. Hooks registered on the replaced norm modules do not move to the new
ones; register them after ``apply``. Which families of the installed transformers fuse: ``addnorm survey``
(docs/survey.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from addnorm.integrations.hf import links, norm_probe, rewrite
from addnorm.integrations.hf.forwards import LayerRule, Signature, from_transformers, layer_rule
from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = [
    "apply",
    "revert",
    "is_applied",
    "apply_status",
    "fused_layer_classes",
    "require_transformers",
]

_INSTALL_HINT = "pip install 'addnorm[hf]'"
_PATCH_ATTR = "_addnorm_hf_patch"


def require_transformers():
    """The transformers package, or an ImportError naming the extra to install."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"addnorm.integrations.hf needs Hugging Face transformers: {_INSTALL_HINT}") from e
    return transformers


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type, rule: LayerRule, roles: dict[str, str], kind: str = "layer") -> type:
    """A subclass of ``cls`` whose forward is ``rule.forward``. Made once per class (its roles follow from its
    forward's source, so they are the same every time) and kept in this module's namespace under its name.
    Subclassing (rather than setting an instance forward) keeps what transformers adds to a layer class, e.g.
    GradientCheckpointingLayer wraps a subclass's forward. ``kind``: "layer" (a layer's forward, from
    :func:`layer_rule`) or "producer" (a child whose add its parent normalizes); how :func:`_restore_fused` makes the
    class again in a process that unpickles a patched model without having run :func:`apply`."""
    if cls not in _FUSED_CLASSES:
        name = f"AddNormFused{cls.__name__}"
        sub = type(
            name,
            (cls,),
            {
                "forward": rule.forward,
                "__module__": __name__,
                "__qualname__": name,
                "__reduce_ex__": _reduce_fused,
                "_addnorm_signature": Signature.of(cls.forward),
                "_addnorm_roles": dict(roles),
                "_addnorm_made_from": (cls, kind),
            },
        )
        globals()[name] = sub
        _FUSED_CLASSES[cls] = sub
    return _FUSED_CLASSES[cls]


# Pickling. A fused module pickles by the transformers class it was made from and how, not by its own class's name,
# which exists only in a process that has run apply on that class. Its forward depends on the module's children (the
# norms a rewritten forward calls), so the class is made again once the module's state is back: the module is
# created as a _Restoring subclass whose __setstate__ restores the state, then computes the fused class.
_RESTORING: dict[type, type] = {}


def _reduce_fused(self, protocol):
    base, kind = type(self)._addnorm_made_from
    return _restore_fused, (base, kind), self.__getstate__()


def _restore_fused(base: type, kind: str) -> nn.Module:
    if base not in _RESTORING:
        _RESTORING[base] = type(f"_Restoring{base.__name__}", (base,), {"__setstate__": _setstate_fused})
    obj = object.__new__(_RESTORING[base])
    obj.__dict__["_addnorm_restore_kind"] = kind
    return obj


def _setstate_fused(self, state) -> None:
    base = type(self).__mro__[1]
    kind = self.__dict__.pop("_addnorm_restore_kind")
    self.__class__ = base
    base.__setstate__(self, state)
    if base in _FUSED_CLASSES:  # this process has made it already (apply ran, or another module restored it)
        self.__class__ = _FUSED_CLASSES[base]
        return
    if kind == "producer":
        rewritten = rewrite.rewrite_forward(base, rewrite.norm_attributes(self), producer=True)
        found = None if rewritten is None else (LayerRule(rewritten.forward, ()), {})
    else:
        found = layer_rule(self)
    if found is None:
        raise RuntimeError(
            f"cannot unpickle addnorm's fused {base.__name__}: this transformers version's {base.__name__} has no "
            "forward addnorm fuses (was the model saved with another version?); revert(model) before saving to "
            "store a plain model, and apply again after loading"
        )
    self.__class__ = _fused_class(base, *found, kind=kind)


def _swappable(module: nn.Module) -> norm_probe.NormInfo | None:
    cls = type(module)
    if not (cls is nn.LayerNorm or from_transformers(cls)) or not norm_probe.is_candidate(module):
        return None
    info = norm_probe.probe(module)
    return info if info is not None and info.addnorm is not None else None


@dataclass(kw_only=True)
class _Patch:
    """What apply changed, to undo it: swapped modules and swapped classes."""

    modules: list[tuple[nn.Module, str, nn.Module, nn.Module]] = field(default_factory=list)  # parent, name, old, new
    classes: list[tuple[nn.Module, type]] = field(default_factory=list)  # module, its original class
    links: list[tuple[nn.Module, nn.Module, type]] = field(default_factory=list)  # links.link's record
    fuse_residual: bool = True


def _holds_swapped_norm(model: nn.Module) -> bool:
    """Whether a transformers module in ``model`` holds an addnorm norm, as :func:`apply` leaves it (a model built
    from addnorm.nn alone, which holds addnorm norms too, has no transformers module)."""
    for parent in model.modules():
        cls = type(parent)
        if from_transformers(cls) or hasattr(cls, "_addnorm_made_from"):  # a transformers class, or its fused one
            if any(isinstance(child, (LayerNorm, RMSNorm)) for child in parent.children()):
                return True
    return False


def is_applied(model: nn.Module) -> bool:
    """Whether :func:`apply` has patched ``model`` (and :func:`revert` has not undone it)."""
    return isinstance(getattr(model, _PATCH_ATTR, None), _Patch)


def apply(model: nn.Module, fuse_residual: bool = True) -> nn.Module:
    """Swap ``model``'s norms for addnorm's (same Parameters, same numerics) and, with ``fuse_residual``, fuse each
    layer's residual add with the norm after it where the layer's structure allows. In place; returns ``model``.
    Undo with :func:`revert`. See the module docstring for what is recognised, and how.

    The swapped-in norms take the train/eval mode of the modules they replace. A model with no norm that addnorm
    reproduces raises ``ValueError``. With ``fuse_residual``, a model none of
    whose layers matches a known structure keeps its layers (its norms are still swapped), with a warning.

    Applying to a model that is already patched (or holds a patched submodule, or is part of a patched model: the
    message says which) raises ``ValueError`` rather than doing nothing: a second call may
    ask for another ``fuse_residual``, which a silent no-op would ignore. Check with :func:`is_applied`, or
    :func:`revert` first. The patch is not saved: ``save_pretrained`` writes the usual keys and
    ``from_pretrained`` returns an unpatched model (apply again after loading).
    """
    require_transformers()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if not isinstance(fuse_residual, bool):
        raise TypeError(f"fuse_residual must be a bool, got {type(fuse_residual).__name__}")
    if is_applied(model):
        raise ValueError("model: addnorm.integrations.hf.apply was already applied; call revert(model) first")
    # a submodule patched on its own (apply(m.model), then apply(m)): its norms are addnorm's, so without this the
    # error below would say there is no norm; and a second patch over the first could not be reverted in order
    inner = next((name for name, m in model.named_modules() if name and is_applied(m)), None)
    if inner is not None:
        raise ValueError(
            f"model: its submodule {inner!r} is already patched by addnorm.integrations.hf.apply; call "
            f"revert(model.get_submodule({inner!r})) first, then apply(model)"
        )
    patch = _Patch(fuse_residual=fuse_residual)

    # 1. norms. Collect first, then swap, so the module walk never sees a half-patched tree.
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            info = _swappable(child)
            if info is not None:
                swaps.append((parent, name, child, info))
    if not swaps:
        if _holds_swapped_norm(model):
            # its norms are addnorm's: a model containing this one was patched (apply(m), then apply(m.model))
            raise ValueError(
                f"model: {type(model).__name__}'s norms are addnorm's already: it is part of a model that "
                "addnorm.integrations.hf.apply patched; call revert on that model first"
            )
        raise ValueError(
            f"model: {type(model).__name__} has no norm module that addnorm reproduces exactly "
            "(LayerNorm, RMSNorm in Llama's or Gemma's cast order); nothing to apply"
        )
    for parent, name, old, info in swaps:
        new = norm_probe.make_addnorm(old, info)
        new.train(old.training)  # a new module is in train mode; keep the mode the model was in (eval, usually)
        setattr(parent, name, new)
        patch.modules.append((parent, name, old, new))

    # 2. fused forwards, only where every norm they call with a residual is now an addnorm module
    if fuse_residual:
        for module in model.modules():
            found = layer_rule(module)
            if found is None:
                continue
            rule, roles = found
            if not all(isinstance(getattr(module, roles[r], None), (LayerNorm, RMSNorm)) for r in rule.fused_norms):
                continue  # a norm it calls with the residual was not swapped: the fused call needs addnorm's
            cls = type(module)
            module.__class__ = _fused_class(cls, rule, roles)
            patch.classes.append((module, cls))
        # a child module that makes the add its parent normalizes next (BLOOM's attention and MLP, through their
        # helper dropout_add): its forward rewritten to hand the add off (links.producers)
        for module in links.producers(model, dict(patch.classes)):
            rewritten = rewrite.rewrite_forward(type(module), rewrite.norm_attributes(module), producer=True)
            if rewritten is not None and rewritten.forward._addnorm_handoff:
                cls = type(module)
                module.__class__ = _fused_class(cls, LayerRule(rewritten.forward, ()), {}, kind="producer")
                patch.classes.append((module, cls))
        # the add a layer (or such a child) returns, fused with the norm that reads it next: the next layer's input
        # norm, the final norm, the parent's norm; that norm then finds its output computed (handoff, links)
        patch.links = links.link(model, dict(patch.classes))
        if not patch.classes:
            warnings.warn(
                f"addnorm: no layer of {type(model).__name__} matches a structure addnorm fuses (pre, "
                "sandwich, post-output, GPT-2 block, an add next to a norm); its norms were swapped, its adds left as they are",
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
    """Undo :func:`apply`: the original norm modules (given back the current Parameters, and the train/eval mode of
    the modules that stood in for them) and layer classes.

    Reverting a model that is not patched (never applied, or already reverted) raises ``ValueError``: it usually
    means the wrong model object (a copy made before ``apply``, or one reloaded with ``from_pretrained``). Guard
    with :func:`is_applied` where a model may be either.
    """
    if not is_applied(model):
        raise ValueError("model: not patched by addnorm.integrations.hf.apply (nothing to revert)")
    patch: _Patch = getattr(model, _PATCH_ATTR)
    links.unlink(patch.links)
    for module, cls in reversed(patch.classes):
        module.__class__ = cls
    for parent, name, old, new in reversed(patch.modules):
        # the new module may hold other Parameter objects by now (e.g. after model.to_empty); hand them back
        for pname in ("weight", "bias"):
            if isinstance(getattr(new, pname, None), nn.Parameter):
                setattr(old, pname, getattr(new, pname))
        old.train(new.training)  # the mode the model is in now (model.train()/eval() after apply reached the new one)
        setattr(parent, name, old)
    object.__delattr__(model, _PATCH_ATTR)
    return model
