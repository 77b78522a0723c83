"""The argument checks of :mod:`addnorm.compat.vllm_ops`: what vLLM's C++ refuses (its ``TORCH_CHECK`` texts, torch's
dispatch and ``data_ptr<T>()`` errors), and addnorm's own refusals where vLLM's kernel would write past a buffer.
Each check cites the vLLM source it follows; the ops call them before touching any output."""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn


def expected(condition: str) -> str:
    """The text of vLLM's ``TORCH_CHECK(condition)`` without a message."""
    return f"Expected {condition} to be true, but got false."


def check_quant_out(result: Tensor, input: Tensor) -> None:
    if result.dtype not in (FP8, torch.int8):
        raise RuntimeError(
            f"{expected('out.dtype() == kFp8Type || out.dtype() == torch::kInt8')} (result must be float8_e4m3fn or "
            f"int8 (vLLM's kernels), got {result.dtype})"
        )
    if not result.is_contiguous() or result.shape != input.shape:
        raise RuntimeError(
            f"{expected('out.is_contiguous()') + ' ' if not result.is_contiguous() else ''}(result must be "
            f"contiguous of input's shape {tuple(input.shape)})"
        )
    if input.stride(-1) != 1:
        raise RuntimeError("Input must be contiguous in the last dimension")


def check_common(result, input, weight, scale_ub, residual) -> None:
    """``rms_norm_dynamic_per_token_quant`` and ``rms_norm_per_block_quant``'s checks, in vLLM's order
    (csrc/quantization/fused_kernels/fused_layernorm_dynamic_per_token_quant.cu)."""
    check_quant_out(result, input)
    if scale_ub is not None and result.dtype != FP8:
        raise RuntimeError(
            f"{expected('out.dtype() == kFp8Type')} (scale_ub is for FP8 output only: vLLM's kernels refuse it "
            "with int8)"
        )
    if weight.dtype not in (input.dtype, torch.float32):
        raise RuntimeError(
            f"{expected('weight.dtype() == input.dtype()')} (weight must be of input's dtype {input.dtype} (or "
            f"float32), got {weight.dtype})"
        )
    if residual is not None and residual.dtype != input.dtype:
        raise RuntimeError(
            f"{expected('residual->scalar_type() == input.scalar_type()')} (residual must be of input's dtype "
            f"{input.dtype}, got {residual.dtype})"
        )


def dispatch_fused(input: Tensor, scale_ub: Tensor | None, name: str) -> None:
    """After the checks: the input's dtype dispatched, then ``scale_ub->data_ptr<float>()``."""
    dispatch_floating(input, name)
    if scale_ub is not None:
        float_ptr(scale_ub)
        check_scale_ub(scale_ub)


def check_scale_ub(scale_ub: Tensor) -> None:
    """vLLM reads ``scale_ub`` as one float (``*scale_ub->data_ptr<float>()``): of a tensor of several elements it
    would read the first and ignore the rest, of an empty one past its end. addnorm refuses both, naming the
    argument (after vLLM's own dtype check, ``float_ptr``)."""
    if scale_ub.numel() != 1:
        raise ValueError(
            f"scale_ub must hold one value (a float32 tensor of one element), got shape {tuple(scale_ub.shape)}"
        )


def check_scales(scales: Tensor, input: Tensor, groups: int) -> None:
    """vLLM's kernels write float32 scales, one per token (per group), through a raw pointer: another dtype is
    vLLM's ``TORCH_CHECK(scales.dtype() == torch::kFloat32)``; another shape (which vLLM's kernel would fill past
    its end or leave partly unwritten) is refused here too, with the same RuntimeError."""
    tokens = input.numel() // input.shape[-1]
    if scales.dtype != torch.float32 or tuple(scales.shape) != (tokens, groups):
        raise RuntimeError(
            f"{expected('scales.dtype() == torch::kFloat32') + ' ' if scales.dtype != torch.float32 else ''}"
            f"(scales must be a float32 tensor of shape (num_tokens, {'1' if groups == 1 else 'groups'}) = "
            f"({tokens}, {groups}), got {scales.dtype} of shape {tuple(scales.shape)})"
        )


_C10_NAMES = {
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float64: "Double",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.float8_e4m3fn: "Float8_e4m3fn",
    torch.float8_e5m2: "Float8_e5m2",
    torch.float8_e4m3fnuz: "Float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "Float8_e5m2fnuz",
}


def dispatch_floating(input: Tensor, name: str) -> None:
    """vLLM's ``VLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), name, ...)``: float32, float16 and bfloat16 only;
    another dtype raises torch's dispatch error (a NotImplementedError, which is a RuntimeError)."""
    if input.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotImplementedError(f"\"{name}\" not implemented for '{scalar_name(input.dtype)}'")


def float_ptr(t: Tensor) -> None:
    """``t.data_ptr<float>()``, which torch refuses for a tensor of another dtype (vLLM reads scales, ``scale_ub``
    and static scales this way: a bf16 or float64 scale is refused, not converted)."""
    if t.dtype != torch.float32:
        raise RuntimeError(f"expected scalar type Float but found {scalar_name(t.dtype)}")


def int_ptr(t: Tensor) -> None:
    """``t.data_ptr<int32_t>()`` (vLLM's int8 zero points)."""
    if t.dtype != torch.int32:
        raise RuntimeError(f"expected scalar type Int but found {scalar_name(t.dtype)}")


def torch_check(ok: bool, condition: str) -> None:
    """vLLM's ``TORCH_CHECK(condition)`` with no message: a RuntimeError naming the condition."""
    if not ok:
        raise RuntimeError(f"Expected {condition} to be true, but got false.")


def check_norm_weight(weight: Tensor | None, input: Tensor) -> None:
    """``rms_norm`` and ``fused_add_rms_norm`` (csrc/layernorm_kernels.cu at 0112cf23): a contiguous weight, read
    as ``data_ptr<scalar_t>()`` of the input's type, which torch refuses for another dtype."""
    if weight is None:
        return
    torch_check(weight.is_contiguous(), "weight.is_contiguous()")
    if weight.dtype != input.dtype:
        raise RuntimeError(f"expected scalar type {scalar_name(input.dtype)} but found {scalar_name(weight.dtype)}")


def same_type(t: Tensor, input: Tensor) -> None:
    """``t.data_ptr<scalar_t>()`` with scalar_t the input's type: torch refuses a tensor of another dtype."""
    if t.dtype != input.dtype:
        raise RuntimeError(f"expected scalar type {scalar_name(input.dtype)} but found {scalar_name(t.dtype)}")


def scalar_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype))


def fp8_out(result: Tensor, input: Tensor, name: str) -> None:
    """The FP8 quant ops' checks (csrc/quantization/w8a8/fp8/common.cu at cda1b348): unit last strides on input and
    output (their rows may be strided), the input's dtype and out's FP8 type dispatched. addnorm also refuses an
    ``out`` whose last dimension is not the input's (vLLM's kernel would write past it)."""
    if input.stride(-1) != 1:
        raise RuntimeError("last dimension of input must be contiguous")
    if result.stride(-1) != 1:
        raise RuntimeError("last dimension of output must be contiguous")
    dispatch_floating(input, f"{name}_scalar_type")
    if result.dtype != FP8:
        raise NotImplementedError(
            f"\"{name}_fp8_type\" not implemented for '{scalar_name(result.dtype)}' (result must be float8_e4m3fn)"
        )
    if result.shape[-1] != input.shape[-1] or result.numel() < input.numel():
        raise RuntimeError(
            f"result must have input's last dimension {input.shape[-1]} and at least its rows, got "
            f"{tuple(result.shape)}"
        )


def static_fp8_scales(scale: Tensor, m: int, n: int, group_shape: list[int] | None) -> Tensor:
    """The scale of each element (M, N) as vLLM's ``static_scaled_fp8_quant`` picks it, with its refusals: one
    element (or 0-D) per tensor; 1-D only with an explicit ``group_shape`` (-1: the full extent), whose scale count
    must match and vary along one dimension; 2-D (M / group_m, N / group_n), dividing M and N, an explicit
    ``group_shape`` matching the inferred one."""
    flat = scale.float()
    if scale.dim() == 0 or scale.numel() == 1:
        return flat.reshape(1, 1).expand(m, n)
    if scale.dim() == 1:
        if group_shape is None:
            raise RuntimeError(
                "1D scale requires explicit group_shape to disambiguate per-channel vs per-token quantization. "
                "Use group_shape=(-1, 1) for per-channel or group_shape=(1, -1) for per-token."
            )
        opt_m, opt_n = group_shape
        gm, gn = (m if opt_m == -1 else int(opt_m)), (n if opt_n == -1 else int(opt_n))
        want_m, want_n = m // gm, n // gn
        if scale.numel() != want_m * want_n:
            raise RuntimeError(
                f"1D scale length ({scale.numel()}) does not match expected size ({want_m * want_n}) for "
                f"group_shape ({opt_m}, {opt_n}) with input shape ({m}, {n})"
            )
        if want_m == 1:  # varies along N
            return flat[torch.arange(n) // gn].reshape(1, n).expand(m, n)
        if want_n == 1:  # varies along M
            return flat[torch.arange(m) // gm].reshape(m, 1).expand(m, n)
        raise RuntimeError(
            "1D scale can only be used when one of the scale dimensions is 1. For 2D group scaling, use a 2D scale "
            "tensor."
        )
    if scale.dim() == 2:
        s0, s1 = scale.shape
        if m % s0:
            raise RuntimeError(f"num_tokens ({m}) must be divisible by scale.size(0) ({s0})")
        if n % s1:
            raise RuntimeError(f"hidden_size ({n}) must be divisible by scale.size(1) ({s1})")
        gm, gn = m // s0, n // s1
        if group_shape is not None:
            opt_m, opt_n = group_shape
            em, en = (m if opt_m == -1 else int(opt_m)), (n if opt_n == -1 else int(opt_n))
            if (em, en) != (gm, gn):
                raise RuntimeError(
                    f"Explicit group_shape ({opt_m}, {opt_n}) does not match inferred group shape ({gm}, {gn}) from "
                    f"2D scale tensor shape ({s0}, {s1})"
                )
        return flat.repeat_interleave(gm, 0).repeat_interleave(gn, 1)
    raise RuntimeError(f"scale must be 0D, 1D, or 2D tensor, but got {scale.dim()}D")


def int8_out(result: Tensor, input: Tensor) -> None:
    """addnorm's own check (vLLM's int8 kernels write ``out`` as the input's shape without checking it)."""
    if result.dtype != torch.int8 or result.shape[-1] != input.shape[-1]:
        raise RuntimeError(
            f"result must be int8 with input's last dimension {input.shape[-1]}, got {result.dtype} of shape "
            f"{tuple(result.shape)}"
        )
