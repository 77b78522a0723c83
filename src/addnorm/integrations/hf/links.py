"""Linking each add that a patched forward hands off (:func:`addnorm.integrations.hf.handoff.add_handoff`) to the
norm that reads its sum next, found in the source of the forwards around it:

    layer i -> layer i+1    a layer of a ``ModuleList`` that returns the sum: the next layer's input norm (the first
                            norm its forward applies to its input), or for the last layer the norm its owner applies
                            right after the loop over the layers (:func:`input_norm`, :func:`final_norm`)
    child -> layer i+1      a layer that returns what a child module returned (``out = self.mlp(h, residual)``;
                            ``return out, ...``), where the child makes the add (BLOOM's MLP): the child is linked
                            as the layer would be
    child -> parent's norm  ``a, ... = self.attn(h, residual)`` then ``self.norm(a)`` in the parent's forward
                            (BLOOM's attention, whose ``dropout_add`` makes the add before post_attention_layernorm)
    helper -> own norm      a rewritten forward that calls a helper making the add right before ``self.norm(t)``
                            (GPT-NeoX-Japanese's ``bias_dropout_add``): the norm is its own site

A child or a helper is rewritten to hand off only where such a norm follows it (:func:`producers`): the handoff is
state kept for one call, and nothing should wait where no norm reads it. Every link is only a chance to skip work:
the norm returns the fused call's output only for the very tensor it was computed from, unchanged
(:mod:`addnorm.integrations.hf.handoff`), so a wrong reading of a source costs speed, never a wrong output.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from addnorm.integrations.hf.handoff import _NEXT, _READY, Link, _Consumer, _consumer_class
from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = ["children_into_norms", "final_norm", "input_norm", "link", "producers", "returned_child", "unlink"]

# --------------------------------------------------------------------------------------------------------------
# Where a sum is normalized next, read from the forwards' source
# --------------------------------------------------------------------------------------------------------------

_INPUT_NORMS: dict[type, str | None] = {}


def _reads_input(call, norms: set[str], x: str) -> str | None:
    """The attribute of ``self.<norm>(x)`` or ``self.<norm>(x.to(...))``."""
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
        and call.func.attr in norms
        and len(call.args) == 1
        and not call.keywords
    ):
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "to":
        arg = arg.func.value  # a cast to the dtype x has returns x itself: the tensor the handoff checks
    return call.func.attr if isinstance(arg, ast.Name) and arg.id == x else None


def input_norm(cls: type, norms: set[str]) -> str | None:
    """The attribute (among ``norms``) of the norm ``cls.forward`` applies first to its input, before rebinding it,
    or None. Read from the source; a wrong answer costs only speed (the norm checks the tensor it is given)."""
    key = (cls, frozenset(norms))
    if key not in _INPUT_NORMS:
        _INPUT_NORMS[key] = None
        fn = _source_fn(cls)
        if fn is None:
            return None
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if len(params) < 2:
            return None
        x = params[1]
        for stmt in fn.body:
            found = next((a for n in ast.walk(stmt) if (a := _reads_input(n, norms, x))), None)
            if found is not None:
                _INPUT_NORMS[key] = found
                break
            if any(isinstance(n, ast.Name) and n.id == x and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt)):
                break
    return _INPUT_NORMS[key]


def _source_fn(cls: type) -> ast.FunctionDef | None:
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return fn if isinstance(fn, ast.FunctionDef) else None


_FINAL_NORMS: dict[tuple, str | None] = {}


def final_norm(cls: type, layers: str, norms: set[str]) -> str | None:
    """The attribute (among ``norms``) of the norm ``cls.forward`` applies right after its loop over
    ``self.<layers>`` (``for layer in self.layers[...]: ...`` then ``h = self.norm(h)``), or None."""
    key = (cls, layers, frozenset(norms))
    if key not in _FINAL_NORMS:
        _FINAL_NORMS[key] = None
        fn = _source_fn(cls)
        for block in (getattr(n, f, None) for n in ast.walk(fn) if fn for f in ("body", "orelse")):
            if not isinstance(block, list):
                continue
            for loop, after in zip(block, block[1:]):
                over = (
                    {a.attr for a in ast.walk(loop.iter) if isinstance(a, ast.Attribute)}
                    if isinstance(loop, ast.For)
                    else set()
                )
                value = after.value if isinstance(after, ast.Assign) else None
                if layers in over and isinstance(value, ast.Call) and value.args:
                    arg = value.args[0]
                    if isinstance(arg, ast.Name) and (attr := _reads_input(value, norms, arg.id)):
                        _FINAL_NORMS[key] = attr
    return _FINAL_NORMS[key]


def _norms(module: nn.Module) -> set[str]:
    return {n for n, c in module.named_children() if isinstance(c, (LayerNorm, RMSNorm))}


def _bound_from_child(stmt, children: set[str]) -> tuple[str, str] | None:
    """(v, child) of ``v = self.<child>(...)`` or ``v, ... = self.<child>(...)``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.Call)):
        return None
    func, target = stmt.value.func, stmt.targets[0]
    if isinstance(target, ast.Tuple) and target.elts:
        target = target.elts[0]
    if (
        isinstance(target, ast.Name)
        and isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
        and func.attr in children
    ):
        return target.id, func.attr
    return None


def _stores(stmt, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt))


_INTO_NORMS: dict[tuple, list[tuple[str, str]]] = {}


def children_into_norms(cls: type, children: set[str], norms: set[str]) -> list[tuple[str, str]]:
    """(child, norm) for each ``v, ... = self.<child>(...)`` in ``cls.forward`` whose next statement normalizes
    ``v`` with ``self.<norm>(v)`` (a statement of the same block)."""
    key = (cls, frozenset(children), frozenset(norms))
    if key not in _INTO_NORMS:
        found = []
        fn = _source_fn(cls)
        blocks = [getattr(n, f) for n in ast.walk(fn) for f in ("body", "orelse") if fn and hasattr(n, f)]
        for block in (b for b in blocks if isinstance(b, list)):
            for stmt, nxt in zip(block, block[1:]):
                bound = _bound_from_child(stmt, children)
                if bound is None:
                    continue
                v, child = bound
                norm = next((a for n in ast.walk(nxt) if (a := _reads_input(n, norms, v))), None)
                if norm is not None:
                    found.append((child, norm))
        _INTO_NORMS[key] = list(dict.fromkeys(found))
    return _INTO_NORMS[key]


_RETURNED: dict[tuple, str | None] = {}


def returned_child(cls: type, children: set[str]) -> str | None:
    """The child whose output ``cls.forward`` returns (first): ``v = self.<child>(...)`` as the last statement of
    the forward's body that binds ``v``, then ``return v`` or ``return v, ...``."""
    key = (cls, frozenset(children))
    if key not in _RETURNED:
        _RETURNED[key] = None
        fn = _source_fn(cls)
        body = fn.body if fn else []
        ret = body[-1] if body and isinstance(body[-1], ast.Return) else None
        value = ret.value if ret is not None else None
        if isinstance(value, ast.Tuple) and value.elts:
            value = value.elts[0]
        if isinstance(value, ast.Name):
            for stmt in reversed(body[:-1]):
                if _stores(stmt, value.id):
                    bound = _bound_from_child(stmt, children)
                    _RETURNED[key] = bound[1] if bound and bound[0] == value.id else None
                    break
    return _RETURNED[key]


def _hands_off(module: nn.Module) -> bool:
    return getattr(type(module).forward, "_addnorm_handoff", False)


def _children(module: nn.Module, original: dict[nn.Module, type]) -> set[str]:
    """Names of ``module``'s children that are transformers modules (those patched: by their original class)."""
    return {n for n, c in module.named_children() if original.get(c, type(c)).__module__.startswith("transformers.")}


def _sequences(model: nn.Module):
    """(owner, name, layers) of each non-empty ModuleList/Sequential of ``model``."""
    for owner in model.modules():
        for name, seq in owner.named_children():
            if isinstance(seq, (nn.ModuleList, nn.Sequential)) and len(seq):
                yield owner, name, list(seq)


def producers(model: nn.Module, original: dict[nn.Module, type]) -> list[nn.Module]:
    """The transformers child modules, not patched yet, whose sum a norm reads next (see the module docstring):
    what ``hf.apply`` rewrites to hand off their returned add."""
    found: dict[int, nn.Module] = {}
    for owner in model.modules():
        norms = _norms(owner)
        if norms:
            for child, _ in children_into_norms(original.get(owner, type(owner)), _children(owner, original), norms):
                found[id(getattr(owner, child))] = getattr(owner, child)
    for _, _, layers in _sequences(model):
        for layer in layers:
            child = (
                None
                if _hands_off(layer)
                else returned_child(original.get(layer, type(layer)), _children(layer, original))
            )
            if child is not None:
                found[id(getattr(layer, child))] = getattr(layer, child)
    return [m for m in found.values() if m not in original]


def _connect(linked: list, producer: nn.Module, norm: nn.Module, **between) -> None:
    cls = type(norm)
    if not isinstance(norm, _Consumer):
        norm.__class__ = _consumer_class(cls)
    # in __dict__: a Module set as an attribute would become a child
    producer.__dict__[_NEXT] = Link(norm=norm, **between)
    linked.append((producer, norm, cls))


def link(model: nn.Module, original: dict[nn.Module, type]) -> list[tuple[nn.Module, nn.Module, type]]:
    """Links each producer of ``model`` (a module whose forward hands off its returned add, or a norm a rewritten
    forward names as its own site) to the norm that reads the sum next (the module docstring). ``original`` maps
    patched modules to their transformers class (whose source is read). Returns (producer, norm, the norm's class)
    for :func:`unlink`."""
    linked: list = []
    for owner in model.modules():
        for attr in getattr(type(owner).forward, "_addnorm_norm_sites", ()):
            norm = getattr(owner, attr)
            _connect(linked, norm, norm, post=(), pre=(norm,), checkpointed=(owner,))
        norms = _norms(owner)
        if norms:
            for child, attr in children_into_norms(original.get(owner, type(owner)), _children(owner, original), norms):
                producer, norm = getattr(owner, child), getattr(owner, attr)
                if _hands_off(producer):
                    _connect(linked, producer, norm, post=(producer,), pre=(norm,), checkpointed=(owner,))
    for owner, seq_name, layers in _sequences(model):
        pairs = [
            (layer, nxt, input_norm(original.get(nxt, type(nxt)), _norms(nxt)))
            for layer, nxt in zip(layers, layers[1:])
        ]
        pairs.append((layers[-1], owner, final_norm(original.get(owner, type(owner)), seq_name, _norms(owner))))
        for layer, nxt, attr in pairs:
            if attr is None:
                continue
            norm = getattr(nxt, attr)
            pre = (norm,) if nxt is owner else (nxt, norm)
            if _hands_off(layer):
                _connect(linked, layer, norm, post=(layer,), pre=pre, checkpointed=(layer, nxt))
                continue
            child = returned_child(original.get(layer, type(layer)), _children(layer, original))
            producer = getattr(layer, child) if child is not None else None
            if producer is not None and _hands_off(producer):
                _connect(linked, producer, norm, post=(producer, layer), pre=pre, checkpointed=(layer, nxt))
    return linked


def unlink(linked: list[tuple[nn.Module, nn.Module, type]]) -> None:
    for producer, norm, cls in reversed(linked):
        producer.__dict__.pop(_NEXT, None)
        norm.__dict__.pop(_READY, None)
        norm.__class__ = cls
