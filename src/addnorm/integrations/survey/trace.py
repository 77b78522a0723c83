"""Where a model's norms sit relative to its residual adds, read from the dataflow of one forward.

Forward hooks mark each call of a layer of the model's stacks and of each norm module (what :mod:`norm_probe`
recognises, or a leaf whose class says "Norm"); a ``TorchDispatchMode`` records every aten op in between, with the
tensors it read and wrote. Per layer call, the *stream* starts as the layer's input; an add of two stream-shaped
tensors one of which is the stream (or a view, cast or scalar multiple of it: ``alias``) is a residual add, and its
output is the next version of the stream. Each residual add (a *sublayer*) is then labelled from what fed it:

    pre            the branch depends on a norm that read the stream version it is added to     x + F(N(x))
    post           the stream is normalized right after the add (the next add, or the layer's output, reads
                   the norm's output)                                                             N(x + F(x))
    branch-output  the branch operand is itself a norm's output                                    x + N(F(x))
    sandwich       pre and branch-output                                                           x + N2(F(N1(x)))
    parallel       the branch does not read the stream version it is added to (it read an earlier one with
                   another branch), or is the sum of an attention branch and another one           x + F(N(x)) + G(N(x))
    none           no norm involved
    unknown        the branch reads no stream version at all: its dataflow left the recorded ops (a value
                   that went through numpy or a kernel outside PyTorch's dispatcher), so nothing can be said

A layer whose sublayers differ (Mix-LN style, or pre for attention and post for the MLP) is ``mixed``, one with an
``unknown`` sublayer is ``unknown``. Residual
scaling is a scalar multiple on the skip operand (``skip*a``) or the branch (``branch*b``); a vector multiple of the
branch (LayerScale) is ``branch*vector``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from addnorm.integrations.hf import norm_probe

# ops that pass a tensor through unchanged in value (up to shape or dtype): the stream keeps its identity
_ALIAS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "clone",
        "contiguous",
        "_to_copy",
        "to",
        "detach",
        "alias",
        "lift_fresh",
        "expand",
        "squeeze",
        "unsqueeze",
        "flatten",
        "view_as",
        "_reshape_alias",
        "copy",
    }
)
_ADDS = frozenset({"add", "add_"})
_MULS = frozenset({"mul", "mul_", "div", "div_"})
_SCORES = frozenset(
    {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "scaled_dot_product_attention",
        "_scaled_dot_product_attention_math",
        "bmm",
        "matmul",
        "baddbmm",
        "einsum",
    }
)


def _op_name(func) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


@dataclass
class _Event:
    kind: str  # "op" | "norm" | "block-start" | "block-end"
    name: str = ""
    inputs: list = field(default_factory=list)  # tensors (op: tensor args; norm: [input])
    outputs: list = field(default_factory=list)
    scalars: list = field(default_factory=list)  # non-tensor args of an op
    ref: Any = None  # norm: its path; block: (stack index, layer index)


class _Recorder(TorchDispatchMode):
    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.active = 0  # inside a block
        self.muted = 0  # inside a norm module

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active and not self.muted:
            tensors = _tensors_in(args) + _tensors_in((kwargs or {}).values())
            scalars = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, Tensor)]
            if _op_name(func) in ("add_", "mul_", "div_", "copy_"):  # in place: the result is the first argument
                outs = tensors[:1]
            self.events.append(_Event("op", _op_name(func), tensors, outs, scalars))
        return out


def _tensors_in(values) -> list[Tensor]:
    """The tensors among an op's arguments, in order, including those inside lists (``cat``, ``stack`` and
    ``index_put`` take theirs as one list argument: a branch that runs through one must keep its dependencies, or it
    reads as not depending on the stream: transformers 5.25's reference selective scan ends in a ``stack``)."""
    found: list[Tensor] = []
    for a in values:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += [t for t in a if isinstance(t, Tensor)]
    return found


def _first_input(args: tuple, kwargs: dict) -> Tensor | None:
    for a in args:
        if isinstance(a, Tensor) and a.is_floating_point():
            return a
    h = kwargs.get("hidden_states")
    if isinstance(h, Tensor):
        return h
    for v in kwargs.values():
        if isinstance(v, Tensor) and v.is_floating_point():
            return v
    return None


def _first_output(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, Tensor)), None)
    if isinstance(out, dict):
        return next((o for o in out.values() if isinstance(o, Tensor)), None)
    return None


def find_stacks(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The model's layer stacks: ModuleLists of >= 2 modules of one class that have submodules, outermost first (a
    list inside a found stack's layers, e.g. MoE experts, is not a stack)."""
    stacks: list[tuple[str, list[nn.Module]]] = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1 or next(children[0].children(), None) is None:
            continue
        if any(path.startswith(p + ".") for p, _ in stacks):
            continue
        stacks.append((path, children))
    return stacks


@dataclass(kw_only=True)
class Norms:
    """The norm modules of a model: path -> NormInfo (None for a "Norm" leaf that computes something else)."""

    info: dict[str, norm_probe.NormInfo | None]
    modules: dict[str, nn.Module]


def find_norms(model: nn.Module) -> Norms:
    from addnorm.diagnostics.blocks import is_norm_module

    info, modules = {}, {}
    for path, m in model.named_modules():
        if not path:
            continue
        probed = norm_probe.probe(m) if norm_probe.is_candidate(m) else None
        if probed is not None or (is_norm_module(m) and not isinstance(m, nn.modules.batchnorm._NormBase)):
            info[path], modules[path] = probed, m
    return Norms(info=info, modules=modules)


def record(model: nn.Module, batch: dict, stacks, norms: Norms) -> list[_Event]:
    """Run ``model(**batch)`` once with the hooks and the recorder on; the events in order."""
    events: list[_Event] = []
    rec = _Recorder(events)
    handles = []

    def block_hooks(si, li):
        def pre(module, args, kwargs):
            rec.active += 1
            events.append(_Event("block-start", inputs=[_first_input(args, kwargs)], ref=(si, li)))

        def post(module, args, kwargs, out):
            events.append(_Event("block-end", outputs=[_first_output(out)], ref=(si, li)))
            rec.active -= 1

        return pre, post

    def norm_hooks(path):
        def pre(module, args, kwargs):
            rec.muted += 1

        def post(module, args, kwargs, out):
            rec.muted -= 1
            events.append(_Event("norm", inputs=[_first_input(args, kwargs)], outputs=[_first_output(out)], ref=path))

        return pre, post

    for si, (_, layers) in enumerate(stacks):
        for li, layer in enumerate(layers):
            pre, post = block_hooks(si, li)
            handles += [
                layer.register_forward_pre_hook(pre, with_kwargs=True),
                layer.register_forward_hook(post, with_kwargs=True),
            ]
    for path, m in norms.modules.items():
        pre, post = norm_hooks(path)
        handles += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad(), rec:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return events


@dataclass(kw_only=True)
class Sublayer:
    """One residual add of a layer and what fed it."""

    pre: bool = False  # the branch read a norm of the stream version it is added to
    post: bool = False  # the stream is normalized right after this add
    branch_norm: bool = False  # the branch operand is a norm's output
    parallel: bool = False
    untraced: bool = False  # the branch depends on no stream version: its dataflow was lost, not parallel
    skip_scale: float | None = None
    branch_scale: float | str | None = None  # a scalar, or "vector" (LayerScale)
    stream_norms: list = field(default_factory=list)  # paths of the norms that read the stream for this branch
    branch_norms: list = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.untraced:
            return "unknown"
        if self.parallel:
            return "parallel"
        if self.pre and self.post:
            return "pre+post"
        if self.pre and self.branch_norm:
            return "sandwich"
        if self.pre:
            return "pre"
        if self.post:
            return "post"
        if self.branch_norm:
            return "branch-output"
        return "none"


@dataclass(kw_only=True)
class LayerTrace:
    stack: int
    index: int
    width: int | None
    sublayers: list[Sublayer]
    qk_norms: list[str]  # norms that feed attention scores without reading the stream

    @property
    def label(self) -> str:
        labels = [s.label for s in self.sublayers]
        if not labels or "unknown" in labels:
            return "unknown"
        if "parallel" in labels:
            return "parallel"
        return labels[0] if len(set(labels)) == 1 else "mixed"


def analyse(events: list[_Event]) -> list[LayerTrace]:
    """Label every layer call in ``events`` (see the module docstring)."""
    layers: list[LayerTrace] = []
    i = 0
    while i < len(events):
        e = events[i]
        if e.kind == "block-start":
            depth, j = 0, i
            while j < len(events):  # the matching block-end (layers do not nest within one stack, but stacks may)
                if events[j].kind == "block-start":
                    depth += 1
                elif events[j].kind == "block-end":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if events[i + 1 : j] and all(ev.kind != "block-start" for ev in events[i + 1 : j]):
                layers.append(_analyse_layer(events[i : j + 1]))
            i += 1
            continue
        i += 1
    return layers


def _analyse_layer(events: list[_Event]) -> LayerTrace:
    start, end = events[0], events[-1]
    x0 = start.inputs[0]
    stack, index = start.ref
    if x0 is None:
        return LayerTrace(stack=stack, index=index, width=None, sublayers=[], qk_norms=[])
    alias: dict[int, tuple[int, float | str]] = {id(x0): (id(x0), 1.0)}  # tensor -> (root tensor, scale)
    deps: dict[int, frozenset] = {id(x0): frozenset({("v", 0)})}
    norm_of: dict[int, tuple[str, int | None]] = {}  # norm output root -> (path, stream version it read or None)
    versions = [id(x0)]  # root tensor of each stream version
    sums: set[int] = set()  # tensors that are the sum of two branches
    subs: list[Sublayer] = []
    stream_reads: dict[int, list[str]] = {}  # version -> norms that read it
    inner_norms: list[str] = []
    score_norms: set[str] = set()

    def root(t):
        return alias.get(id(t), (id(t), 1.0))

    def version_of(t) -> int | None:
        r, _ = root(t)
        return versions.index(r) if r in versions else None

    for e in events[1:-1]:
        tensors = [t for t in e.inputs if isinstance(t, Tensor)]
        dep = frozenset().union(*(deps.get(id(t), frozenset()) for t in tensors)) if tensors else frozenset()
        if e.kind == "norm":
            x, y = e.inputs[0], e.outputs[0]
            if x is None or y is None:
                continue
            v = version_of(x)
            if v is not None:
                stream_reads.setdefault(v, []).append(e.ref)
            else:
                inner_norms.append(e.ref)
            norm_of[id(y)] = (e.ref, v)
            deps[id(y)] = dep | {("n", e.ref, v)}
            continue
        if e.name in _SCORES:  # attention scores: marks what an attention branch computed at this stream version
            dep = dep | {("s", len(versions) - 1)}
        for o in e.outputs:
            deps[id(o)] = dep
        if e.name in _SCORES:
            for t in tensors[:2]:
                score_norms.update(
                    n for kind, *rest in deps.get(id(t), ()) if kind == "n" and rest[1] is None for n in [rest[0]]
                )
        if not tensors or not e.outputs:
            continue
        out = e.outputs[0]
        if e.name in _ALIAS and tensors[0].shape[-1:] == out.shape[-1:]:
            r, s = root(tensors[0])
            alias[id(out)] = (r, s)
            if id(tensors[0]) in norm_of:
                norm_of[id(out)] = norm_of[id(tensors[0])]
            if id(tensors[0]) in sums:
                sums.add(id(out))
            continue
        if e.name in _MULS and len(tensors) <= 2:
            big = max(tensors, key=lambda t: t.numel())
            small = [t for t in tensors if t is not big]
            if big.shape == out.shape:
                if not small and e.scalars:
                    factor: float | str = float(e.scalars[0])
                elif small and small[0].numel() == 1:
                    factor = float(small[0].double().item())
                elif small and small[0].dim() == 1 and small[0].shape[0] == out.shape[-1]:
                    factor = "vector"
                else:
                    continue
                if e.name.startswith("div") and isinstance(factor, float) and factor:
                    factor = 1.0 / factor
                r, s = root(big)
                alias[id(out)] = (r, factor if s == 1.0 else "vector" if "vector" in (s, factor) else s * factor)
                if id(big) in norm_of:
                    norm_of[id(out)] = norm_of[id(big)]
            continue
        if (
            e.name in _ADDS
            and len(tensors) == 2
            and tensors[0].shape == tensors[1].shape == out.shape
            and out.shape == x0.shape
        ):
            a, b = tensors
            cur = len(versions) - 1
            va, vb = version_of(a), version_of(b)
            na, nb = norm_of.get(root(a)[0]) or norm_of.get(id(a)), norm_of.get(root(b)[0]) or norm_of.get(id(b))
            # the skip operand: the current stream raw, or its norm (the previous sublayer was post-norm)
            if va == cur and vb != cur:
                skip, branch, skip_normed = a, b, False
            elif vb == cur and va != cur:
                skip, branch, skip_normed = b, a, False
            elif na is not None and na[1] == cur and not (nb is not None and nb[1] == cur):
                skip, branch, skip_normed = a, b, True
            elif nb is not None and nb[1] == cur and not (na is not None and na[1] == cur):
                skip, branch, skip_normed = b, a, True
            else:
                # two branches summed before they meet the stream, one of them attention at this stream version
                # and the other not (GPT-J's attn(h) + mlp(h)); a sum inside one branch (MoE routed + shared
                # experts, a bias) is not parallel
                sa, sb = (("s", cur) in deps.get(id(t), frozenset()) for t in (a, b))
                both = all(("v", cur) in deps.get(id(t), frozenset()) for t in (a, b))
                if va is None and vb is None and both and sa != sb:
                    sums.add(id(out))
                continue
            if skip_normed and subs:
                subs[-1].post = True
            sub = Sublayer()
            sk = root(skip)[1]
            sub.skip_scale = sk if sk != 1.0 else None
            br_root, br_scale = root(branch)
            sub.branch_scale = br_scale if br_scale != 1.0 else None
            bdeps = deps.get(id(branch), frozenset())
            read = [n for kind, *rest in bdeps if kind == "n" and rest[1] == cur for n in [rest[0]]]
            sub.pre = bool(read) and not skip_normed
            sub.stream_norms = sorted(set(read))
            bn = norm_of.get(br_root) or norm_of.get(id(branch))
            if bn is not None and bn[1] is None:
                sub.branch_norm, sub.branch_norms = True, [bn[0]]
            sub.parallel = ("v", cur) not in bdeps or br_root in sums or id(branch) in sums
            sub.untraced = not any(k == "v" for k, *_ in bdeps)
            if skip_normed:  # a post-norm layer: the branch read the normalized stream, not a norm of its own
                sub.parallel = sub.parallel and not any(k == "n" and r[1] == cur for k, *r in bdeps)
            subs.append(sub)
            versions.append(id(out))
            alias[id(out)] = (id(out), 1.0)
            deps[id(out)] = dep | {("v", cur + 1)}
    y = end.outputs[0] if end.outputs else None
    if y is not None and subs:
        ny = norm_of.get(root(y)[0]) or norm_of.get(id(y))
        if ny is not None and ny[1] == len(versions) - 1:
            subs[-1].post = True
    qk = sorted(n for n in set(inner_norms) & score_norms)
    return LayerTrace(stack=stack, index=index, width=int(x0.shape[-1]), sublayers=subs, qk_norms=qk)
