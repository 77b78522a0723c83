"""Fused forwards written from a layer's own forward: its source parsed, each residual add next to a norm rewritten
into one addnorm call, and compiled back with the original's globals and decorators.

The templates of :mod:`addnorm.integrations.hf.layer_match` need a forward written line for line like Llama's. Many
families put the same add next to the same norm in a forward of their own shape (dropout before the add, a scaled
branch, a cross-attention block in between, an ``if`` choosing pre- or post-norm, the norm nested in the MLP's call).
This module rewrites the statements themselves, so whatever else the forward does stays exactly as written:

    add, then norm      t = a + b                    ->   n, t = add_norm(self.norm, a, b)    # n = norm(a + b)
                        [r = t; s = t.shape; ...]         [r = t; s = t.shape; ...]
                        ... self.norm(t) ...              ... n ...
    norm, then add      t = self.norm(y)             ->   t = norm_add(self.norm, y, a)       # a + norm(y)
                        t = a + t
    ... then a norm     t = self.post(y); t = a + t  ->   n, t = norm_add_norm(self.post, self.pre, y, a)
                        ... self.pre(t) ...               ... n ...    # the sandwich chain (hf/chain.py)

Between the add and the norm may come aliases (``residual = t``), shape reads (``s = t.shape``) and the
row-preserving reshape ``t = t.reshape(-1, t.size(-1))`` (a row-wise norm commutes with it: ``n`` is reshaped the
same way). An ``if c:`` without ``else`` right after them (GPT-BigCode's and XGLM's cross-attention block, OPT's
``if not self.do_layer_norm_before``) is handled by moving the add into both branches with the statements that
follow the ``if`` (``if c: X`` then ``R`` is ``if c: X; R else: R``), provided ``c`` calls nothing and reads
nothing the moved statements bind; each branch is then rewritten on its own.

The fused calls run addnorm's op only when the norms are addnorm modules and both operands share a dtype and shape
(else the original add and norm: HF's dtype promotion or broadcasting is kept). ``a + b`` and ``b + a`` are the
same IEEE sum, so which operand addnorm calls the residual changes no bit. A returned ``norm_add`` is handed off
(``norm_add_handoff``) as a returned add is (``add_handoff``).
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
import types

from torch import Tensor, nn

from addnorm.integrations.hf.chain import norm_add, norm_add_handoff, norm_add_norm
from addnorm.integrations.hf.handoff import _HANDOFF, add_handoff, count_fused_run, fused_runs, rewrite_tail
from addnorm.integrations.hf.handoff import fusable as _fusable
from addnorm.integrations.hf.helper_rewrite import _NORM_ADD, _NORM_ADD_HANDOFF, HelperCalls, TailCalls
from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = [
    "RewriteResult",
    "add_norm",
    "fused_runs",
    "is_rewritten",
    "norm_add",
    "norm_attributes",
    "record_fused_layers",
    "rewrite_forward",
]

_ADD_NORM, _NORM_ADD_NORM = "_addnorm_add_norm", "_addnorm_norm_add_norm"
_MAX_SPLITS = 4  # ifs duplicated per forward: each copies the rest of the block once


def add_norm(norm: nn.Module, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(a + b), a + b)``: one fused call where :func:`_fusable`, else the add and the norm as written."""
    if _fusable(norm, a, b):
        count_fused_run("add_norm")
        return norm(a, b)
    s = a + b
    return norm(s), s


# the names a rewritten forward calls the fused ops by
_FUSED_CALLS = {_ADD_NORM: add_norm, _NORM_ADD: norm_add, _NORM_ADD_NORM: norm_add_norm, _HANDOFF: add_handoff}
_FUSED_CALLS[_NORM_ADD_HANDOFF] = norm_add_handoff


# --------------------------------------------------------------------------------------------------------------
# Recognising the statements
# --------------------------------------------------------------------------------------------------------------


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _assign(stmt) -> tuple[str, ast.expr] | None:
    """(target, value) of ``name = value``."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _name(stmt.targets[0]):
        return stmt.targets[0].id, stmt.value
    return None


def _self_attr(node) -> str | None:
    if isinstance(node, ast.Attribute) and _name(node.value) == "self":
        return node.attr
    return None


def _norm_call(node, norms: set[str], arg: str | None = None) -> str | None:
    """The attribute of ``self.<norm>(<arg>)`` (one positional Name argument, nothing else), or None."""
    if (
        isinstance(node, ast.Call)
        and _self_attr(node.func) in norms
        and len(node.args) == 1
        and not node.keywords
        and _name(node.args[0]) is not None
        and (arg is None or node.args[0].id == arg)
    ):
        return node.func.attr
    return None


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


_CONDITIONAL = (ast.Lambda, ast.IfExp, ast.BoolOp, ast.NamedExpr, ast.ListComp, ast.SetComp, ast.DictComp)
_CONDITIONAL += (ast.GeneratorExp, ast.Await, ast.Yield, ast.YieldFrom)


def _is_size_last(node, t: str) -> bool:
    """``t.size(-1)`` or ``t.shape[-1]``."""
    minus_one = lambda n: (
        isinstance(n, ast.UnaryOp)
        and isinstance(n.op, ast.USub)
        and isinstance(n.operand, ast.Constant)
        and n.operand.value == 1
    )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size":
        return _name(node.func.value) == t and len(node.args) == 1 and minus_one(node.args[0]) and not node.keywords
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        return _name(node.value.value) == t and minus_one(node.slice)
    return False


def _passes_through(stmt, t: str) -> str:
    """How a statement between the add and the norm treats the sum ``t``: "alias" (``r = t``), "read" (``s =
    t.shape``), "reshape" (``t = t.reshape(-1, t.size(-1))``: rows kept), or "" (it stops the search)."""
    found = _assign(stmt)
    if found is None:
        return ""
    target, value = found
    if target == t:
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr in ("reshape", "view")
            and _name(value.func.value) == t
            and len(value.args) == 2
            and not value.keywords
            and isinstance(value.args[0], ast.UnaryOp)
            and _is_size_last(value.args[1], t)
        ):
            return "reshape"
        return ""
    if _name(value) == t:
        return "alias"
    if isinstance(value, ast.Attribute) and value.attr == "shape" and _name(value.value) == t:
        return "read"
    return ""


def _pure_test(node, bound: set[str]) -> bool:
    """An ``if`` test that calls nothing and reads none of ``bound``: safe to evaluate before the moved statements."""
    allowed = (ast.Name, ast.Attribute, ast.Constant, ast.Compare, ast.UnaryOp, ast.BoolOp, ast.Load)
    allowed += (ast.cmpop, ast.unaryop, ast.boolop)
    return all(isinstance(n, allowed) for n in ast.walk(node)) and not (_names(node) & bound)


# --------------------------------------------------------------------------------------------------------------
# Rewriting a block of statements
# --------------------------------------------------------------------------------------------------------------


class _Rewriter:
    def __init__(self, norms: set[str]):
        self.norms = norms
        self.fused: list[str] = []
        self.splits = 0
        self.temps = 0

    def block(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        i = 0
        while i < len(stmts):
            s = stmts[i]
            done = self._add_then_norm(stmts, i) or self._norm_then_add(stmts, i)
            if done is not None:
                replaced, consumed = done
                if consumed is None:  # an if split: the rest of the block now lives in its branches
                    return out + replaced
                out.extend(replaced)
                i += consumed
                continue
            for field in ("body", "orelse", "finalbody"):
                if isinstance(getattr(s, field, None), list) and not isinstance(s, (ast.FunctionDef, ast.ClassDef)):
                    setattr(s, field, self.block(getattr(s, field)))
            out.append(s)
            i += 1
        return out

    def _temp(self) -> str:
        self.temps += 1
        return f"_addnorm_normed{self.temps}"

    def _add_then_norm(self, stmts, i):
        found = _assign(stmts[i])
        if found is None or not (isinstance(found[1], ast.BinOp) and isinstance(found[1].op, ast.Add)):
            return None
        t, add = found
        between, j = _passing(stmts, i + 1, t)
        if j == len(stmts):
            return None
        nxt = stmts[j]
        if isinstance(nxt, ast.If) and not nxt.orelse:
            return self._split(stmts, i, j)
        call = self._norm_of(nxt, t)
        if call is None:
            return None
        attr, temp = call.func.attr, self._temp()
        fused = ast.Assign(
            targets=[ast.Tuple(elts=[ast.Name(temp, ast.Store()), ast.Name(t, ast.Store())], ctx=ast.Store())],
            value=ast.Call(
                func=ast.Name(_ADD_NORM, ast.Load()),
                args=[ast.Attribute(ast.Name("self", ast.Load()), attr, ast.Load()), add.left, add.right],
                keywords=[],
            ),
        )
        _replace(nxt, call, ast.Name(temp, ast.Load()))
        self.fused.append(attr)
        return [fused, *_moved(between, t, temp), nxt], j + 1 - i

    def _norm_of(self, stmt, t: str):
        """The call ``self.<norm>(t)`` in ``stmt`` (an assignment, expression or return, nothing in it conditional),
        or None."""
        if not isinstance(stmt, (ast.Assign, ast.Expr, ast.Return)) or any(
            isinstance(n, _CONDITIONAL) for n in ast.walk(stmt)
        ):
            return None
        return next((n for n in ast.walk(stmt) if _norm_call(n, self.norms, t)), None)

    def _split(self, stmts, i, j):
        """``add; between; if c: body`` then the rest -> ``if c: add; between; body; rest else: add; between;
        rest``, each branch rewritten, kept only if a branch fused something."""
        cond = stmts[j]
        bound = set()
        for s in stmts[i:j]:
            bound |= {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if self.splits >= _MAX_SPLITS or not _pure_test(cond.test, bound):
            return None
        before = len(self.fused)
        self.splits += 1
        moved, rest = stmts[i:j], stmts[j + 1 :]
        body = self.block(_copy(moved) + _copy(cond.body) + _copy(rest))
        orelse = self.block(_copy(moved) + _copy(rest))
        if len(self.fused) == before:
            self.splits -= 1
            return None
        return [ast.If(test=cond.test, body=body, orelse=orelse)], None

    def _norm_then_add(self, stmts, i):
        found = _assign(stmts[i])
        if found is None or i + 1 >= len(stmts):
            return None
        t, value = found
        attr = _norm_call(value, self.norms)
        nxt = _assign(stmts[i + 1])
        if attr is None or nxt is None or nxt[0] != t:
            return None
        add = nxt[1]
        if not (isinstance(add, ast.BinOp) and isinstance(add.op, ast.Add)):
            return None
        if _name(add.right) == t and t not in _names(add.left):
            other = add.left
        elif _name(add.left) == t and t not in _names(add.right):
            other = add.right
        else:
            return None
        post = ast.Attribute(ast.Name("self", ast.Load()), attr, ast.Load())
        self.fused.append(attr)
        # the sum normalized next (a sandwich layer's pre-norm of the next sublayer): the chain, in one call
        between, j = _passing(stmts, i + 2, t)
        call = self._norm_of(stmts[j], t) if j < len(stmts) else None
        if call is None:
            fused = ast.Assign(
                targets=[ast.Name(t, ast.Store())],
                value=ast.Call(func=ast.Name(_NORM_ADD, ast.Load()), args=[post, value.args[0], other], keywords=[]),
            )
            return [fused], 2
        pre, temp, nxt = call.func, self._temp(), stmts[j]
        fused = ast.Assign(
            targets=[ast.Tuple(elts=[ast.Name(temp, ast.Store()), ast.Name(t, ast.Store())], ctx=ast.Store())],
            value=ast.Call(
                func=ast.Name(_NORM_ADD_NORM, ast.Load()), args=[post, pre, value.args[0], other], keywords=[]
            ),
        )
        _replace(nxt, call, ast.Name(temp, ast.Load()))
        self.fused.append(pre.attr)
        return [fused, *_moved(between, t, temp), nxt], j + 1 - i


def _passing(stmts, j: int, t: str) -> tuple[list, int]:
    """The statements from ``stmts[j]`` on that the sum ``t`` passes through (:func:`_passes_through`), and the
    index of the first that it does not."""
    between = []
    while j < len(stmts) and _passes_through(stmts[j], t):
        between.append(stmts[j])
        j += 1
    return between, j


def _moved(between, t: str, temp: str) -> list:
    """``between``, each row-keeping reshape of the sum ``t`` followed by the same reshape of ``temp`` (the normed
    rows follow the sum's)."""
    moved = []
    for stmt in between:
        moved.append(stmt)
        if _passes_through(stmt, t) == "reshape":
            moved.append(_renamed(stmt, t, temp))
    return moved


def _copy(stmts):
    return [ast.parse(ast.unparse(s)).body[0] for s in stmts]


def _renamed(stmt, old: str, new: str):
    stmt = _copy([stmt])[0]
    for n in ast.walk(stmt):
        if isinstance(n, ast.Name) and n.id == old:
            n.id = new
    return stmt


def _replace(root, old, new) -> None:
    for parent in ast.walk(root):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
            elif isinstance(value, list):
                for k, item in enumerate(value):
                    if item is old:
                        value[k] = new


# --------------------------------------------------------------------------------------------------------------
# Compiling the rewritten forward
# --------------------------------------------------------------------------------------------------------------


class RewriteResult:
    """A fused forward for a class and the norm attributes it calls with a residual."""

    def __init__(self, forward, fused: tuple[str, ...], source: str):
        self.forward, self.fused, self.source = forward, fused, source


_CACHE: dict[tuple, RewriteResult | None] = {}


def _wrapper_chain(fn) -> list:
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    return chain


def _rewrap(chain: list, new_inner):
    """The decorators of ``chain`` (outermost first) around ``new_inner``: each wrapper rebuilt with the cell that
    held the function below it now holding the new one. None if a wrapper does not hold it in a cell."""
    below_old, below_new = chain[-1], new_inner
    for wrapper in reversed(chain[:-1]):
        if not isinstance(wrapper, types.FunctionType) or not wrapper.__closure__:
            return None
        cells = tuple(types.CellType(below_new) if c.cell_contents is below_old else c for c in wrapper.__closure__)
        if all(c.cell_contents is not below_new for c in cells):
            return None
        new = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, cells)
        new.__kwdefaults__ = wrapper.__kwdefaults__
        new.__dict__.update(wrapper.__dict__)
        new.__wrapped__ = below_new
        new.__qualname__, new.__module__, new.__doc__ = wrapper.__qualname__, wrapper.__module__, wrapper.__doc__
        below_old, below_new = wrapper, new
    return below_new


def rewrite_forward(cls: type, norms: set[str], producer: bool = False) -> RewriteResult | None:
    """The forward of ``cls`` with its adds next to the norms named in ``norms`` (attribute names) fused, or None
    when nothing was fused (or the forward cannot be rewritten: no source, a closure such as ``super()``). With
    ``producer``, the add it returns is handed off even if it calls none of ``norms`` (a child module whose sum
    its parent normalizes next, found by :func:`addnorm.integrations.hf.links.producers`)."""
    key = (cls, frozenset(norms), producer)
    if key not in _CACHE:
        try:
            _CACHE[key] = _rewrite(cls, norms, producer)
        except (OSError, TypeError, SyntaxError, ValueError):
            _CACHE[key] = None
    return _CACHE[key]


def _rewrite(cls: type, norms: set[str], producer: bool) -> RewriteResult | None:
    chain = _wrapper_chain(getattr(cls, "forward", None))
    inner = chain[-1]
    if not isinstance(inner, types.FunctionType) or inner.__code__.co_freevars or not (norms or producer):
        return None  # a closure (zero-argument super() reads __class__) cannot be recompiled as a plain function
    tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        return None
    fn.decorator_list = []
    rewriter = _Rewriter(set(norms))
    fn.body = rewriter.block(fn.body)
    # adds made inside a helper function of the module, right before a norm of their sum (helper_rewrite)
    helpers = HelperCalls(inner.__globals__)
    sites = tuple(dict.fromkeys(helpers.before_norm(fn.body, set(norms))))
    # the add it returns, fused with the next layer's input norm once linked: in a layer, one that calls its norms;
    # in a producer (a child whose sum its parent normalizes: links.producers), always
    calls_norm = any(_self_attr(n) in norms for n in ast.walk(fn))
    handoffs = rewrite_tail(fn, call=TailCalls(helpers)) if calls_norm or producer else 0
    if not rewriter.fused and not handoffs and not sites:
        return None
    factory = ast.FunctionDef(
        name="_addnorm_factory",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(a) for a in (*_FUSED_CALLS, *helpers.bound)],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[fn, ast.Return(ast.Name(fn.name, ast.Load()))],
        decorator_list=[],
    )
    # annotations stay strings (never evaluated): the names they use need not resolve here
    source = "from __future__ import annotations\n\n" + ast.unparse(ast.fix_missing_locations(factory)) + "\n"
    filename = f"<addnorm fused {cls.__module__}.{cls.__qualname__}.forward>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show it
    namespace: dict = {}
    exec(compile(source, filename, "exec", dont_inherit=True), inner.__globals__, namespace)  # noqa: S102
    new_inner = namespace["_addnorm_factory"](*_FUSED_CALLS.values(), *helpers.bound.values())
    new_inner.__defaults__, new_inner.__kwdefaults__ = inner.__defaults__, inner.__kwdefaults__
    new_inner.__qualname__, new_inner.__module__ = inner.__qualname__, inner.__module__
    forward = _rewrap(chain, new_inner)
    if forward is None:
        return None
    forward._addnorm_rewritten = True  # read by is_rewritten
    forward._addnorm_handoff = handoffs > 0  # read by links.link
    forward._addnorm_norm_sites = sites  # norms a helper hands its sum to (links.link)
    return RewriteResult(forward, tuple(dict.fromkeys(rewriter.fused + list(sites))), source)


def norm_attributes(module: nn.Module) -> set[str]:
    """Names of ``module``'s direct children that are addnorm norms (what :func:`rewrite_forward` may fuse)."""
    return {name for name, child in module.named_children() if isinstance(child, (LayerNorm, RMSNorm))}


def is_rewritten(cls: type) -> bool:
    """Whether ``cls`` (a fused layer class) runs a forward of this module, which fuses only on the branches where
    the add and the norm meet (see :func:`fused_runs`)."""
    return getattr(getattr(cls, "forward", None), "_addnorm_rewritten", False)


def record_fused_layers(model: nn.Module) -> tuple[set[str], list]:
    """Hooks on ``model``'s fused layers (those :func:`addnorm.integrations.hf.apply` installed) that add the
    original class name of each one that ran with a fused call to the returned set. A template forward always
    fuses; a rewritten one counts when :func:`fused_runs` moved during it. Returns (set, handles): remove the
    handles when done."""
    ran: set[str] = set()
    start: dict[int, int] = {}
    handles = []
    for m in model.modules():
        cls = type(m)
        if not cls.__name__.startswith("AddNormFused"):
            continue
        name = cls.__mro__[1].__name__
        if is_rewritten(cls):
            handles.append(m.register_forward_pre_hook(lambda mod, a: start.__setitem__(id(mod), fused_runs())))
            handles.append(
                m.register_forward_hook(
                    lambda mod, a, o, name=name: ran.add(name) if fused_runs() > start.get(id(mod), 1 << 62) else None
                )
            )
        else:
            handles.append(m.register_forward_hook(lambda mod, a, o, name=name: ran.add(name)))
    return ran, handles
