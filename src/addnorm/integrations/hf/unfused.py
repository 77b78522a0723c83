"""Why ``hf.apply`` fused no residual add of a model whose norms it swapped: read from the layers' own forwards.

The survey prints this beside a "norms" row, so that a family left unfused says where its adds are instead of
looking merely unsupported.
"""

from __future__ import annotations

import ast

from torch import nn

from addnorm.integrations.hf.links import _source_fn
from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = ["unfused_reason"]


def _producers(fn: ast.FunctionDef, norms: set[str]) -> list[str]:
    """For each ``self.<norm>(v)`` in ``fn``: the call ``v`` was last bound from before it (``self.attn``,
    ``dropout_add``), where ``v`` comes from a call rather than an add."""
    found = []
    bound: dict[str, str] = {}
    for stmt in ast.walk(fn):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            targets = stmt.targets[0].elts if isinstance(stmt.targets[0], ast.Tuple) else stmt.targets
            for t in targets:
                if isinstance(t, ast.Name):
                    bound[t.id] = ast.unparse(stmt.value.func)
        if (
            isinstance(stmt, ast.Call)
            and isinstance(stmt.func, ast.Attribute)
            and ast.unparse(stmt.func.value) == "self"
            and stmt.func.attr in norms
            and stmt.args
            and isinstance(stmt.args[0], ast.Name)
            and stmt.args[0].id in bound
            and bound[stmt.args[0].id] not in (f"self.{n}" for n in norms)
        ):
            found.append(f"{bound[stmt.args[0].id]}(...) -> self.{stmt.func.attr}")
    return list(dict.fromkeys(found))


def unfused_reason(model: nn.Module, original: dict[nn.Module, type] | None = None) -> str:
    """One sentence: the layer classes (modules in a ModuleList) holding addnorm norms, and for each, where the values its norms read come
    from when that is a call (the residual add is made inside it, out of the rewrite's reach)."""
    original = original or {}
    parts: dict[str, str] = {}
    layers = [m for s in model.modules() if isinstance(s, (nn.ModuleList, nn.Sequential)) for m in s]
    for m in layers:
        norms = {n for n, c in m.named_children() if isinstance(c, (LayerNorm, RMSNorm))}
        cls = original.get(m, type(m))
        if not norms or cls.__name__ in parts or not cls.__module__.startswith("transformers."):
            continue
        fn = _source_fn(cls)
        if fn is None:
            parts[cls.__name__] = f"{cls.__name__}.forward has no source to rewrite"
            continue
        calls = _producers(fn, norms)
        if calls:
            parts[cls.__name__] = f"{cls.__name__}: the adds are inside calls ({'; '.join(calls)})"
        elif any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) for n in ast.walk(fn)):
            parts[cls.__name__] = f"{cls.__name__}: no add next to a norm in a shape the rewrite proves equivalent"
    if not parts:
        return "no residual add (a + b) next to a norm in a layer's own forward"
    return "; ".join(parts[k] for k in sorted(parts))
