"""The add that ends a layer, fused with the norm that starts the next one: the handoff.

A parallel block (GPT-NeoX, Phi, Cohere, GPT-J: ``x + attn(N(x)) + mlp(N(x))``) and a one-mixer block (Nemotron-H:
``x + mixer(N(x))``) have no add next to a norm inside the layer: the norm that reads the sum is the next layer's
input norm. :mod:`addnorm.integrations.hf_rewrite` makes the add a layer returns a call of :func:`add_handoff`:

    hidden_states = a + b          ->   hidden_states = add_handoff(self, a, b)
    return hidden_states                return hidden_states

:func:`link` (called by ``hf.apply``) gives each such layer of a ``ModuleList`` the input norm of the layer after it.
A linked layer computes ``n, s = norm(a, b)`` in one fused call, returns the sum ``s`` (the tensor it returned
before: the next layer, hooks and hidden-state outputs see what they saw) and leaves ``n`` with the norm. When the
next layer calls that norm on ``s``, it returns ``n`` instead of normalizing again.

The norm hands ``n`` back only for the very tensor it was computed from, unmodified since (its version counter), with
its own weight and bias unmodified, under the same grad mode; anything else (another tensor, a hook that returned a
new one, an in-place change) is normalized as usual. Inference tensors have no version counter: under
``torch.inference_mode`` the handoff is made only when no forward hook could change the sum in place (none on the
layer, no pre-hook on the next one, no global hook). Not made: under ``torch.compile`` (the handoff is state kept
between two module calls; the compiled model runs the plain add) and with gradient checkpointing on either layer
(the recomputed forward must save what the first one saved).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = ["add_handoff", "final_norm", "fusable", "fused_runs", "input_norm", "link", "rewrite_tail", "unlink"]

_NEXT = "_addnorm_next"  # on a producing layer: (the next layer's input norm, the next layer)
_READY = "_addnorm_ready"  # on a consuming norm: (weakref to the sum, its state, the normalized sum)
_HANDOFF = "_addnorm_add_handoff"  # the name rewritten forwards call add_handoff by

# Fused calls made by rewritten forwards so far (hf_rewrite's add_norm and norm_add count here too). A rewrite may
# fuse a branch the model never takes (GPT-NeoX's use_parallel_residual=False, when its default is True): the
# survey and the tests count a rewritten layer as fused only when this moved during its forward.
_FUSED_RUNS = [0]


def fused_runs() -> int:
    """How many fused calls the rewritten forwards have made in this process (compare two readings)."""
    return _FUSED_RUNS[0]


def fusable(norm: nn.Module, a: Tensor, b: Tensor) -> bool:
    """Whether ``norm(a, b)`` computes ``norm(a + b)`` and ``a + b`` as written: an addnorm norm, operands of one
    dtype and shape (HF's dtype promotion and broadcasting are kept by the unfused add)."""
    return (
        isinstance(norm, (LayerNorm, RMSNorm))
        and isinstance(a, Tensor)
        and isinstance(b, Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
    )


def _version(t: Tensor | None):
    return None if t is None or t.is_inference() else t._version


def _state(norm: nn.Module, s: Tensor) -> tuple:
    """What must not have changed between the fused call and the norm's own call for ``n`` to be its output."""
    params = norm._parameters  # not getattr: nn.Module's attribute lookup costs microseconds per call
    w, b = params.get("weight"), params.get("bias")
    return (_version(s), w, _version(w), b, _version(b), torch.is_grad_enabled())


class _Consumer:
    """Mixin of a norm that may find its output computed already (by the layer before, in one fused call)."""

    def forward(self, x: Tensor, residual: Tensor | None = None):
        ready = None if torch.compiler.is_compiling() else self.__dict__.get(_READY)
        if ready is not None:
            self.__dict__[_READY] = None  # used once, and no tensor held past the call that reads it
            ref, state, n = ready
            if residual is None and ref() is x and _state(self, x) == state:
                return n
        return super().forward(x, residual)

    def __getstate__(self):
        state = super().__getstate__().copy()
        state[_READY] = None  # a weakref neither copies nor pickles; what it pointed to is gone in a copy anyway
        return state


_CONSUMERS: dict[type, type] = {}


def _consumer_class(cls: type) -> type:
    """A subclass of the norm class ``cls`` with :class:`_Consumer`'s forward, kept here by name (models pickle)."""
    if cls not in _CONSUMERS:
        name = f"AddNormHandoff{cls.__name__}"
        sub = type(name, (_Consumer, cls), {"__module__": __name__, "__qualname__": name, "_addnorm_base": cls})
        globals()[name] = sub
        _CONSUMERS[cls] = sub
    return _CONSUMERS[cls]


def _hooked(layer: nn.Module, nxt: nn.Module) -> bool:
    return bool(
        layer._forward_hooks
        or nxt._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def add_handoff(layer: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``a + b``; where :func:`link` linked ``layer`` to the next layer's input norm, in one fused call with that
    norm, whose output the norm then returns when called on this sum (see the module docstring)."""
    if torch.compiler.is_compiling():
        return a + b
    found = layer.__dict__.get(_NEXT)
    if found is None:
        return a + b
    norm, nxt = found
    if (
        not fusable(norm, a, b)
        or (
            torch.is_grad_enabled()
            and (getattr(layer, "gradient_checkpointing", False) or getattr(nxt, "gradient_checkpointing", False))
        )
        or (a.is_inference() and _hooked(layer, nxt))
    ):
        return a + b
    n, s = super(_Consumer, norm).forward(a, b)  # the norm's own fused call; its hooks run when the next layer calls it
    norm.__dict__[_READY] = (weakref.ref(s), _state(norm, s), n)
    _FUSED_RUNS[0] += 1
    return s


# --------------------------------------------------------------------------------------------------------------
# Rewriting: the adds a forward returns
# --------------------------------------------------------------------------------------------------------------


def _returned_name(stmt) -> str | None:
    """``t`` of ``return t`` or ``return t, ...``."""
    if not isinstance(stmt, ast.Return) or stmt.value is None:
        return None
    value = stmt.value.elts[0] if isinstance(stmt.value, ast.Tuple) and stmt.value.elts else stmt.value
    return value.id if isinstance(value, ast.Name) else None


def _handoff_call(add: ast.BinOp) -> ast.Call:
    return ast.Call(
        func=ast.Name(_HANDOFF, ast.Load()),
        args=[ast.Name("self", ast.Load()), add.left, add.right],
        keywords=[],
    )


def _is_add(node) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)


def _tail(block: list[ast.stmt], name: str) -> int:
    """Rewrites the last statement of ``block`` if it binds ``name`` to an add (or, an ``if``/``else``, the last of
    each branch); returns how many adds it rewrote."""
    if not block:
        return 0
    last = block[-1]
    if isinstance(last, ast.If) and last.orelse:
        return _tail(last.body, name) + _tail(last.orelse, name)
    if (
        isinstance(last, ast.Assign)
        and len(last.targets) == 1
        and isinstance(last.targets[0], ast.Name)
        and last.targets[0].id == name
        and _is_add(last.value)
    ):
        last.value = _handoff_call(last.value)
        return 1
    return 0


def rewrite_tail(fn: ast.FunctionDef) -> int:
    """Makes the add ``fn`` returns (``return a + b``, or ``t = a + b`` as the last binding of a returned ``t``,
    in each branch of a final ``if``/``else``) a call of :func:`add_handoff`; returns how many it rewrote."""
    body = fn.body
    if not body or not isinstance(body[-1], ast.Return):
        return 0
    ret = body[-1]
    if _is_add(ret.value):
        ret.value = _handoff_call(ret.value)
        return 1
    name = _returned_name(ret)
    return _tail(body[:-1], name) if name else 0


# --------------------------------------------------------------------------------------------------------------
# Linking each layer to the next one's input norm
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


def link(model: nn.Module, original: dict[nn.Module, type]) -> list[tuple[nn.Module, nn.Module, type]]:
    """Links each layer whose forward hands off (a rewritten one) to the input norm of the layer after it in the
    same ``ModuleList``/``Sequential``, and the last one to the norm the list's owner applies after its loop over
    them. ``original`` maps patched layers to their transformers class (whose source names the input norm).
    Returns (layer, norm, the norm's class) for :func:`unlink`."""
    linked = []
    for owner in model.modules():
        for seq_name, seq in owner.named_children():
            if not isinstance(seq, (nn.ModuleList, nn.Sequential)) or not len(seq):
                continue
            layers = list(seq)
            pairs = [
                (layer, nxt, input_norm(original.get(nxt, type(nxt)), _norms(nxt)))
                for layer, nxt in zip(layers, layers[1:])
            ]
            pairs.append((layers[-1], owner, final_norm(original.get(owner, type(owner)), seq_name, _norms(owner))))
            for layer, nxt, attr in pairs:
                if attr is None or not getattr(type(layer).forward, "_addnorm_handoff", False):
                    continue
                norm = getattr(nxt, attr)
                cls = type(norm)
                if not isinstance(norm, _Consumer):
                    norm.__class__ = _consumer_class(cls)
                layer.__dict__[_NEXT] = (norm, nxt)  # in __dict__: a Module set as an attribute would become a child
                linked.append((layer, norm, cls))
    return linked


def unlink(linked: list[tuple[nn.Module, nn.Module, type]]) -> None:
    for layer, norm, cls in reversed(linked):
        layer.__dict__.pop(_NEXT, None)
        norm.__dict__.pop(_READY, None)
        norm.__class__ = cls
