"""Drop-in for ``flashinfer.norm``: FlashInfer's names, argument orders, defaults and in-place conventions, served
by addnorm's kernels on every backend (``backend='auto'``; ``ADDNORM_BACKEND`` picks one), CPU tensors included.

    import addnorm.compat.flashinfer as flashinfer
    flashinfer.norm.fused_add_rmsnorm(x, residual, weight, 1e-6)       # residual += x; x = RMSNorm(residual)

What each function is in addnorm's terms (docs/compat.md lists where the numerics differ):

- ``rmsnorm(input, weight=None, eps=1e-6, out=None, enable_pdl=None) -> out``: :func:`addnorm.rms_norm`, 2-D or 3-D input;
- ``gemma_rmsnorm(...)``: the same with ``1 + weight`` (``zero_centered_weight``);
- ``fused_add_rmsnorm(input, residual, weight=None, eps=1e-6, enable_pdl=None) -> None``: residual += input (rounded to
  residual's dtype), input = RMSNorm of the float32 sum before that rounding (FlashInfer's kernels keep it and
  normalize it; addnorm's own in-place op, :func:`addnorm.add_rms_norm_`, normalizes residual as stored);
  ``gemma_fused_add_rmsnorm`` and ``fused_add_rmsnorm_quant`` likewise;
- ``layernorm(input, gemma, beta, eps=1e-6) -> out``: :func:`addnorm.layer_norm` (gamma and beta may be fp32 with a
  bf16 input, as FlashInfer wants them);
- ``rmsnorm_quant(out, input, weight, scale, eps=1e-6, enable_pdl=None) -> None``, ``fused_add_rmsnorm_quant(out,
  input, residual, weight, scale, eps=1e-6, enable_pdl=None) -> None`` (residual updated in place, input only read)
  and ``layernorm_quant(out, input, gemma, beta, scale, eps=1e-6) -> None`` (no ``enable_pdl`` there):
  :func:`addnorm.add_rms_norm_quant` with a static scale, quantized to ``out``'s dtype, ``q = saturate(y * (1 /
  scale))`` as FlashInfer's reference computes it; ``layernorm_quant`` rounds LayerNorm's output to bf16 and divides
  by the scale, as FlashInfer's kernel does.

``enable_pdl`` (programmatic dependent launch, a Hopper launch attribute) is accepted and has no effect: addnorm's
launches do not use PDL. ``scale`` may be a 0-dim or a (1,) tensor of any float dtype (FlashInfer normalizes it the
same way), or a Python float with FlashInfer's FutureWarning (a float scale is deprecated there).

They refuse what FlashInfer refuses (its ``flashinfer/norm`` wrappers and ``csrc/norm.cu`` at 09928cf3), so code
developed here runs there: RMSNorm inputs of float16 or bfloat16 only, 2-D (3-D for ``rmsnorm``/``gemma_rmsnorm``),
``out`` of the input's dtype, the weight of the input's dtype (its kernels read it as that type), every tensor
with a unit stride in its last dimension; the quantized ops' ``out`` in FP8; LayerNorm (and ``layernorm_quant``) on bfloat16
input with float32 gamma and beta, ``layernorm_quant`` on contiguous rows. addnorm's own functions
(``addnorm.add_rms_norm`` and the rest) accept more: docs/compat.md lists it.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import Tensor

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm
from addnorm.ops.quant import add_rms_norm_quant
from addnorm.ops.quant.contract import QMAX

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


def _into(out: Tensor | None, y: Tensor, input: Tensor) -> Tensor:
    if out is None:
        return y
    if out.dtype != input.dtype or out.shape != input.shape:
        # FlashInfer's kernels write out in input's element type: another dtype is not converted there
        raise RuntimeError(
            f"out must have input's dtype {input.dtype} and shape {tuple(input.shape)}, got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    return out.copy_(y)


def _check_input(input: Tensor, dims=(2,)) -> None:
    """FlashInfer's RMSNorm kernels are built for float16 and bfloat16, on (batch, hidden) rows (and, for
    rmsnorm, (batch, heads, head_dim))."""
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"input must be float16 or bfloat16 (FlashInfer's norm kernels), got {input.dtype}")
    if input.dim() not in dims:
        raise RuntimeError(f"Unsupported input dimension: {input.dim()}")
    _check_last_dim(input, "input")


def _check_last_dim(t: Tensor | None, name: str) -> None:
    """FlashInfer's bindings take a row stride but no element stride: every tensor is checked for a unit stride in
    its last dimension (``CHECK_LAST_DIM_CONTIGUOUS_INPUT``; its message glues the name to the text)."""
    if t is not None and t.dim() > 0 and t.stride(-1) != 1:
        raise RuntimeError(f"{name}must be contiguous at last dimension")


def _check_weight(weight: Tensor | None, input: Tensor, required: bool = False) -> None:
    """FlashInfer's RMSNorm kernels read the weight through a pointer of the input's element type: another dtype
    is not converted there (its bytes are reinterpreted), so it is refused here; only ``rmsnorm`` and
    ``fused_add_rmsnorm`` take ``weight=None``."""
    if weight is None:
        if required:
            raise RuntimeError(
                "weight must be a tensor (only rmsnorm and fused_add_rmsnorm take weight=None in FlashInfer)"
            )
        return
    _check_last_dim(weight, "weight")
    if weight.dtype != input.dtype:
        raise RuntimeError(
            f"weight must have input's dtype {input.dtype} (FlashInfer's RMSNorm kernels read it as that type), "
            f"got {weight.dtype}"
        )


def _check_fp8_out(out: Tensor, input: Tensor) -> None:
    _check_last_dim(out, "output")
    if out.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise RuntimeError(f"out must be float8_e4m3fn or float8_e5m2 (FlashInfer quantizes to FP8), got {out.dtype}")
    if out.shape != input.shape:
        raise RuntimeError(f"out must have input's shape {tuple(input.shape)}, got {tuple(out.shape)}")


def _check_layernorm(input: Tensor, gemma: Tensor, beta: Tensor) -> None:
    """FlashInfer's LayerNorm binding: bfloat16 input, float32 gamma and beta, (batch, hidden)."""
    if input.dtype != torch.bfloat16:
        raise RuntimeError(f"input must be bfloat16 (FlashInfer's layernorm), got {input.dtype}")
    if gemma.dtype != torch.float32:
        raise RuntimeError(f"gamma must be float32 (FlashInfer's layernorm), got {gemma.dtype}")
    if beta.dtype != torch.float32:
        raise RuntimeError(f"beta must be float32 (FlashInfer's layernorm), got {beta.dtype}")
    if input.dim() != 2:
        raise RuntimeError(f"Unsupported input dimension: {input.dim()}")
    for t, name in ((input, "input"), (gemma, "gamma"), (beta, "beta")):
        _check_last_dim(t, name)


def _scale(scale, ref: Tensor) -> Tensor:
    """FlashInfer's scale conventions -> addnorm's: a float32 tensor of one element on input's device."""
    if not isinstance(scale, Tensor):
        warnings.warn(
            "a Python float scale is deprecated by FlashInfer and will stop working there; pass a float32 "
            "torch.Tensor of shape (1,)",
            FutureWarning,
            stacklevel=3,
        )
        return torch.tensor([float(scale)], dtype=torch.float32, device=ref.device)
    if scale.dim() > 1 or scale.numel() != 1:
        raise ValueError(f"scale must be a scalar tensor or shape (1,), got shape {tuple(scale.shape)}")
    return scale.to(device=ref.device, dtype=torch.float32).reshape(1)


def rmsnorm(
    input: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    out: Tensor | None = None,
    enable_pdl: bool | None = None,
) -> Tensor:
    """``out = input / RMS(input) * weight`` over the last dim (2-D or 3-D input; ``weight=None``, the default:
    no weight)."""
    _check_input(input, (2, 3))
    _check_weight(weight, input)
    _check_last_dim(out, "out")
    return _into(out, add_rms_norm(input, None, weight, eps)[0], input)


def gemma_rmsnorm(
    input: Tensor, weight: Tensor, eps: float = 1e-6, out: Tensor | None = None, enable_pdl: bool | None = None
) -> Tensor:
    """``out = input / RMS(input) * (1 + weight)``."""
    _check_input(input, (2, 3))
    _check_weight(weight, input, required=True)
    _check_last_dim(out, "out")
    return _into(out, add_rms_norm(input, None, weight, eps, zero_centered_weight=True)[0], input)


def fused_add_rmsnorm(
    input: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """In place: ``residual += input``; ``input = residual / RMS(residual) * weight`` (``weight=None``, the
    default: none)."""
    _check_input(input)
    _check_residual(input, residual)
    _check_weight(weight, input)
    _fused_add(input, residual, weight, eps, False)


def gemma_fused_add_rmsnorm(
    input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """In place: ``residual += input``; ``input = residual / RMS(residual) * (1 + weight)``."""
    _check_input(input)
    _check_residual(input, residual)
    _check_weight(weight, input, required=True)
    _fused_add(input, residual, weight, eps, True)


def layernorm(input: Tensor, gemma: Tensor, beta: Tensor, eps: float = 1e-6) -> Tensor:
    """LayerNorm over the last dim with weight ``gemma`` (FlashInfer's name for gamma) and bias ``beta``."""
    _check_layernorm(input, gemma, beta)
    return add_layer_norm(input, None, gemma, beta, eps)[0]


def rmsnorm_quant(
    out: Tensor, input: Tensor, weight: Tensor, scale, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """``out = quantize(input / RMS(input) * weight, scale)`` in ``out``'s dtype (static scale)."""
    s = _scale(scale, input)  # FlashInfer normalizes the scale before its kernel checks the tensors
    _check_input(input)
    _check_weight(weight, input, required=True)
    _check_fp8_out(out, input)
    add_rms_norm_quant(input, None, weight, eps, quant_dtype=out.dtype, scale=s, out=out)


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
    s = _scale(scale, input)  # FlashInfer normalizes the scale before its kernel checks the tensors
    _check_input(input)
    _check_residual(input, residual)
    _check_weight(weight, input, required=True)
    _check_fp8_out(out, input)
    h = _sum_in_place(input, residual)
    add_rms_norm_quant(h, None, weight, eps, quant_dtype=out.dtype, scale=s, out=out)


def layernorm_quant(
    out: Tensor,
    input: Tensor,
    gemma: Tensor,
    beta: Tensor,
    scale,
    eps: float = 1e-6,
) -> None:
    """``out = fp8(saturate(round_bf16(LayerNorm(input) * gemma + beta) / scale))`` in ``out``'s dtype: FlashInfer's
    kernel rounds the normalized value to the input's dtype, then divides by the scale (its reference says so)."""
    s = _scale(scale, input)  # FlashInfer normalizes the scale before its kernel checks the tensors
    _check_layernorm(input, gemma, beta)
    _check_fp8_out(out, input)
    if input.stride(0) != input.shape[1]:
        raise RuntimeError("input must be contiguous (FlashInfer's layernorm_quant takes no row stride)")
    if not out.is_contiguous():
        raise RuntimeError("output must be contiguous (FlashInfer's layernorm_quant takes no row stride)")
    qmax = QMAX[out.dtype]
    y = add_layer_norm(input, None, gemma, beta, eps)[0].float()
    out.copy_((y / s).clamp(-qmax, qmax).to(out.dtype))


def _sum_in_place(input: Tensor, residual: Tensor) -> Tensor:
    """``residual += input`` rounded to its dtype; returns the float32 sum *before* that rounding, which FlashInfer's
    fused-add kernels keep (in shared memory) and normalize, as its reference does."""
    h = input.float() + residual.float()
    residual.copy_(h)
    return h


def _fused_add(input: Tensor, residual: Tensor, weight, eps: float, gemma: bool) -> None:
    h = _sum_in_place(input, residual)
    input.copy_(add_rms_norm(h, None, weight, eps, zero_centered_weight=gemma, out_dtype=input.dtype)[0])


def _check_residual(input: Tensor, residual: Tensor) -> None:
    _check_last_dim(residual, "residual")
    if residual.dtype != input.dtype or residual.shape != input.shape:
        raise RuntimeError(
            f"residual must have input's dtype {input.dtype} and shape {tuple(input.shape)}, got {residual.dtype} "
            f"{tuple(residual.shape)}"
        )


# `flashinfer.norm.rmsnorm` and `flashinfer.rmsnorm` both resolve: this module stands for the package and for its
# `norm` submodule
norm = sys.modules[__name__]
