"""Residual adds made inside a helper function of the layer's module, handed off to the norm after the call.

BLOOM's attention and MLP end with ``dropout_add(out, residual, prob, training)`` and GPT-NeoX-Japanese's layer
with ``bias_dropout_add(out, bias, residual, prob, training)``: plain functions of their modeling file whose last
statements are

    out = F.dropout(x, p=prob, training=training)
    out = residual + out                    # BLOOM;  GPT-NeoX-Japanese: ``if residual is not None:`` first
    return out

The add is not in the forward that :mod:`~addnorm.integrations.hf.rewrite` rewrites, so it cannot become a fused
call there. Here the helper itself is rewritten, once per function: a first parameter, the *site* (the module, or
norm, that :mod:`addnorm.integrations.hf.links` links to the norm reading the sum), and its returned add made by
:func:`addnorm.integrations.hf.handoff.add_handoff` on that site. The forward's call passes the site:

    out = dropout_add(out, residual, p, t)   ->   out = _addnorm_helper_dropout_add(self, out, residual, p, t)

Everything else in the helper runs as written: dropout draws the same random numbers in training, the add is the
same IEEE sum (the fused call's sum has its bits), and where the add is skipped (``residual`` None) or the next norm
is given another tensor, nothing is handed off. A helper qualifies when it is a plain function (no closure, no
decorator) of the same module as the forward calling it, so the rewrite never reaches into torch or another library.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
import types

from addnorm.integrations.hf.handoff import _HANDOFF, add_handoff, rewrite_tail

__all__ = ["HelperCalls", "TailCalls", "handoff_helper"]

_SITE = "_addnorm_site"
# the names rewrite.py's forwards call chain.py's norm_add and norm_add_handoff by
_NORM_ADD, _NORM_ADD_HANDOFF = "_addnorm_norm_add", "_addnorm_norm_add_handoff"
_HELPERS: dict[types.FunctionType, types.FunctionType | None] = {}


def handoff_helper(fn) -> types.FunctionType | None:
    """``fn`` with a first parameter (the site) and the add it returns made by ``add_handoff(site, a, b)``, or
    None when ``fn`` returns no add (or is not a plain function whose source can be read)."""
    if not isinstance(fn, types.FunctionType):
        return None
    if fn not in _HELPERS:
        try:
            _HELPERS[fn] = _rewrite_helper(fn)
        except (OSError, TypeError, SyntaxError, ValueError):
            _HELPERS[fn] = None
    return _HELPERS[fn]


def _rewrite_helper(fn: types.FunctionType) -> types.FunctionType | None:
    if fn.__code__.co_freevars or hasattr(fn, "__wrapped__"):
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.name != fn.__name__:
        return None
    if not rewrite_tail(node, site=_SITE):
        return None
    # the site goes first: the defaults belong to the last parameters, so they still line up
    (node.args.posonlyargs if node.args.posonlyargs else node.args.args).insert(0, ast.arg(_SITE))
    node.name = f"_addnorm_helper_{fn.__name__}"
    factory = ast.FunctionDef(
        name="_addnorm_helper_factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(_HANDOFF)], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[node, ast.Return(ast.Name(node.name, ast.Load()))],
        decorator_list=[],
    )
    source = "from __future__ import annotations\n\n" + ast.unparse(ast.fix_missing_locations(factory)) + "\n"
    filename = f"<addnorm handoff {fn.__module__}.{fn.__qualname__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show it
    namespace: dict = {}
    exec(compile(source, filename, "exec", dont_inherit=True), fn.__globals__, namespace)  # noqa: S102
    new = namespace["_addnorm_helper_factory"](add_handoff)
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    new.__module__ = fn.__module__
    return new


class HelperCalls:
    """Rewrites, in one forward of a module whose globals are ``namespace``, calls of helpers that return an add:
    ``f(...)`` -> ``_addnorm_helper_f(<site>, ...)``. ``bound`` collects the rewritten functions by the names the
    forward now calls them by (passed to the compiled forward)."""

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.bound: dict[str, types.FunctionType] = {}

    def helper(self, call) -> types.FunctionType | None:
        """The rewritten helper ``call`` would run, or None (not a call of a qualifying helper)."""
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            return None
        fn = self.namespace.get(call.func.id)
        if not isinstance(fn, types.FunctionType) or fn.__globals__ is not self.namespace:
            return None  # only a function of the forward's own module
        return handoff_helper(fn)

    def __call__(self, call: ast.Call, site: str | ast.expr) -> int:
        """Rewrites ``call`` in place with ``site`` (a name, or an expression such as ``self.norm``); returns 1 if it
        did, else 0 (the signature :func:`addnorm.integrations.hf.handoff.rewrite_tail` expects)."""
        new = self.helper(call)
        if new is None:
            return 0
        self.bound[new.__name__] = new
        call.func = ast.Name(new.__name__, ast.Load())
        call.args.insert(0, ast.Name(site, ast.Load()) if isinstance(site, str) else site)
        return 1

    def before_norm(self, block: list[ast.stmt], norms: set[str]) -> list[str]:
        """In ``block`` and the blocks nested in it: each ``t = f(...)`` (a helper) whose next statement normalizes
        ``t`` with ``self.<norm>(t)``, rewritten with that norm as the site. Returns the norms' attributes."""
        sites: list[str] = []
        for stmt, nxt in zip(block, block[1:]):
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
                and self.helper(stmt.value) is not None
            ):
                t = stmt.targets[0].id
                attr = next((a for n in ast.walk(nxt) if (a := _norm_of(n, norms, t))), None)
                if attr is not None:
                    self(stmt.value, ast.Attribute(ast.Name("self", ast.Load()), attr, ast.Load()))
                    sites.append(attr)
        for stmt in block:
            for field in ("body", "orelse", "finalbody"):
                if isinstance(getattr(stmt, field, None), list) and not isinstance(
                    stmt, (ast.FunctionDef, ast.ClassDef)
                ):
                    sites += self.before_norm(getattr(stmt, field), norms)
        return sites


def _norm_of(node, norms: set[str], t: str) -> str | None:
    """The attribute of ``self.<norm>(t)`` (``t`` its one argument)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and node.func.attr in norms
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == t
    ):
        return node.func.attr
    return None


class TailCalls:
    """What :func:`rewrite_tail` does with a call the returned sum is bound to: ``norm_add(post, y, a)`` (the last
    add of a branch-output or sandwich layer, rewritten by rewrite.py) becomes ``norm_add_handoff(site, post, y,
    a)`` (:mod:`addnorm.integrations.hf.chain`); a helper that makes the add, as :class:`HelperCalls` does."""

    def __init__(self, helpers: HelperCalls):
        self.helpers = helpers

    def __call__(self, call: ast.Call, site) -> int:
        if isinstance(call.func, ast.Name) and call.func.id == _NORM_ADD:
            call.func = ast.Name(_NORM_ADD_HANDOFF, ast.Load())
            call.args = [ast.Name(site, ast.Load()) if isinstance(site, str) else site, *call.args]
            return 1
        return self.helpers(call, site)
