"""Residual add + norm + FP8/INT8 quantization: the contract every backend implements, its validation, and the
quantizer of the ``torch`` backend (the readable definition of the conversion).

    residual_out = x + residual                   # exactly as add_rms_norm / add_layer_norm store it
    y            = the value add_rms_norm / add_layer_norm compute before their final rounding, in the
                   statistics dtype (fp32; fp64 when x or the residual stream is fp64, then rounded once to fp32).
                   With cast_before_weight the normalized value is first rounded to x's dtype, then weighted
                   (and biased) in the statistics dtype: the order of Hugging Face's Llama norm and of vLLM.
    q            = encode(saturate(y * inv))      # quant_dtype: float8_e4m3fn, float8_e5m2 or int8

All of the quantization arithmetic is float32, in this order, on every backend:

    static       scale given (a float32 tensor of one element, the *dequantization* scale: y ~ q * scale)
    per token    amax  = max |y| over the row          (scales: (*x.shape[:-1], 1))
    per group    amax  = max |y| over each group of ``group_size`` consecutive elements of a row
                                                        (scales: (*x.shape[:-1], N // group_size), DeepSeek's 1 x 128)
    dynamic      amax  = min(amax, scale_ub)            (when scale_ub is given)
                 scale = max(amax / QMAX, MIN_SCALE)    (a division, rounded once; MIN_SCALE = 1 / (QMAX * 512), the
                                                         floor vLLM uses: an all-zero row gets a finite scale and q = 0)
    all          inv   = 1 / scale                      (one division per scale, then a *multiplication* per element:
                                                         y * inv, not y / scale, on every backend)
                 saturate: clamp to [-QMAX, QMAX], QMAX = 448 (e4m3fn), 57344 (e5m2), 127 (int8: symmetric, so
                 -y gives -q; vLLM's int8 clamps at -128)
                 encode: round to nearest, ties to even (fp8: bitwise torch's ``.to(float8_*)`` of the saturated
                 float32 value; int8: ``torch.round``)

NaN and Inf: a NaN in y gives a NaN code (fp8) or 0 (int8, which has no NaN); under dynamic scaling it also makes
its row's (or group's) amax, hence its scale, NaN, so the whole row (group) is NaN in fp8 and the scale says so. An
Inf saturates to +-QMAX under a static scale (and under dynamic scaling with ``scale_ub``, which clamps amax); without
``scale_ub`` its amax and scale are Inf, inv is 0, the Inf element's q is NaN (Inf * 0) and its neighbours 0.

Inference only: an input or weight that requires grad (with grad mode on) is an error: an 8-bit gradient would be
meaningless. A static scale must be > 0 and finite, a ``scale_ub`` > 0 (not NaN): checked for numbers and CPU tensors,
where reading the value is free; a CUDA tensor's value is not read (that would synchronize with the device).

Kernel backends (``cpu``, ``triton``) are modules with

    quant_forward(x, residual, weight, bias, h_out, q, scales, scale, scale_ub, *, eps, is_rms, qmax, min_scale,
                  group_size, zero_centered_weight, cast_before_weight, x_dtype) -> None
        x, residual, h_out: (M, N) rows (last dim contiguous, rows may be strided; h_out may be residual itself,
        which is the in-place form); q: (M, N) contiguous in quant_dtype; scales: (M, N // group_size) float32
        (dynamic) or None (static); scale: the static scale (one float32 element) or None; scale_ub: one float32
        element or None; group_size: N for per token; weight and bias already in the statistics dtype (weight
        stored as w - 1 when zero_centered_weight); x_dtype: what cast_before_weight rounds to. The backend's
        ``unavailable_reason(device, quant_dtype)`` says where it cannot run.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

__all__ = ["QMAX", "QUANT_DTYPES", "min_scale", "quantize", "validate_quant"]

# The largest finite value of each quantized dtype: saturation clamps there
QMAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.int8: 127.0,
}
QUANT_DTYPES = tuple(QMAX)


def min_scale(quant_dtype: torch.dtype) -> float:
    """The floor of a dynamic scale, 1 / (QMAX * 512) rounded to float32 (vLLM's ``min_scaling_factor``)."""
    return float(torch.tensor(1.0 / (QMAX[quant_dtype] * 512.0), dtype=torch.float32))


def validate_quant(x: Tensor, n: int, quant_dtype, scale, group_size, scale_ub) -> int:
    """Check the quantization arguments; return the group size (n for per token and static)."""
    if quant_dtype not in QMAX:
        names = ", ".join(str(d) for d in QUANT_DTYPES)
        raise TypeError(f"quant_dtype must be one of {names}, got {quant_dtype!r}")
    if scale is not None:
        _check_scalar_tensor("scale", scale, x)
        if scale.device.type == "cpu" and not 0 < float(scale) < float("inf"):
            raise ValueError(f"scale must be > 0 and finite (a dequantization scale), got {float(scale)}")
        if group_size is not None:
            raise ValueError("group_size is for dynamic scales (scale=None); a static scale covers the whole tensor")
        if scale_ub is not None:
            raise ValueError("scale_ub bounds dynamic scales (scale=None); it has no meaning with a static scale")
        return n
    if scale_ub is not None:
        if isinstance(scale_ub, Tensor):
            _check_scalar_tensor("scale_ub", scale_ub, x)
            if scale_ub.device.type == "cpu" and not float(scale_ub) > 0:  # a 0 or NaN bound: every code saturates
                raise ValueError(f"scale_ub must be > 0, got {float(scale_ub)}")
        elif not isinstance(scale_ub, numbers.Real) or isinstance(scale_ub, bool) or not scale_ub > 0:
            raise ValueError(f"scale_ub must be a number > 0 or a float32 tensor of one element, got {scale_ub!r}")
    if group_size is None:
        return n
    if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    if n % group_size:
        raise ValueError(f"group_size {group_size} must divide x's last dimension {n} (N % group_size == 0)")
    return int(group_size)


def _check_scalar_tensor(name: str, t, x: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a float32 tensor of one element, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(f"{name} must be a float32 tensor of one element, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def _nan_max(a: Tensor, b: Tensor | float) -> Tensor:
    return torch.maximum(a, torch.as_tensor(b, dtype=a.dtype, device=a.device))


def quantize(
    y: Tensor, quant_dtype: torch.dtype, scale: Tensor | None, group_size: int, scale_ub
) -> tuple[Tensor, Tensor]:
    """The conversion of the contract in plain PyTorch: ``y`` (..., N) float -> (q, scales). Static when ``scale``
    is given (then ``scales`` is ``scale`` itself), else dynamic per group of ``group_size`` (N: per token)."""
    y = y.to(torch.float32)
    qmax = QMAX[quant_dtype]
    if scale is not None:
        scales = scale
        inv = (1.0 / scale.reshape(())).expand(y.shape)
    else:
        lead, n = y.shape[:-1], y.shape[-1]
        # amax propagates NaN (torch.amax does): a NaN row is visible in its scale
        amax = y.reshape(*lead, n // group_size, group_size).abs().amax(dim=-1)
        if scale_ub is not None:
            amax = torch.minimum(amax, torch.as_tensor(scale_ub, dtype=torch.float32, device=y.device).reshape(()))
        scales = _nan_max(amax / qmax, min_scale(quant_dtype))
        inv = (1.0 / scales).repeat_interleave(group_size, dim=-1)
    v = (y * inv).clamp(-qmax, qmax)  # clamp keeps NaN
    if quant_dtype == torch.int8:
        q = torch.where(v.isnan(), 0.0, v).round().to(torch.int8)
    else:
        q = v.to(quant_dtype)
    return q, scales
