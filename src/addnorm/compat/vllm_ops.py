"""vLLM's norm and quantization custom ops as ``torch.ops.addnorm_vllm.<name>``, with the schemas (out-parameter
conventions, mutated arguments) of vLLM's ``torch.ops._C.<name>``, so ``torch.library.opcheck`` and
``torch.compile`` treat them as vLLM's. :mod:`addnorm.compat.vllm` (the ``vllm._custom_ops`` mirror) calls them;
importing either module registers them.

The arithmetic is vLLM's, read from its CUDA sources (vllm-project/vllm: ``csrc/layernorm_kernels.cu`` and
``csrc/layernorm_quant_kernels.cu`` at 0112cf23, ``csrc/quantization/fused_kernels/`` at 02a7fabd,
``csrc/quantization/w8a8/fp8/common.cu`` at 096d3dc9, ``csrc/quantization/w8a8/int8/scaled_quant.cu`` at 180df48e),
in plain PyTorch around addnorm's add + norm op:

- the norm: ``round(round(h * rstd) * weight)`` in the input's dtype (``rstd = rsqrt(mean(h^2) + eps)``), h the sum
  rounded to the input's dtype (``fused_add_rms_norm``, the static FP8 ops), or the float32 sum left unrounded
  (the dynamic per-token and per-block quant ops, which store the rounded sum into ``residual``);
- FP8 codes: ``fp8(fmax(-QMAX, fmin(v, QMAX)))`` (a NaN saturates to +QMAX, as CUDA's fminf makes it) with
  ``v = y / scale`` for dynamic per-token and per-block scales ("not inverted, for an exact match with FBGemm")
  and ``v = y * (1 / scale)`` for static and dynamic per-tensor scales;
- int8 codes: round half to even, saturated to [-128, 127]; ``y * (1 / scale)`` in the fused norm ops, ``x / scale``
  in ``static_scaled_int8_quant``, ``x * (127 / amax)`` in ``dynamic_scaled_int8_quant``;
- dynamic scales ``max(min(amax, scale_ub) / QMAX, floor)``, the floor ``1 / (QMAX * 512)`` for FP8 and float32's
  epsilon for int8 (none for the per-tensor FP8 scale).

Given the same ``rstd`` these are vLLM's codes bit for bit (the sum of squares is reduced in another order than
a CUDA block reduction, so ``rstd`` itself may differ in its last bit). ``set_order("addnorm")`` runs the fused
norm + quant ops on addnorm's fused kernels instead: one pass over the row, the float32 ``round(h * rstd) * weight``
quantized without vLLM's extra rounding to the input's dtype, every scale applied as ``* (1 / scale)``, int8 clamped
to [-127, 127] with a floor of ``1 / (127 * 512)`` (addnorm's contract, :mod:`addnorm.ops.quant.contract`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from addnorm.compat.vllm_checks import (
    FP8,
    check_common,
    check_norm_weight,
    check_scale_ub,
    check_scales,
    dispatch_floating,
    dispatch_fused,
    float_ptr,
    fp8_out,
    int8_out,
    int_ptr,
    same_type,
    scalar_name,
    static_fp8_scales,
    torch_check,
)
from addnorm.ops.add_norm import add_rms_norm
from addnorm.ops.quant import add_rms_norm_quant, add_rms_norm_quant_

__all__ = ["ORDERS", "get_order", "set_order"]

ORDERS = ("vllm", "addnorm")
_state = {"order": os.environ.get("ADDNORM_VLLM_ORDER", "vllm")}
if _state["order"] not in ORDERS:
    raise ValueError(f"ADDNORM_VLLM_ORDER must be one of {ORDERS}, got {_state['order']!r}")

FP8_MAX = 448.0
FP8_FLOOR = float(torch.tensor(1.0 / (FP8_MAX * 512.0), dtype=torch.float32))
INT8_FLOOR = float(torch.finfo(torch.float32).eps)


def get_order() -> str:
    """The rounding order of the fused norm + quant ops: ``"vllm"`` (default) or ``"addnorm"``."""
    return _state["order"]


def set_order(order: str) -> str:
    """Set the rounding order of the fused norm + quant ops (module docstring); returns the previous one.
    ``ADDNORM_VLLM_ORDER`` sets it at import."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    previous, _state["order"] = _state["order"], order
    return previous


# ---------------------------------------------------------------------------------------------------------------
# vLLM's arithmetic
# ---------------------------------------------------------------------------------------------------------------


def _fp8(v: Tensor) -> Tensor:
    """vLLM's float -> e4m3fn: fmaxf(-448, fminf(v, 448)) (NaN -> 448), then round to nearest even."""
    return torch.fmax(torch.fmin(v, torch.tensor(FP8_MAX)), torch.tensor(-FP8_MAX)).to(FP8)


def _int8(v: Tensor) -> Tensor:
    """``cvt.rni.sat.s8.f32``: round half to even, saturate to [-128, 127]; NaN -> 0."""
    return torch.nan_to_num(v, nan=0.0).round().clamp(-128, 127).to(torch.int8)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _weighted(xhat: Tensor, weight: Tensor | None, dt: torch.dtype) -> Tensor:
    """``static_cast<scalar_t>(x * rms) * weight[i]``, as float32: both factors in dt, their product rounded to dt
    (a float32 weight with a 16-bit input: the float32 product, unrounded)."""
    y = xhat.to(dt).float()
    if weight is None:
        return y
    y = y * weight.float()
    return y.to(dt).float() if weight.dtype == dt else y


def _norm_unrounded_sum(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y float32 (M, N), h float32 (M, N)): the dynamic quant kernels' norm of the unrounded float32 sum."""
    h = _rows(x).float()
    if residual is not None:
        h = h + _rows(residual).float()
    xhat = add_rms_norm(h, None, None, eps)[0]  # h * rstd, rounded once to float32
    return _weighted(xhat, weight, x.dtype), h


def _dynamic_scales(y: Tensor, groups: int, qmax: float, floor: float, scale_ub: Tensor | None) -> Tensor:
    amax = y.reshape(y.shape[0], groups, -1).abs().amax(-1)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()))
    return torch.clamp(amax / qmax, min=floor)


def _quant_fused(y: Tensor, s: Tensor, quant_dtype: torch.dtype) -> Tensor:
    """The fused norm + dynamic quant kernels: FP8 divides by the scale, int8 multiplies by its inverse."""
    s = s.repeat_interleave(y.shape[-1] // s.shape[-1], dim=-1)
    return _fp8(y / s) if quant_dtype == FP8 else _int8(y * (1.0 / s))


# ---------------------------------------------------------------------------------------------------------------
# The ops (vLLM's schemas)
# ---------------------------------------------------------------------------------------------------------------

_LIB = "addnorm_vllm"


def _op(name: str, schema: str, mutates: tuple[str, ...]):
    def register(fn):
        op = torch.library.custom_op(f"{_LIB}::{name}", fn, mutates_args=mutates, schema=schema)
        op.register_fake(lambda *args, **kwargs: None)  # every op returns (): its fake writes nothing
        return op

    return register


@_op("rms_norm", "(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()", ("result",))
def rms_norm(result: Tensor, input: Tensor, weight: Tensor | None, epsilon: float) -> None:
    torch_check(result.is_contiguous(), "out.is_contiguous()")
    torch_check(input.stride(-1) == 1, "input.stride(-1) == 1")
    check_norm_weight(weight, input)
    dispatch_floating(input, "rms_norm_kernel")
    same_type(result, input)  # out.data_ptr<scalar_t>(): out is written in the input's type, not cast
    result.copy_(add_rms_norm(input, None, weight, epsilon, cast_before_weight=True)[0])


@_op(
    "fused_add_rms_norm",
    "(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float epsilon) -> ()",
    ("input", "residual"),
)
def fused_add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> None:
    torch_check(residual.is_contiguous(), "residual.is_contiguous()")
    check_norm_weight(weight, input)
    dispatch_floating(input, "fused_add_rms_norm_kernel")
    same_type(residual, input)  # residual.data_ptr<scalar_t>()
    out, res = add_rms_norm(input, residual, weight, epsilon, cast_before_weight=True)
    residual.copy_(res)
    input.copy_(out)


def _static_fp8(result, input, residual, weight, scale, epsilon) -> None:
    """``rms_norm_static_fp8_quant`` / ``fused_add_rms_norm_static_fp8_quant`` (csrc/layernorm_quant_kernels.cu at
    0112cf23): ``TORCH_CHECK(out.is_contiguous())`` (and the residual's, by the caller), the input's dtype
    dispatched (float32, float16, bfloat16), out's FP8 type dispatched, the weight read as the input's type (or
    float32: vLLM's tests at 0a88d969 pass a float32 weight with a bf16 input) and the scale as float32
    (``data_ptr``). addnorm also refuses an ``out`` of another shape and a scale of more than one
    element (vLLM's kernel would write past ``out`` or read only ``scale[0]``)."""
    torch_check(result.is_contiguous(), "out.is_contiguous()")
    name = "rms_norm_kernel" if residual is None else "fused_add_rms_norm_kernel"
    dispatch_floating(input, f"{name}_scalar_type")
    if result.dtype != FP8:
        raise NotImplementedError(f"\"{name}_fp8_type\" not implemented for '{scalar_name(result.dtype)}'")
    if weight.dtype not in (input.dtype, torch.float32):  # 0a88d969's tests pass a float32 weight (bf16 input)
        raise RuntimeError(f"expected scalar type {scalar_name(input.dtype)} but found {scalar_name(weight.dtype)}")
    float_ptr(scale)
    if result.shape != input.shape:
        raise RuntimeError(f"result must be of input's shape {tuple(input.shape)}, got {tuple(result.shape)}")
    if scale.numel() != 1:
        raise RuntimeError(f"scale must have one element, got shape {tuple(scale.shape)}")
    if get_order() == "addnorm":
        fn = add_rms_norm_quant if residual is None else add_rms_norm_quant_
        fn(input, residual, weight, epsilon, scale=scale.float().reshape(1), cast_before_weight=True, out=result)
        return
    out, res = add_rms_norm(input, residual, weight, epsilon, cast_before_weight=True)
    if residual is not None:
        residual.copy_(res)
    result.copy_(_fp8(out.float() * (1.0 / scale.float().reshape(()))))  # "invert scale to avoid division"


@_op(
    "rms_norm_static_fp8_quant",
    "(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    ("result",),
)
def rms_norm_static_fp8_quant(result: Tensor, input: Tensor, weight: Tensor, scale: Tensor, epsilon: float) -> None:
    _static_fp8(result, input, None, weight, scale, epsilon)


@_op(
    "fused_add_rms_norm_static_fp8_quant",
    "(Tensor(a!) result, Tensor input, Tensor(b!) residual, Tensor weight, Tensor scale, float epsilon) -> ()",
    ("result", "residual"),
)
def fused_add_rms_norm_static_fp8_quant(
    result: Tensor, input: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, epsilon: float
) -> None:
    torch_check(residual.is_contiguous(), "residual.is_contiguous()")
    _static_fp8(result, input, residual, weight, scale, epsilon)


@_op(
    "rms_norm_dynamic_per_token_quant",
    "(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, float epsilon, Tensor? scale_ub, "
    "Tensor(c!)? residual) -> ()",
    ("result", "scale", "residual"),
)
def rms_norm_dynamic_per_token_quant(
    result: Tensor,
    input: Tensor,
    weight: Tensor,
    scale: Tensor,
    epsilon: float,
    scale_ub: Tensor | None,
    residual: Tensor | None,
) -> None:
    check_common(result, input, weight, scale_ub, residual)
    check_scales(scale, input, 1)
    dispatch_fused(input, scale_ub, "rms_norm_dynamic_per_token_quant_dispatch")
    if get_order() == "addnorm":
        kw = dict(quant_dtype=result.dtype, scale_ub=scale_ub, cast_before_weight=True, out=result)
        fn = add_rms_norm_quant if residual is None else add_rms_norm_quant_
        scale.copy_(fn(input, residual, weight, epsilon, **kw)[2].reshape(scale.shape))
        return
    y, h = _norm_unrounded_sum(input, residual, weight, epsilon)
    fp8 = result.dtype == FP8
    s = _dynamic_scales(y, 1, FP8_MAX if fp8 else 127.0, FP8_FLOOR if fp8 else INT8_FLOOR, scale_ub)
    if residual is not None:
        residual.copy_(h.view(residual.shape))
    result.copy_(_quant_fused(y, s, result.dtype).view(result.shape))
    scale.copy_(s)


@_op(
    "rms_norm_per_block_quant",
    "(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, float epsilon, Tensor? scale_ub, "
    "Tensor(c!)? residual, int group_size, bool is_scale_transposed) -> ()",
    ("result", "scale", "residual"),
)
def rms_norm_per_block_quant(
    result: Tensor,
    input: Tensor,
    weight: Tensor,
    scale: Tensor,
    epsilon: float,
    scale_ub: Tensor | None,
    residual: Tensor | None,
    group_size: int,
    is_scale_transposed: bool,
) -> None:
    check_common(result, input, weight, scale_ub, residual)
    if group_size not in (64, 128):
        raise RuntimeError(f"Unsupported group size: {group_size}")
    n = input.shape[-1]
    if n % group_size:
        raise RuntimeError(f"group_size {group_size} must divide the hidden size {n}")
    check_scales(scale, input, n // group_size)
    if scale.dim() == 2 and scale.stride(1) > 1 and not is_scale_transposed:
        raise RuntimeError("Outer scale stride must be 1 when scales are not transposed")
    dispatch_fused(input, scale_ub, "rms_norm_per_block_quant_fp_dispatch")
    y, h = _norm_unrounded_sum(input, residual, weight, epsilon)
    fp8 = result.dtype == FP8
    s = _dynamic_scales(y, n // group_size, FP8_MAX if fp8 else 127.0, FP8_FLOOR if fp8 else INT8_FLOOR, scale_ub)
    if residual is not None:
        residual.copy_(h.view(residual.shape))
    result.copy_(_quant_fused(y, s, result.dtype).view(result.shape))
    scale.copy_(s)


@_op(
    "static_scaled_fp8_quant",
    "(Tensor(a!) result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()",
    ("result",),
)
def static_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor, group_shape: list[int] | None = None) -> None:
    if input.stride(-1) != 1:
        raise RuntimeError("last dimension of input must be contiguous")
    if result.stride(-1) != 1:
        raise RuntimeError("last dimension of output must be contiguous")
    x = _rows(input)
    m, n = x.shape
    s = static_fp8_scales(scale, m, n, group_shape)
    fp8_out(result, input, "scaled_fp8_quant_kernel")
    float_ptr(scale)
    result[:m].copy_(_fp8(x.float() * (1.0 / s)).view(result[:m].shape))


@_op("dynamic_scaled_fp8_quant", "(Tensor(a!) result, Tensor input, Tensor(b!) scale) -> ()", ("result", "scale"))
def dynamic_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor) -> None:
    fp8_out(result, input, "scaled_fp8_quant_kernel")
    float_ptr(scale)
    x = _rows(input).float()
    s = (x.abs().amax() if x.numel() else x.new_zeros(())) / FP8_MAX  # atomicMax of each row's amax / QMAX
    scale.copy_(s.reshape(scale.shape))
    result[: x.shape[0]].copy_(_fp8(x * (1.0 / s)).view(result[: x.shape[0]].shape))


@_op(
    "dynamic_per_token_scaled_fp8_quant",
    "(Tensor(a!) result, Tensor input, Tensor(b!) scale, Tensor? scale_ub) -> ()",
    ("result", "scale"),
)
def dynamic_per_token_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor, scale_ub: Tensor | None) -> None:
    fp8_out(result, input, "dynamic_per_token_scaled_fp8_quant_kernel")
    float_ptr(scale)
    if scale_ub is not None:
        float_ptr(scale_ub)
        check_scale_ub(scale_ub)
    x = _rows(input).float()
    s = _dynamic_scales(x, 1, FP8_MAX, FP8_FLOOR, scale_ub)
    scale[: x.shape[0]].copy_(s.view(scale[: x.shape[0]].shape))
    result[: x.shape[0]].copy_(_fp8(x / s).view(result[: x.shape[0]].shape))


def _int8_rn_azp(v: Tensor, azp: Tensor) -> Tensor:
    """``int32_to_int8(float_to_int32_rn(v) + azp)``: round to int32 (saturating), add the zero point, saturate."""
    r = torch.nan_to_num(v, nan=0.0).round().clamp(-(2.0**31), 2.0**31 - 1).to(torch.int64)
    return (r + azp.to(torch.int64)).clamp(-128, 127).to(torch.int8)


@_op(
    "static_scaled_int8_quant",
    "(Tensor(a!) result, Tensor input, Tensor scale, Tensor? azp) -> ()",
    ("result",),
)
def static_scaled_int8_quant(result: Tensor, input: Tensor, scale: Tensor, azp: Tensor | None) -> None:
    """csrc/quantization/w8a8/int8/scaled_quant.cu at 180df48e: contiguous input and output, one scale (float32)
    and one zero point (int32), the input's dtype dispatched."""
    torch_check(input.is_contiguous(), "input.is_contiguous()")
    torch_check(result.is_contiguous(), "out.is_contiguous()")
    torch_check(scale.numel() == 1, "scale.numel() == 1")
    torch_check(azp is None or azp.numel() == 1, "!azp || azp->numel() == 1")
    dispatch_floating(input, "static_scaled_int8_quant_kernel")
    int8_out(result, input)
    float_ptr(scale)
    if azp is not None:
        int_ptr(azp)
    x, s = input.float(), scale.float().reshape(())
    result.copy_(_int8(x / s) if azp is None else _int8_rn_azp(x * (1.0 / s), azp.reshape(())))


@_op(
    "dynamic_scaled_int8_quant",
    "(Tensor(a!) result, Tensor input, Tensor(b!) scale, Tensor(c!)? azp) -> ()",
    ("result", "scale", "azp"),
)
def dynamic_scaled_int8_quant(result: Tensor, input: Tensor, scale: Tensor, azp: Tensor | None) -> None:
    """csrc/quantization/w8a8/int8/scaled_quant.cu at 180df48e: contiguous input, output, scales and zero points,
    the input's dtype dispatched, float32 scales and int32 zero points."""
    torch_check(input.is_contiguous(), "input.is_contiguous()")
    torch_check(result.is_contiguous(), "out.is_contiguous()")
    torch_check(scale.is_contiguous(), "scales.is_contiguous()")
    torch_check(azp is None or azp.is_contiguous(), "!azp || azp->is_contiguous()")
    dispatch_floating(input, "dynamic_scaled_int8_quant_kernel")
    int8_out(result, input)
    float_ptr(scale)
    if azp is not None:
        int_ptr(azp)
    x = _rows(input).float()
    if azp is None:
        amax = x.abs().amax(-1, keepdim=True)
        scale.copy_((amax / 127.0).view(scale.shape))
        inv = torch.where(amax == 0, 0.0, 127.0 / amax)
        result.copy_(_int8(x * inv).view(result.shape))
        return
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (hi - lo) / 255.0
    zp = (-128.0 - lo / s).round()  # nearbyintf: half to even
    scale.copy_(s.view(scale.shape))
    azp.copy_(zp.to(azp.dtype).view(azp.shape))
    result.copy_(_int8_rn_azp(x * (1.0 / s), zp).view(result.shape))
