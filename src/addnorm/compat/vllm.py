"""Drop-in for ``vllm._custom_ops`` (the norm and quantization functions): vLLM's names, signatures, defaults,
returns and refusals, served by addnorm's kernels on every backend, CPU tensors included.

    from addnorm.compat import vllm as ops                  # before: from vllm import _custom_ops as ops
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)       # residual += x; x = RMSNorm(residual)
    q, scales = ops.rms_norm_dynamic_per_token_quant(x, weight, 1e-6, torch.float8_e4m3fn)
    q, scale = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)

Importing this module registers ``torch.ops.addnorm_vllm.<name>`` with the schemas of vLLM's ``torch.ops._C.<name>``
(out-parameter forms: ``rms_norm_dynamic_per_token_quant(result, input, weight, scale, epsilon, scale_ub,
residual)`` and so on; :mod:`addnorm.compat.vllm_ops`), which the functions here call as vLLM's call its ``_C`` ops.
The arithmetic is vLLM's, op by op (FP8 divides by a dynamic per-token or per-block scale and multiplies by the
inverse of a static or per-tensor one; int8 inverts in the fused ops), bit for bit given the same ``rstd``;
``set_order("addnorm")`` switches the fused norm + quant ops to addnorm's one-pass fused kernels and contract
(docs/compat.md says which to use when). The vLLM order is the default because code moved from vLLM expects vLLM's
codes; the addnorm order is one rounding more accurate and reads and writes each element once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.compat import vllm_ops  # noqa: F401 (registers torch.ops.addnorm_vllm)
from addnorm.compat.vllm_ops import get_order, set_order

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_static_fp8_quant",
    "get_order",
    "rms_norm",
    "rms_norm_dynamic_per_token_quant",
    "rms_norm_per_block_quant",
    "rms_norm_static_fp8_quant",
    "scaled_fp8_quant",
    "scaled_int8_quant",
    "set_order",
    "static_scaled_fp8_quant",
]

_ops = torch.ops.addnorm_vllm


def _require(ok: bool, message: str) -> None:
    """vLLM's Python wrappers refuse with ``assert``; the same AssertionError here, kept under ``python -O``."""
    if not ok:
        raise AssertionError(message)


def rms_norm(out: Tensor, input: Tensor, weight: Tensor | None, epsilon: float) -> None:
    """``out = round(round(input * rstd) * weight)`` in input's dtype (vLLM's order)."""
    _ops.rms_norm(out, input, weight, epsilon)


def fused_add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> None:
    """In place: ``residual += input`` (rounded), ``input = round(round(residual * rstd) * weight)``."""
    _ops.fused_add_rms_norm(input, residual, weight, epsilon)


def rms_norm_static_fp8_quant(out: Tensor, input: Tensor, weight: Tensor, scale: Tensor, epsilon: float) -> None:
    """``torch.ops._C.rms_norm_static_fp8_quant``: ``out = fp8(RMSNorm(input) * (1 / scale))``, saturated."""
    _ops.rms_norm_static_fp8_quant(out, input, weight, scale, epsilon)


def fused_add_rms_norm_static_fp8_quant(
    out: Tensor, input: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, epsilon: float
) -> None:
    """``torch.ops._C.fused_add_rms_norm_static_fp8_quant``: ``residual += input``; ``out = fp8(RMSNorm(residual) *
    (1 / scale))``; input is only read."""
    _ops.fused_add_rms_norm_static_fp8_quant(out, input, residual, weight, scale, epsilon)


def static_scaled_fp8_quant(
    out: Tensor, input: Tensor, scale: Tensor, group_shape: tuple[int, int] | None = None
) -> None:
    """``torch.ops._C.static_scaled_fp8_quant``: ``out = fp8(input * (1 / scale))``, saturated; ``scale`` one
    element, 1-D with ``group_shape`` ((-1, 1) per channel, (1, -1) per token) or 2-D per group, as vLLM's."""
    _ops.static_scaled_fp8_quant(out, input, scale, None if group_shape is None else list(group_shape))


def rms_norm_dynamic_per_token_quant(
    input: Tensor,
    weight: Tensor,
    epsilon: float,
    quant_dtype: torch.dtype,
    scale_ub: Tensor | None = None,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, scales)``: RMSNorm(input) (of ``residual += input``, in place, when a residual is given) quantized to
    ``quant_dtype`` (float8_e4m3fn or int8) with one float32 scale per token, ``scales`` of shape (num_tokens, 1)."""
    output = torch.empty(input.shape, dtype=quant_dtype, device=input.device)
    scales = torch.empty((input.numel() // input.shape[-1], 1), device=input.device, dtype=torch.float32)
    _ops.rms_norm_dynamic_per_token_quant(output, input, weight, scales, epsilon, scale_ub, residual)
    return output, scales


def rms_norm_per_block_quant(
    input: Tensor,
    weight: Tensor,
    epsilon: float,
    quant_dtype: torch.dtype,
    group_size: list[int],
    scale_ub: Tensor | None = None,
    residual: Tensor | None = None,
    is_scale_transposed: bool = False,
    tma_alignment: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(out, scales)``: RMSNorm(input) quantized per block of ``group_size[1]`` (64 or 128) consecutive elements;
    ``scales`` (num_tokens, hidden // group), column-major when ``is_scale_transposed`` (its rows padded to a
    multiple of ``tma_alignment`` (0 or 4) when given, as vLLM lays them out for TMA)."""
    _require(len(group_size) == 2, f"group_size must be [1, group], got {group_size}")
    output = torch.empty(input.shape, dtype=quant_dtype, device=input.device)
    groups, tokens = input.shape[-1] // group_size[1], input.numel() // input.shape[-1]
    kw = dict(device=input.device, dtype=torch.float32)
    if is_scale_transposed and tma_alignment:
        m = input.shape[-2]
        aligned = (m + tma_alignment - 1) // tma_alignment * tma_alignment
        stride = (1, aligned) if input.dim() == 2 else (aligned * groups, 1, aligned)
        scales = torch.empty_strided((*input.shape[:-2], m, groups), stride, **kw)
    elif is_scale_transposed:
        scales = torch.empty((groups, tokens), **kw).transpose(0, 1)
    else:
        scales = torch.empty((tokens, groups), **kw)
    _require(tma_alignment in (0, 4), f"Expected TMA alignment 0 or 4, but got {tma_alignment}")
    flat = scales if scales.dim() == 2 else scales.view(tokens, groups) if scales.is_contiguous() else None
    target = flat if flat is not None else torch.empty((tokens, groups), **kw)
    _ops.rms_norm_per_block_quant(
        output, input, weight, target, epsilon, scale_ub, residual, group_size[1], is_scale_transposed
    )
    if flat is None:
        scales.copy_(target.view(scales.shape))
    return output, scales


def scaled_fp8_quant(
    input: Tensor,
    scale: Tensor | None = None,
    num_token_padding: int | None = None,
    scale_ub: Tensor | None = None,
    use_per_token_if_dynamic: bool = False,
    output: Tensor | None = None,
    group_shape: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, scale)``: input (2-D) quantized to float8_e4m3fn: with ``scale`` (one element, per channel or per
    group) statically, ``x * (1 / scale)``; without, a dynamic per-tensor scale ``amax / 448`` (``x * (1 / scale)``)
    or per token (``use_per_token_if_dynamic``: ``max(min(amax, scale_ub) / 448, 1 / (448 * 512))``, ``x / scale``).
    ``num_token_padding`` pads out's rows (the padding rows are zero)."""
    _require(input.ndim == 2, f"input must be 2-D, got {input.ndim}-D")
    shape = tuple(input.shape)
    if num_token_padding:
        shape = (max(num_token_padding, input.shape[0]), shape[1])
    if output is None:
        output = torch.zeros(shape, device=input.device, dtype=torch.float8_e4m3fn)
    else:
        _require(num_token_padding is None, "padding not supported if output passed in")
        _require(output.dtype == torch.float8_e4m3fn, f"output must be float8_e4m3fn, got {output.dtype}")
    if scale is None:
        if use_per_token_if_dynamic:
            scale = torch.empty((shape[0], 1), device=input.device, dtype=torch.float32)
            _ops.dynamic_per_token_scaled_fp8_quant(output, input, scale, scale_ub)
        else:
            scale = torch.empty(1, device=input.device, dtype=torch.float32)
            _ops.dynamic_scaled_fp8_quant(output, input, scale)
    else:
        _ops.static_scaled_fp8_quant(output, input, scale, None if group_shape is None else list(group_shape))
    return output, scale


def scaled_int8_quant(
    input: Tensor, scale: Tensor | None = None, azp: Tensor | None = None, symmetric: bool = True
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(out, scales, azp)``: input quantized to int8: with ``scale``, ``round(x / scale)`` (``+ azp`` after
    ``round(x * (1 / scale))`` when asymmetric); without, per token: ``scale = amax / 127``, ``round(x * (127 /
    amax))`` (asymmetric: ``scale = (max - min) / 255``, ``azp = round(-128 - min / scale)``), saturated to
    [-128, 127]."""
    output = torch.empty_like(input, dtype=torch.int8)
    if scale is not None:
        _require(symmetric == (azp is None), "azp must only be provided for asymmetric quantization.")
        _ops.static_scaled_int8_quant(output, input, scale, azp)
        return output, scale, azp
    input_scales = torch.empty((input.numel() // input.shape[-1], 1), device=input.device, dtype=torch.float32)
    input_azp = None if symmetric else torch.empty_like(input_scales, dtype=torch.int32)
    _ops.dynamic_scaled_int8_quant(output, input.contiguous(), input_scales, input_azp)
    return output, input_scales, input_azp
