"""Drop-in for ``flashinfer.norm``: FlashInfer's names, argument orders, defaults and in-place conventions, served
by addnorm's kernels on every backend (``backend='auto'``; ``ADDNORM_BACKEND`` picks one), CPU tensors included.

    import addnorm.compat.flashinfer as flashinfer
    flashinfer.norm.fused_add_rmsnorm(x, residual, weight, 1e-6)       # residual += x; x = RMSNorm(residual)

What each function is in addnorm's terms (docs/compat.md lists where the numerics differ):

- ``rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None) -> out``: :func:`addnorm.rms_norm`, 2-D or 3-D input;
- ``gemma_rmsnorm(...)``: the same with ``1 + weight`` (``zero_centered_weight``);
- ``fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None) -> None``: :func:`addnorm.add_rms_norm_`
  (residual += input in residual's dtype, then input = RMSNorm(residual)); ``gemma_fused_add_rmsnorm`` likewise;
- ``layernorm(input, gemma, beta, eps=1e-6) -> out``: :func:`addnorm.layer_norm` (gamma and beta may be fp32 with a
  bf16 input, as FlashInfer wants them);
- ``rmsnorm_quant(out, input, weight, scale, eps=1e-6, enable_pdl=None) -> None``, ``fused_add_rmsnorm_quant(out,
  input, residual, weight, scale, eps=1e-6, enable_pdl=None) -> None`` (residual updated in place, input only read)
  and ``layernorm_quant(out, input, gemma, beta, scale, eps=1e-6, enable_pdl=None) -> None`` (the same convention):
  :func:`addnorm.add_rms_norm_quant` / :func:`addnorm.add_layer_norm_quant` with a static scale, quantized to
  ``out``'s dtype; ``q = saturate(y * (1 / scale))`` as FlashInfer's reference computes it.

``enable_pdl`` (programmatic dependent launch, a Hopper launch attribute) is accepted and has no effect: addnorm's
launches do not use PDL. ``scale`` may be a float, a 0-dim or a (1,) tensor of any float dtype (FlashInfer
normalizes it the same way).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm
from addnorm.ops.add_norm_inplace import add_rms_norm_
from addnorm.ops.quant import add_layer_norm_quant, add_rms_norm_quant, add_rms_norm_quant_

__all__ = [
    "device_support_pdl",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "layernorm_quant",
    "norm",
    "rmsnorm",
    "rmsnorm_quant",
]


def device_support_pdl(device: torch.device | str) -> bool:
    """Whether ``device`` could use programmatic dependent launch (a CUDA GPU of sm_90 or newer), as FlashInfer's
    helper of that name answers; addnorm accepts ``enable_pdl`` either way and does not use it."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def _into(out: Tensor | None, y: Tensor) -> Tensor:
    if out is None:
        return y
    return out.copy_(y)


def _scale(scale, ref: Tensor) -> Tensor:
    """FlashInfer's scale conventions -> addnorm's: a float32 tensor of one element on input's device."""
    if not isinstance(scale, Tensor):
        return torch.tensor([float(scale)], dtype=torch.float32, device=ref.device)
    if scale.numel() != 1:
        raise ValueError(f"scale must be a scalar tensor or shape (1,), got shape {tuple(scale.shape)}")
    return scale.to(device=ref.device, dtype=torch.float32).reshape(1)


def rmsnorm(
    input: Tensor, weight: Tensor, eps: float = 1e-6, out: Tensor | None = None, enable_pdl: bool | None = None
) -> Tensor:
    """``out = input / RMS(input) * weight`` over the last dim (2-D or 3-D input)."""
    return _into(out, add_rms_norm(input, None, weight, eps)[0])


def gemma_rmsnorm(
    input: Tensor, weight: Tensor, eps: float = 1e-6, out: Tensor | None = None, enable_pdl: bool | None = None
) -> Tensor:
    """``out = input / RMS(input) * (1 + weight)``."""
    return _into(out, add_rms_norm(input, None, weight, eps, zero_centered_weight=True)[0])


def fused_add_rmsnorm(
    input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """In place: ``residual += input``; ``input = residual / RMS(residual) * weight``."""
    add_rms_norm_(input, residual, weight, eps)


def gemma_fused_add_rmsnorm(
    input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """In place: ``residual += input``; ``input = residual / RMS(residual) * (1 + weight)``."""
    add_rms_norm_(input, residual, weight, eps, zero_centered_weight=True)


def layernorm(input: Tensor, gemma: Tensor, beta: Tensor, eps: float = 1e-6) -> Tensor:
    """LayerNorm over the last dim with weight ``gemma`` (FlashInfer's name for gamma) and bias ``beta``."""
    return add_layer_norm(input, None, gemma, beta, eps)[0]


def rmsnorm_quant(
    out: Tensor, input: Tensor, weight: Tensor, scale, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """``out = quantize(input / RMS(input) * weight, scale)`` in ``out``'s dtype (static scale)."""
    add_rms_norm_quant(input, None, weight, eps, quant_dtype=out.dtype, scale=_scale(scale, input), out=out)


def fused_add_rmsnorm_quant(
    out: Tensor,
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    scale,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``; ``out = quantize(residual / RMS(residual) * weight, scale)``."""
    add_rms_norm_quant_(input, residual, weight, eps, quant_dtype=out.dtype, scale=_scale(scale, input), out=out)


def layernorm_quant(
    out: Tensor,
    input: Tensor,
    gemma: Tensor,
    beta: Tensor,
    scale,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """``out = quantize(LayerNorm(input) * gemma + beta, scale)`` in ``out``'s dtype (rmsnorm_quant's convention)."""
    add_layer_norm_quant(input, None, gemma, beta, eps, quant_dtype=out.dtype, scale=_scale(scale, input), out=out)


# `flashinfer.norm.rmsnorm` and `flashinfer.rmsnorm` both resolve: this module stands for the package and for its
# `norm` submodule
norm = sys.modules[__name__]
