"""Recognise a layer's forward by its structure: the source, parsed, compared with a template after renaming.

Many transformers families share a decoder layer written line for line like Llama's (transformers generates them
from one "modular" source), under other class and attribute names. :func:`match` parses a ``forward``, drops the
docstring and comments, renames ``self.<attribute>`` to ``A0, A1, ...`` and local variables to ``V0, V1, ...`` in
order of first use, and replaces a call that passes every parameter of the forward on by name (``attention_mask=
attention_mask, ..., **kwargs``) by one marker; two forwards that agree after that compute the same thing from
their submodules. The template's attribute names then name the roles (``norm1``, ``attn``, ...) of the matched
class's attributes.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

__all__ = ["Match", "TEMPLATES", "match"]

# Each template is a forward whose attributes name the roles. Written here from the layer equations (pre-norm:
# x + attn(N1(x)), then + mlp(N2(.)); ...), in the shape transformers' modeling files use.
TEMPLATES: dict[str, str] = {
    "pre": """
def forward(self, hidden_states, **kwargs):
    residual = hidden_states
    hidden_states = self.norm1(hidden_states)
    hidden_states, _ = self.attn(hidden_states=hidden_states, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.norm2(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
""",
    # Granite: each branch multiplied by a scalar before the add
    "pre-scaled": """
def forward(self, hidden_states, **kwargs):
    residual = hidden_states
    hidden_states = self.norm1(hidden_states)
    hidden_states, _ = self.attn(hidden_states=hidden_states, **kwargs)
    hidden_states = residual + hidden_states * self.scale
    residual = hidden_states
    hidden_states = self.norm2(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states * self.scale
    return hidden_states
""",
    # Gemma 2/3, Peri-LN: a norm before and after each branch
    "sandwich": """
def forward(self, hidden_states, **kwargs):
    residual = hidden_states
    hidden_states = self.norm1(hidden_states)
    hidden_states, _ = self.attn(hidden_states=hidden_states, **kwargs)
    hidden_states = self.norm2(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.norm3(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.norm4(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
""",
    # BERT's post-norm sublayer output: Norm(dropout(dense(h)) + x)
    "post-output": """
def forward(self, hidden_states, input_tensor):
    hidden_states = self.dense(hidden_states)
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.norm(hidden_states + input_tensor)
    return hidden_states
""",
}

_ALL = "__every_parameter__"


@dataclass(frozen=True)
class Match:
    """A forward that matched ``template``; ``roles`` maps the template's attribute names to the class's."""

    template: str
    roles: dict[str, str]


class _Canon(ast.NodeTransformer):
    def __init__(self, params: list[str], named: list[str], var_kw: str | None):
        self.params, self.named, self.var_kw = set(params), named, var_kw
        self.attrs: list[str] = []
        self.locals: list[str] = []

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr not in self.attrs:
                self.attrs.append(node.attr)
            return ast.Attribute(
                value=ast.Name(id="self", ctx=ast.Load()), attr=f"A{self.attrs.index(node.attr)}", ctx=node.ctx
            )
        return self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in self.params or node.id == "self":
            return node
        if node.id not in self.locals:
            self.locals.append(node.id)
        return ast.Name(id=f"V{self.locals.index(node.id)}", ctx=node.ctx)

    def visit_Call(self, node):
        # a call passing every parameter after the first on by name (and **kwargs): one marker, whatever the order
        rest = set(self.named[1:])
        passed = {k.arg for k in node.keywords if k.arg and isinstance(k.value, ast.Name) and k.value.id == k.arg}
        var = [k for k in node.keywords if k.arg is None]
        if (
            self.var_kw
            and rest <= passed
            and len(var) == 1
            and isinstance(var[0].value, ast.Name)
            and var[0].value.id == self.var_kw
        ):
            keep = [k for k in node.keywords if k.arg is not None and k.arg not in rest]
            node.keywords = keep + [ast.keyword(arg=None, value=ast.Name(id=_ALL, ctx=ast.Load()))]
        return self.generic_visit(node)


def _canonical(source: str) -> tuple[str, list[str]] | None:
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    fn = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    if fn is None:
        return None
    args = fn.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs][1:]  # without self
    var_kw = args.kwarg.arg if args.kwarg else None
    params = named + ([var_kw] if var_kw else []) + ([args.vararg.arg] if args.vararg else [])
    body = fn.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    canon = _Canon(params, named, var_kw)
    body = [canon.visit(stmt) for stmt in body]
    dump = ast.dump(ast.Module(body=body, type_ignores=[]))
    # the first parameter is the input: its name must agree, the others are passed on (the marker) or named alike
    return f"{named[:1]}|{dump}", canon.attrs


_TEMPLATE_CANON = {name: _canonical(src) for name, src in TEMPLATES.items()}
_CACHE: dict[type, Match | None] = {}


def _source(fn) -> str | None:
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None


def match(cls: type, templates: tuple[str, ...] | None = None) -> Match | None:
    """The template ``cls.forward`` matches (see the module docstring), or None."""
    key = (cls, templates)
    if key in _CACHE:
        return _CACHE[key]
    found = None
    src = _source(getattr(cls, "forward", None))
    canon = _canonical(src) if src else None
    if canon is not None:
        for name, (dump, attrs) in _TEMPLATE_CANON.items():
            if templates is not None and name not in templates:
                continue
            if canon[0] == dump and len(canon[1]) == len(attrs):
                found = Match(template=name, roles=dict(zip(attrs, canon[1])))
                break
    _CACHE[key] = found
    return found
