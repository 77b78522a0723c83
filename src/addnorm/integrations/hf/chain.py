"""The norm on a branch's output, fused with the residual add after it, and with the norm that reads that sum.

Two layer shapes put a norm on the branch's output rather than (only) before it:

    branch-output   h = x + N(F(x))                          OLMo 2, OLMo 3, EXAONE 4
    sandwich        h = x + N_post(F(N_pre(x))), then N_pre'(h)   Gemma 2, Gemma 3, GLM-4, ...

Patched forwards (the sandwich template of :mod:`addnorm.integrations.hf.forwards`, forwards rewritten by
:mod:`addnorm.integrations.hf.rewrite`) call these in place of the norm and the add:

    norm_add(post, y, a)                 a + post(y)                        one addnorm.norm_add call
    norm_add_norm(post, pre, y, a)       (pre(a + post(y)), a + post(y))    one addnorm.norm_add_norm call
    norm_add_handoff(layer, post, y, a)  a + post(y), the add a layer returns: where ``layer`` is linked to the
                                         norm that reads it next (:mod:`addnorm.integrations.hf.links`), one
                                         norm_add_norm call with that norm, which then returns its output when
                                         called on this sum (:mod:`addnorm.integrations.hf.handoff`)

Each runs the fused op only where it computes what the modules would: both norms addnorm's plain LayerNorm or
RMSNorm over the last dimension (the options passed are the module's own), weights of the input's dtype (HF's
``weight * x`` would promote), operands of one dtype and shape, and no hook on the norm modules (the op does not
call them, so a hook would not run); anywhere else the modules are called as written. The roundings are Hugging
Face's: ``post(y)`` rounded to y's dtype, then the add, then ``pre`` on the rounded sum.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from addnorm.integrations.hf.handoff import _NEXT, _READY, _checkpointed, _hooked, _state, count_fused_run, fusable
from addnorm.integrations.hf.norms import AnyWidthRMSNorm, CastBeforeWeightRMSNorm, HFRMSNorm
from addnorm.nn.norms import LayerNorm, RMSNorm
from addnorm.ops.norm_add import norm_add as _norm_add_op
from addnorm.ops.norm_add import norm_add_norm as _norm_add_norm_op

__all__ = ["norm_add", "norm_add_handoff", "norm_add_norm"]

# what the ops' arguments describe; a subclass may form its gain otherwise (OnePlusWeightLayerNorm: weight + 1)
_PLAIN_NORMS = (LayerNorm, RMSNorm, HFRMSNorm, CastBeforeWeightRMSNorm, AnyWidthRMSNorm)


def _plain(norm: nn.Module, x: Tensor, called: bool = False) -> bool:
    """Whether the ops compute ``norm(x)`` from the module's options, without calling it: no hook would run, unless
    the module is ``called`` later all the same (a handoff's consumer, whose hooks run when it returns the output
    computed here; a pre-hook that replaces its input makes it normalize that input instead)."""
    if getattr(type(norm), "_addnorm_base", type(norm)) not in _PLAIN_NORMS:
        return False
    w = norm._parameters.get("weight")  # not getattr: nn.Module's lookup costs microseconds, twice per layer
    return (
        len(norm.normalized_shape) == 1
        and (w is None or (w.dtype == x.dtype and w.dim() == 1))
        and getattr(norm, "residual_dtype", None) is None  # (a module pickled by an older addnorm lacks it)
        and (called or not (norm._forward_hooks or norm._forward_pre_hooks))
    )


def _options(norm: nn.Module) -> tuple:
    """(weight, bias, eps, kind, zero_centered_weight, cast_before_weight) of a :func:`_plain` norm."""
    return (
        norm._parameters.get("weight"),
        norm._parameters.get("bias"),
        norm.eps,
        "rms" if isinstance(norm, RMSNorm) else "layer",
        norm.zero_centered_weight,
        getattr(norm, "cast_before_weight", False),
    )


def _no_global_hooks() -> bool:
    return not (_module._global_forward_hooks or _module._global_forward_pre_hooks)


def norm_add(norm: nn.Module, y: Tensor, a: Tensor) -> Tensor:
    """``a + norm(y)``: :func:`addnorm.norm_add` with the module's options where it computes that (module
    docstring), else the module and the add as written."""
    if fusable(norm, y, a) and _plain(norm, y) and _no_global_hooks():
        w, b, eps, kind, zcw, cbw = _options(norm)
        count_fused_run("norm_add")
        return _norm_add_op(
            y, a, w, b, eps, norm=kind, zero_centered_weight=zcw, cast_before_weight=cbw, backend=norm.backend
        )
    return a + norm(y)


def _chain(post: nn.Module, pre: nn.Module, y: Tensor, a: Tensor, consumer: bool = False):
    """``(pre(h), h)``, ``h = a + post(y)``, in one :func:`addnorm.norm_add_norm` call; None where that call would
    not compute what the modules do. ``consumer``: ``pre`` is a handoff's consumer (see :func:`_plain`)."""
    if not (
        fusable(post, y, a)
        and isinstance(pre, (LayerNorm, RMSNorm))
        and _plain(post, y)
        and _plain(pre, y, called=consumer)  # h has y's dtype: a and y share it (fusable)
        and post.backend == pre.backend
        and _no_global_hooks()
    ):
        return None
    w1, b1, eps1, kind1, zcw1, cbw1 = _options(post)
    w2, b2, eps2, kind2, zcw2, cbw2 = _options(pre)
    count_fused_run("norm_add_norm")
    return _norm_add_norm_op(
        y, a, w1, w2, b1, b2, eps1, eps2,
        norm=kind1, norm2=kind2, zero_centered_weight=(zcw1, zcw2), cast_before_weight=(cbw1, cbw2),
        backend=post.backend,
    )  # fmt: skip


def norm_add_norm(post: nn.Module, pre: nn.Module, y: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """``(pre(h), h)`` with ``h = a + post(y)``: one fused call where it computes that, else :func:`norm_add` (itself
    fused where it can be) and the module ``pre``."""
    out = _chain(post, pre, y, a)
    if out is not None:
        return out
    h = norm_add(post, y, a)
    return pre(h), h


def norm_add_handoff(layer: nn.Module, post: nn.Module, y: Tensor, a: Tensor) -> Tensor:
    """``a + post(y)``, the add ``layer`` returns; where ``layer`` is linked to the norm that reads the sum next, that
    norm's output is computed in the same fused call and left with it (as :func:`handoff.add_handoff` does for a
    plain add). Else :func:`norm_add`."""
    found = None if torch.compiler.is_compiling() else layer.__dict__.get(_NEXT)
    if (
        found is None
        or (torch.is_grad_enabled() and _checkpointed(found.checkpointed))
        or (_hooked(found.post, found.pre) and y.is_inference())
    ):
        return norm_add(post, y, a)
    norm = found.norm
    out = _chain(post, norm, y, a, consumer=True)
    if out is None:
        return norm_add(post, y, a)
    n, h = out
    norm.__dict__[_READY] = (weakref.ref(h), _state(norm, h), n)
    return h
