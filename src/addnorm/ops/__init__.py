"""Fused residual add + norm ops: one contract, several backends (torch, reference, triton, cpu)."""

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from addnorm.ops.add_norm_inplace import add_layer_norm_, add_rms_norm_
from addnorm.ops.backends import BackendUnavailableError, available_backends, resolve_backend

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "add_layer_norm_",
    "add_rms_norm_",
    "layer_norm",
    "rms_norm",
    "BackendUnavailableError",
    "available_backends",
    "resolve_backend",
]
