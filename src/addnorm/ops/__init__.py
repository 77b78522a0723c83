"""Fused residual add + norm ops: one contract, several backends (torch, reference, triton, cpu)."""

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from addnorm.ops.add_norm_inplace import add_layer_norm_, add_rms_norm_
from addnorm.ops.add_norm_linear import add_norm_linear
from addnorm.ops.add_norm_multi import AddNormOutputs, add_norm_multi
from addnorm.ops.backends import BackendUnavailableError, available_backends, resolve_backend
from addnorm.ops.norm_add import norm_add, norm_add_, norm_add_norm, norm_add_norm_
from addnorm.ops.quant import add_layer_norm_quant, add_layer_norm_quant_, add_rms_norm_quant, add_rms_norm_quant_

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "add_layer_norm_",
    "add_rms_norm_",
    "layer_norm",
    "rms_norm",
    "add_norm_multi",
    "AddNormOutputs",
    "add_norm_linear",
    "norm_add",
    "norm_add_norm",
    "norm_add_",
    "norm_add_norm_",
    "BackendUnavailableError",
    "available_backends",
    "resolve_backend",
    "add_rms_norm_quant",
    "add_layer_norm_quant",
    "add_rms_norm_quant_",
    "add_layer_norm_quant_",
]
