"""Residual add + LayerNorm/RMSNorm + FP8/INT8 quantization in one call (the contract is in
:mod:`addnorm.ops.quant.contract`): the public functions, their in-place forms, the ``torch`` and ``reference``
backends and the dispatch to the fused ``cpu`` (numba) and ``triton`` kernels.

The ``torch`` and ``reference`` backends reuse the add + norm ops as they are: they ask them for the output in the
statistics dtype (which is the value before the final rounding) and quantize that with
:func:`addnorm.ops.quant.contract.quantize`. The kernel backends do the add, the norm and the quantization in one
pass over the row: x and residual read once, residual_out and q written once (3.5 bytes an element for bf16 in,
FP8 out and a bf16 stream, against 5.5 for add + norm followed by a separate quantize, and more for an fp32 y).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from addnorm.ops import torch_backend
from addnorm.ops.backends import BackendUnavailableError, kernel_module, resolve_backend
from addnorm.ops.contract import (
    AddNormSpec,
    as_dtype,
    bump_versions,
    check_bools,
    check_disjoint,
    check_not_written,
    check_writable,
    default_rms_eps,
    stats_dtype,
    validate,
)
from addnorm.ops.quant.contract import QMAX, min_scale, quantize, validate_quant

__all__ = ["add_layer_norm_quant", "add_layer_norm_quant_", "add_rms_norm_quant", "add_rms_norm_quant_"]

# backend name -> the module that runs the fused kernels (imported on first use)
_QUANT_MODULES = {"cpu": "addnorm.ops.cpu.quant", "triton": "addnorm.ops.triton.quant"}


def quant_module(name: str):
    return importlib.import_module(_QUANT_MODULES[name])


def _pre_rounding(x, residual, weight, bias, eps, is_rms, residual_dtype, zero_centered_weight, cast, backend):
    """(y, residual_out): y the add + norm op's value before its final rounding, in the statistics dtype."""
    cd = stats_dtype(x.dtype, residual_dtype)

    def run(w, b, out_dtype):
        if backend == "torch":
            spec = AddNormSpec(eps, is_rms, 0.0, residual_dtype, zero_centered_weight, False, out_dtype)
            return torch_backend.add_norm(x, residual, w, b, spec)
        n = x.shape[-1]
        out, res, _, _ = kernel_module(backend).forward(
            x.reshape(-1, n),
            None if residual is None else residual.reshape(-1, n),
            w,
            b,
            eps=eps,
            is_rms=is_rms,
            dropout_p=0.0,
            seed=None,
            residual_dtype=residual_dtype,
            zero_centered_weight=zero_centered_weight,
            store_residual_out=True,
            out_dtype=out_dtype,
            store_stats=False,
        )
        return out.view(x.shape), res.view(x.shape)

    if not cast:
        return run(weight, bias, cd)
    # Llama's order: the normalized value rounded to x's dtype, then the weight and bias applied in the stats dtype
    xhat, res = run(None, None, x.dtype)
    y = as_dtype(xhat, cd)
    if weight is not None:
        w = as_dtype(weight, cd)
        y = y * (w + 1 if zero_centered_weight else w)
    if bias is not None:
        y = y + as_dtype(bias, cd)
    return y, res


def _run(
    x,
    residual,
    weight,
    bias,
    eps,
    is_rms,
    quant_dtype,
    scale,
    group_size,
    scale_ub,
    zero_centered_weight,
    cast_before_weight,
    residual_dtype,
    backend,
    out,
    inplace,
):
    check_bools(("zero_centered_weight", zero_centered_weight), ("cast_before_weight", cast_before_weight))
    if is_rms:
        bias = None
        if eps is None:
            eps = default_rms_eps(x, residual, residual_dtype)
    validate(x, residual, weight, bias, eps, 0.0, residual_dtype)
    n = x.shape[-1]
    group = validate_quant(x, n, quant_dtype, scale, group_size, scale_ub)
    _check_no_grad(x, residual, weight, bias, inplace)
    if inplace:
        _check_inplace(x, residual, weight, bias, residual_dtype)
    rd = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    cd = stats_dtype(x.dtype, rd)
    cast = cast_before_weight and (weight is not None or bias is not None) and x.dtype != cd
    if out is not None:
        _check_out(out, x, residual, quant_dtype)
        check_writable("out", out)
        check_not_written((("out", out),), (("weight", weight), ("bias", bias)), "it is read while q is written")
    name = resolve_backend(backend, x.device)
    if name in _QUANT_MODULES:
        reason = quant_module(name).unavailable_reason(x.device, quant_dtype)
        if reason is not None:
            if backend != "auto":
                raise BackendUnavailableError(f"backend {name!r} cannot quantize to {quant_dtype} here: {reason}")
            name = "torch"
    if name in _QUANT_MODULES:
        return _run_kernel(
            name,
            x,
            residual,
            weight,
            bias,
            float(eps),
            is_rms,
            quant_dtype,
            scale,
            group,
            scale_ub,
            zero_centered_weight,
            cast,
            rd,
            out,
            inplace,
        )
    y, res = _pre_rounding(x, residual, weight, bias, float(eps), is_rms, rd, zero_centered_weight, cast, name)
    q, scales = quantize(y, quant_dtype, scale, group, scale_ub)
    if out is not None:
        q = out.copy_(q)
    if inplace:
        res = residual.copy_(res)
    return q, res, scales


def _run_kernel(
    name,
    x,
    residual,
    weight,
    bias,
    eps,
    is_rms,
    quant_dtype,
    scale,
    group,
    scale_ub,
    zero_centered_weight,
    cast,
    rd,
    out,
    inplace,
):
    n = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n)
    r2 = None if residual is None else residual.reshape(-1, n)
    m = x2.shape[0]
    direct = inplace and _writable_rows(residual)  # the kernels write the sum into residual itself
    if direct:
        h = residual.view(-1, n) if residual.is_contiguous() else r2
    else:
        h = torch.empty((m, n), dtype=rd, device=x.device)
    q = (
        out.view(-1, n)
        if out is not None and out.is_contiguous()
        else torch.empty((m, n), dtype=quant_dtype, device=x.device)
    )
    scales = None if scale is not None else torch.empty((m, n // group), dtype=torch.float32, device=x.device)
    ub = scale_ub
    if ub is not None and not isinstance(ub, Tensor):
        ub = torch.tensor([float(ub)], dtype=torch.float32, device=x.device)
    cd = stats_dtype(x.dtype, rd)
    w = None if weight is None else as_dtype(weight, cd)
    b = None if bias is None else as_dtype(bias, cd)
    if m:
        quant_module(name).quant_forward(
            x2,
            r2,
            w,
            b,
            h,
            q,
            scales,
            scale,
            ub,
            eps=eps,
            is_rms=is_rms,
            qmax=QMAX[quant_dtype],
            min_scale=min_scale(quant_dtype),
            group_size=group,
            zero_centered_weight=zero_centered_weight,
            cast_before_weight=cast,
            x_dtype=x.dtype,
        )
    q = q.view(x.shape)
    if out is not None and q.data_ptr() != out.data_ptr():
        q = out.copy_(q)
    elif out is not None:
        q = out
        bump_versions(out)  # written through its pointer by the kernel
    if inplace:
        if not direct:
            residual.copy_(h.view(residual.shape))
        elif m:
            bump_versions(residual)  # as copy_ would: a saved copy of residual is now stale
        res = residual
    else:
        res = h.view(x.shape)
    return q, res, (scale if scales is None else scales.view(*lead, n // group))


def _writable_rows(t: Tensor) -> bool:
    """Whether the kernels can write t's rows in place: (M, N) with a last-dim stride of 1, as a view."""
    if t.is_contiguous():
        return True
    return t.dim() == 2 and t.stride(-1) == 1


def _check_no_grad(x, residual, weight, bias, inplace) -> None:
    if not torch.is_grad_enabled() and not inplace:
        return
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.requires_grad and (torch.is_grad_enabled() or (inplace and name == "residual")):
            raise RuntimeError(
                f"{name} requires grad: the quantized add + norm ops are for inference (a gradient through an 8-bit "
                "output would be meaningless); call them under torch.no_grad() or torch.inference_mode(), or use "
                "add_rms_norm/add_layer_norm to train"
            )


def _check_inplace(x, residual, weight, bias, residual_dtype) -> None:
    if residual is None:
        raise ValueError("residual must be a tensor: the in-place form writes x + residual into it")
    check_writable("residual", residual)
    if residual.numel() > 1 and torch._debug_has_internal_overlap(residual) == 1:
        # an expanded (stride-0) view: writing it would store several sums in one element
        raise ValueError(
            f"residual has elements that share memory (an expanded or stride-0 view, shape {tuple(residual.shape)}, "
            f"strides {residual.stride()}): it cannot be written in place; pass residual.clone()"
        )
    check_not_written(
        (("residual", residual),), (("weight", weight), ("bias", bias)), "it is read while that is written"
    )
    if residual_dtype is not None and residual_dtype != residual.dtype:
        raise ValueError(
            f"residual_dtype {residual_dtype} must be residual's dtype {residual.dtype} in the in-place form "
            "(the sum is written into residual)"
        )
    check_disjoint("x", x, "residual", residual, "residual is written while x is read")


def _check_out(out: Tensor, x: Tensor, residual: Tensor | None, quant_dtype) -> None:
    if not isinstance(out, Tensor) or out.dtype != quant_dtype or out.shape != x.shape or out.device != x.device:
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"out must be a {quant_dtype} tensor of x's shape {tuple(x.shape)} on {x.device}, got {got}")
    if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
        raise ValueError(
            f"out must not be an expanded view (stride 0 in {tuple(out.stride())}: its elements share memory)"
        )
    # q written over x's or residual's bytes would corrupt inputs still to be read (kernels write row by row) or
    # be overwritten by residual's own update (in place): only disjoint bytes, as for the in-place ops
    check_disjoint("out", out, "x", x, "q is written while x is read")
    if residual is not None:
        check_disjoint("out", out, "residual", residual, "q is written while residual is read")


# --------------------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------------------

_DOC_KW = """
    ``quant_dtype``: ``torch.float8_e4m3fn`` (default), ``torch.float8_e5m2`` or ``torch.int8``. ``scale``: a static
    float32 dequantization scale (one element; ``y ~ q * scale``), returned as ``scales``; ``None``: dynamic scales,
    per token (``scales`` of shape ``(*x.shape[:-1], 1)``) or per ``group_size`` consecutive elements (shape
    ``(*x.shape[:-1], N // group_size)``), with amax clamped to ``scale_ub`` when given. ``out``: a tensor of x's shape
    in quant_dtype to write q into. The rounding, saturation and NaN/Inf rules are those of
    :mod:`addnorm.ops.quant.contract`. Inference only: inputs or weights that require grad (grad mode on) are an
    error."""


def add_rms_norm_quant(
    x: Tensor,
    residual: Tensor | None = None,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: Tensor | float | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    residual_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """``residual_out = x + residual``; ``q = quantize(RMSNorm(residual_out))``. Returns ``(q, residual_out, scales)``.
    ``eps=None``: the machine epsilon of residual_out's dtype, as in :func:`addnorm.add_rms_norm`."""
    return _run(
        x,
        residual,
        weight,
        None,
        eps,
        True,
        quant_dtype,
        scale,
        group_size,
        scale_ub,
        zero_centered_weight,
        cast_before_weight,
        residual_dtype,
        backend,
        out,
        False,
    )


def add_layer_norm_quant(
    x: Tensor,
    residual: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: Tensor | float | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    residual_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """``residual_out = x + residual``; ``q = quantize(LayerNorm(residual_out))``. Returns
    ``(q, residual_out, scales)``."""
    return _run(
        x,
        residual,
        weight,
        bias,
        eps,
        False,
        quant_dtype,
        scale,
        group_size,
        scale_ub,
        zero_centered_weight,
        cast_before_weight,
        residual_dtype,
        backend,
        out,
        False,
    )


def add_rms_norm_quant_(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: Tensor | float | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """In place: ``residual += x`` (in residual's dtype), then ``q = quantize(RMSNorm(residual))``. Returns
    ``(q, residual, scales)``; x is only read (q has another dtype), residual is written."""
    return _run(
        x,
        residual,
        weight,
        None,
        eps,
        True,
        quant_dtype,
        scale,
        group_size,
        scale_ub,
        zero_centered_weight,
        cast_before_weight,
        None,
        backend,
        out,
        True,
    )


def add_layer_norm_quant_(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: Tensor | float | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """In place: ``residual += x``, then ``q = quantize(LayerNorm(residual))``. Returns ``(q, residual, scales)``."""
    return _run(
        x,
        residual,
        weight,
        bias,
        eps,
        False,
        quant_dtype,
        scale,
        group_size,
        scale_ub,
        zero_centered_weight,
        cast_before_weight,
        None,
        backend,
        out,
        True,
    )


for _f in (add_rms_norm_quant, add_layer_norm_quant, add_rms_norm_quant_, add_layer_norm_quant_):
    _f.__doc__ += _DOC_KW
