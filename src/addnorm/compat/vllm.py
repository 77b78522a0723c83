"""Drop-in for vLLM's norm custom ops (``torch.ops._C.*`` / ``vllm._custom_ops``): their names, argument orders and
out-parameter conventions, served by addnorm's kernels on every backend, CPU tensors included.

    from addnorm.compat import vllm as ops
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)                 # residual += x; x = RMSNorm(residual)
    ops.rms_norm_dynamic_per_token_quant(out, x, weight, scales, 1e-6, None, residual)

The order of vLLM's kernels is Hugging Face Llama's: the normalized value is rounded to the input's dtype, then
weighted (``cast_before_weight=True`` here). Where vLLM's rounding differs from addnorm's contract (docs/compat.md):

- vLLM rounds ``round(xhat) * weight`` to the input's dtype again before quantizing; addnorm quantizes the float32
  product (one rounding fewer: codes can differ by one where the extra rounding crosses a code boundary);
- ``static_scaled_fp8_quant`` divides by the scale as vLLM's does (``x / scale``); the fused ops multiply by
  ``1 / scale`` as both vLLM's fused kernels and addnorm's contract do;
- vLLM's dynamic int8 scale floor is float32's epsilon and its int8 clamp is [-128, 127]; addnorm's floor is
  ``1 / (127 * 512)`` and its clamp [-127, 127] (only rows with amax below 0.002 see the floor; dynamic scales
  never reach -128).
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.ops.add_norm import add_rms_norm
from addnorm.ops.add_norm_inplace import add_rms_norm_
from addnorm.ops.quant import add_rms_norm_quant, add_rms_norm_quant_
from addnorm.ops.quant.contract import QMAX

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm",
    "rms_norm_dynamic_per_token_quant",
    "rms_norm_static_fp8_quant",
    "static_scaled_fp8_quant",
]


def rms_norm(out: Tensor, input: Tensor, weight: Tensor, epsilon: float) -> None:
    """``out = round(input / RMS(input)) * weight`` (vLLM's order)."""
    out.copy_(add_rms_norm(input, None, weight, epsilon, cast_before_weight=True)[0])


def fused_add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> None:
    """In place: ``residual += input``; ``input = round(residual / RMS(residual)) * weight``."""
    add_rms_norm_(input, residual, weight, epsilon, cast_before_weight=True)


def rms_norm_static_fp8_quant(out: Tensor, input: Tensor, weight: Tensor, scale: Tensor, epsilon: float) -> None:
    """``out = fp8(RMSNorm(input) * (1 / scale))``, saturated; ``out``'s dtype is the FP8 format."""
    add_rms_norm_quant(
        input, None, weight, epsilon, quant_dtype=out.dtype, scale=_scale(scale), cast_before_weight=True, out=out
    )


def fused_add_rms_norm_static_fp8_quant(
    out: Tensor, input: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, epsilon: float
) -> None:
    """In place: ``residual += input``; ``out = fp8(RMSNorm(residual) * (1 / scale))``."""
    add_rms_norm_quant_(
        input, residual, weight, epsilon, quant_dtype=out.dtype, scale=_scale(scale), cast_before_weight=True, out=out
    )


def rms_norm_dynamic_per_token_quant(
    out: Tensor,
    input: Tensor,
    weight: Tensor,
    scales: Tensor,
    epsilon: float,
    scale_ub: Tensor | None = None,
    residual: Tensor | None = None,
) -> None:
    """``out`` (FP8 or int8) and ``scales`` (num_tokens, 1) float32 from RMSNorm(input) (of ``residual += input``,
    in place, when a residual is given), one scale per token: ``max(min(amax, scale_ub) / QMAX, floor)``."""
    _check_scales(scales, input)
    kw = dict(quant_dtype=out.dtype, scale_ub=scale_ub, cast_before_weight=True, out=out)
    if residual is None:
        _, _, s = add_rms_norm_quant(input, None, weight, epsilon, **kw)
    else:
        _, _, s = add_rms_norm_quant_(input, residual, weight, epsilon, **kw)
    scales.copy_(s.reshape(scales.shape))


def _check_scales(scales, input: Tensor) -> None:
    """vLLM's kernel writes one float32 per token into ``scales`` (its op checks the dtype; its Python wrapper
    allocates (num_tokens, 1)): anything else would truncate (int32), round (bf16) or reshape the scales."""
    tokens = input.numel() // input.shape[-1] if input.dim() else 1
    if not isinstance(scales, Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (tokens, 1):
        got = f"{scales.dtype} of shape {tuple(scales.shape)}" if isinstance(scales, Tensor) else type(scales).__name__
        raise ValueError(f"scales must be a float32 tensor of shape (num_tokens, 1) = ({tokens}, 1), got {got}")
    if scales.device != input.device:
        raise ValueError(f"scales must be on input's device {input.device}, got {scales.device}")


def static_scaled_fp8_quant(out: Tensor, input: Tensor, scale: Tensor) -> None:
    """``out = fp8(clamp(input / scale, -QMAX, QMAX))``: a division, as vLLM's kernel computes it."""
    if out.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"out must be float8_e4m3fn or float8_e5m2, got {out.dtype}")
    qmax = QMAX[out.dtype]
    out.copy_((input.to(torch.float32) / _scale(scale)).clamp(-qmax, qmax).to(out.dtype))


def _scale(scale: Tensor) -> Tensor:
    if not isinstance(scale, Tensor) or scale.numel() != 1:
        raise ValueError(f"scale must be a float32 tensor of one element, got {scale!r}")
    return scale.to(torch.float32).reshape(1)
