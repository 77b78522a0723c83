"""addnorm: the "Add & Norm" of Transformers (residual connections and normalization), done right and fast.

Functional API (normalizing over the last dimension; ``backend`` is "auto", "torch", "reference", "triton" or
"cpu"; the ADDNORM_BACKEND environment variable overrides "auto"):

    out, residual_out = addnorm.add_layer_norm(x, residual, weight, bias, eps)
    out, residual_out = addnorm.add_rms_norm(x, residual, weight, eps)
    y = addnorm.layer_norm(x, weight, bias, eps);  y = addnorm.rms_norm(x, weight, eps)
    x, residual = addnorm.add_rms_norm_(x, residual, weight, eps)   # in place, for serving: residual += x,
    x, residual = addnorm.add_layer_norm_(x, residual, weight, bias, eps)   # x = norm(residual)
    r = addnorm.add_norm_multi(x, residual, weight, bias, eps, x1=, weight1=, rowscale=, return_dropout_mask=, ...)
    out, residual_out = addnorm.add_norm_linear(x, residual, norm_weight, norm_bias, linear_weight, linear_bias)

Modules live in :mod:`addnorm.nn`, the float oracles in :mod:`addnorm.reference`.

The public names are imported on first use (PEP 562), not with the package: ``addnorm --version`` and
``addnorm --help`` import this package, and must answer without paying for torch (about 3 s to import).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "add_layer_norm": "addnorm.ops",
    "add_rms_norm": "addnorm.ops",
    "add_layer_norm_": "addnorm.ops",
    "add_rms_norm_": "addnorm.ops",
    "layer_norm": "addnorm.ops",
    "rms_norm": "addnorm.ops",
    "add_norm_multi": "addnorm.ops",
    "add_norm_linear": "addnorm.ops",
    "norm_add": "addnorm.ops",
    "norm_add_norm": "addnorm.ops",
    "norm_add_": "addnorm.ops",
    "norm_add_norm_": "addnorm.ops",
    "available_backends": "addnorm.ops",
    "BackendUnavailableError": "addnorm.ops",
    "add_rms_norm_quant": "addnorm.ops",
    "add_layer_norm_quant": "addnorm.ops",
    "add_rms_norm_quant_": "addnorm.ops",
    "add_layer_norm_quant_": "addnorm.ops",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'addnorm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
