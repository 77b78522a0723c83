"""Residual add + norm + FP8/INT8 quantization (:mod:`addnorm.ops.quant.contract` states the contract)."""

from addnorm.ops.quant.add_norm_quant import (
    add_layer_norm_quant,
    add_layer_norm_quant_,
    add_rms_norm_quant,
    add_rms_norm_quant_,
)

__all__ = ["add_layer_norm_quant", "add_layer_norm_quant_", "add_rms_norm_quant", "add_rms_norm_quant_"]
