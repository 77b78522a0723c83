"""The add that ends a layer, fused with the norm that starts the next one: the handoff.

A parallel block (GPT-NeoX, Phi, Cohere, GPT-J: ``x + attn(N(x)) + mlp(N(x))``), a one-mixer block (Nemotron-H:
``x + mixer(N(x))``) and a pre-norm layer's MLP add (Llama: ``h + mlp(N2(h))``) have no norm after their last add
inside the layer: the norm that reads the sum is the next layer's input norm. The layer's forward (a template of
:mod:`addnorm.integrations.hf.forwards`, or rewritten by :mod:`addnorm.integrations.hf.rewrite`) makes the add it
returns a call of :func:`add_handoff`:

    hidden_states = a + b          ->   hidden_states = add_handoff(self, a, b)
    return hidden_states                return hidden_states

:func:`addnorm.integrations.hf.links.link` (called by ``hf.apply``) gives each such producer the norm that reads
its sum next (a :class:`Link`): the input norm of the layer after it, the norm after the loop over the layers, or a
norm of the parent (BLOOM, whose attention and MLP modules make the adds). A linked producer computes ``n, s =
norm(a, b)`` in one fused call, returns the sum ``s`` (the tensor it returned before: the next layer, hooks and
hidden-state outputs see what they saw) and leaves ``n`` with the norm. When that norm is called on ``s``, it
returns ``n`` instead of normalizing again.

The norm hands ``n`` back only for the very tensor it was computed from, unmodified since (its version counter), with
its own weight and bias unmodified, under the same grad mode; anything else (another tensor, a hook that returned a
new one, an in-place change) is normalized as usual. Inference tensors have no version counter: under
``torch.inference_mode`` the handoff is made only when no hook could change the sum in place on its way (no forward
hook on the modules that return it, no pre-hook on those it is passed into, no global hook). Not made: under
``torch.compile`` (the handoff is state kept between two module calls; the compiled model runs the plain add) and
with gradient checkpointing on a layer on either side (the recomputed forward must save what the first one saved).
"""

from __future__ import annotations

import ast
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = ["Link", "add_handoff", "count_fused_run", "fusable", "fused_ops", "fused_runs", "rewrite_tail"]

_NEXT = "_addnorm_next"  # on a producer (a layer, a child, a norm that is its own site): its Link
_READY = "_addnorm_ready"  # on a consuming norm: (weakref to the sum, its state, the normalized sum)
_HANDOFF = "_addnorm_add_handoff"  # the name rewritten forwards call add_handoff by

# Fused calls made by patched forwards so far, in all and per op (rewrite.py's add_norm, chain.py's norm_add and
# norm_add_norm, the templates' norm(a, b) count here too). A rewrite may fuse a branch the model never takes
# (GPT-NeoX's use_parallel_residual=False, when its default is True): the survey and the tests count a rewritten
# layer as fused only when this moved during its forward, and read which ops ran from the per-op counts.
_FUSED_RUNS = [0]
_FUSED_OPS = {"add_norm": 0, "norm_add": 0, "norm_add_norm": 0}
FUSED_OPS = tuple(_FUSED_OPS)  # the op names, in the order the survey lists them


def fused_runs() -> int:
    """How many fused calls the patched forwards have made in this process (compare two readings)."""
    return _FUSED_RUNS[0]


def fused_ops() -> dict[str, int]:
    """How many fused calls of each op (``add_norm``: norm(a + b); ``norm_add``: a + norm(y); ``norm_add_norm``:
    the chain of :mod:`addnorm.integrations.hf.chain`) the patched forwards have made in this process."""
    return dict(_FUSED_OPS)


def count_fused_run(op: str = "add_norm") -> None:
    """One more fused call of ``op`` (one of :data:`FUSED_OPS`) made by a patched forward (the one writer of the
    counts :func:`fused_runs` and :func:`fused_ops` read)."""
    _FUSED_RUNS[0] += 1
    _FUSED_OPS[op] += 1


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
    # ask first: reading ._version of an inference tensor raises a c10::Error whose backtrace costs 10-40 us (more
    # the deeper the Python stack), which under inference_mode made every handoff cost more than the add it saves
    return None if t is None or t.is_inference() else t._version


def _state(norm: nn.Module, s: Tensor) -> tuple:
    """What must not have changed between the fused call and the norm's own call for ``n`` to be its output.
    Runs twice per handoff, on every layer of a decode step: no exception on any path (see :func:`_version`)."""
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

    def __reduce_ex__(self, protocol):
        # by the class it was made from, not by this class's name: a process that unpickles the model may never
        # have run apply, so AddNormHandoff<Name> does not exist there until _consumer_class makes it
        return _restore_consumer, (type(self)._addnorm_base,), self.__getstate__()


_CONSUMERS: dict[type, type] = {}


def _consumer_class(cls: type) -> type:
    """A subclass of the norm class ``cls`` with :class:`_Consumer`'s forward, kept here by name (models pickle)."""
    if cls not in _CONSUMERS:
        name = f"AddNormHandoff{cls.__name__}"
        sub = type(name, (_Consumer, cls), {"__module__": __name__, "__qualname__": name, "_addnorm_base": cls})
        globals()[name] = sub
        _CONSUMERS[cls] = sub
    return _CONSUMERS[cls]


def _restore_consumer(base: type) -> nn.Module:
    """Unpickling a handoff norm: an empty instance of its class (remade here if need be); pickle sets its state."""
    return object.__new__(_consumer_class(base))


def _hooked(post: tuple[nn.Module, ...], pre: tuple[nn.Module, ...]) -> bool:
    """Whether a hook runs between the fused call and the norm's: a forward hook of a module the sum is returned
    from (``post``), a pre-hook of one it is passed into (``pre``), or a global hook."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    for m in post:
        if m._forward_hooks:
            return True
    for m in pre:
        if m._forward_pre_hooks:
            return True
    return False


def _checkpointed(modules: tuple[nn.Module, ...]) -> bool:
    for m in modules:
        # transformers' GradientCheckpointingLayer keeps the flag in __dict__; nn.Module's getattr of a missing
        # attribute raises and catches an AttributeError, microseconds per call
        if m.__dict__.get("gradient_checkpointing", False):
            return True
    return False


class Link(NamedTuple):
    """Where a producer's returned add is normalized next, and what may come in between.

    ``post``: the modules the sum is returned from on its way (the producer, and a layer that returns the
    producer's output as its own); ``pre``: those it is passed into before the norm reads it (the next layer, the
    norm); ``checkpointed``: the layers whose gradient checkpointing would recompute one side alone."""

    norm: nn.Module
    post: tuple[nn.Module, ...]
    pre: tuple[nn.Module, ...]
    checkpointed: tuple[nn.Module, ...]


def add_handoff(layer: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``a + b``; where :func:`addnorm.integrations.hf.links.link` linked ``layer`` (a layer, a child module, or a
    norm that is its own site) to a norm, in one fused call with that norm, whose output the norm then returns when
    called on this sum (see the module docstring)."""
    if torch.compiler.is_compiling():
        return a + b
    found: Link | None = layer.__dict__.get(_NEXT)
    if found is None:
        return a + b
    norm = found.norm  # an addnorm norm (link only links those): the operands are what is left to check
    if (
        not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape)
        or (torch.is_grad_enabled() and _checkpointed(found.checkpointed))
        or (_hooked(found.post, found.pre) and a.is_inference())
    ):
        return a + b
    n, s = super(_Consumer, norm).forward(a, b)  # the norm's own fused call; its hooks run when the next layer calls it
    norm.__dict__[_READY] = (weakref.ref(s), _state(norm, s), n)
    count_fused_run()
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


def _handoff_call(add: ast.BinOp, site: str = "self") -> ast.Call:
    return ast.Call(
        func=ast.Name(_HANDOFF, ast.Load()),
        args=[ast.Name(site, ast.Load()), add.left, add.right],
        keywords=[],
    )


def _is_add(node) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)


def _tail(block: list[ast.stmt], name: str, site: str, call) -> int:
    """Rewrites the last statement of ``block`` if it binds ``name`` to an add (or, an ``if``, the last of each
    branch: where a branch without ``else`` is not taken, nothing is handed off and the norm normalizes as usual);
    ``call(node, site)``, when given, may rewrite a call ``name`` is bound to (a helper that makes the add).
    Returns how many adds it rewrote."""
    if not block:
        return 0
    last = block[-1]
    if isinstance(last, ast.If):
        return _tail(last.body, name, site, call) + _tail(last.orelse, name, site, call)
    if not (
        isinstance(last, ast.Assign)
        and len(last.targets) == 1
        and isinstance(last.targets[0], ast.Name)
        and last.targets[0].id == name
    ):
        return 0
    if _is_add(last.value):
        last.value = _handoff_call(last.value, site)
        return 1
    if call is not None and isinstance(last.value, ast.Call):
        return call(last.value, site)
    return 0


def rewrite_tail(fn: ast.FunctionDef, site: str = "self", call=None) -> int:
    """Makes the add ``fn`` returns (``return a + b``, or ``t = a + b`` as the last binding of a returned ``t``,
    in each branch of a final ``if``) a call of :func:`add_handoff` with ``site`` (the name of the module, or norm,
    linked to the norm that reads the sum); returns how many it rewrote. ``call``: see :func:`_tail`."""
    body = fn.body
    if not body or not isinstance(body[-1], ast.Return):
        return 0
    ret = body[-1]
    if _is_add(ret.value):
        ret.value = _handoff_call(ret.value, site)
        return 1
    name = _returned_name(ret)
    return _tail(body[:-1], name, site, call) if name else 0
