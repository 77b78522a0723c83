"""addnorm: the "Add & Norm" of Transformers (residual connections and normalization), done right and fast.

Functional API (normalizing over the last dimension; ``backend`` is "auto", "torch", "reference", "triton" or
"cpu"; the ADDNORM_BACKEND environment variable overrides "auto"):

    out, residual_out = addnorm.add_layer_norm(x, residual, weight, bias, eps)
    out, residual_out = addnorm.add_rms_norm(x, residual, weight, eps)
    y = addnorm.layer_norm(x, weight, bias, eps);  y = addnorm.rms_norm(x, weight, eps)
    x, residual = addnorm.add_rms_norm_(x, residual, weight, eps)   # in place, for serving: residual += x,
    x, residual = addnorm.add_layer_norm_(x, residual, weight, bias, eps)   # x = norm(residual)

Modules live in :mod:`addnorm.nn`, the float oracles in :mod:`addnorm.reference`.
"""

from addnorm.ops import (
    BackendUnavailableError,
    add_layer_norm,
    add_layer_norm_,
    add_rms_norm,
    add_rms_norm_,
    available_backends,
    layer_norm,
    rms_norm,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "add_layer_norm",
    "add_rms_norm",
    "add_layer_norm_",
    "add_rms_norm_",
    "layer_norm",
    "rms_norm",
    "available_backends",
    "BackendUnavailableError",
]
