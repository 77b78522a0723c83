"""The host-overhead fast path of the add + norm ops: calls where the host's Python, not memory, sets the time, as
in a decode step (a few rows of a few thousand, every call the same).

    add_rms_norm(x, r, w) at 1 x 4096 bf16: eager's ``x + r; F.rms_norm`` takes ~35 us on this CPU, the numba
    kernel 4; the general path spends ~20-60 us more in validation, backend resolution and numpy views.

:func:`try_add_norm` and :func:`try_add_norm_` are the first thing :func:`addnorm.ops.add_norm.run_add_norm` and the
in-place ops run. They take the call when it is the common inference case, checked with a few attribute reads:

    plain strided CPU tensors (no subclass, not while compiling or under a torch.func transform), nothing to
    differentiate, x, residual, weight and bias in one dtype with matching shapes, no dropout, no dtype options
    that differ from x's, eps a finite number >= 0 (or None for RMSNorm)

and return None (in place: False) for anything else, which the general path then validates and runs. So a bad
argument, or a weight converted, resized, moved or replaced since the last call, is never served here: it fails a
check and meets the general path's error, with the same message as ever. Every check reads the tensors of this call,
so nothing goes stale between calls.

What they run is the general path's computation with its bits (tests/ops/test_fast_path.py):
- on the ``cpu`` backend (contiguous tensors, bf16/fp16/fp32, below the parallel threshold): the serial numba
  kernel through :mod:`addnorm.ops.cpu.fast_launch` (raw addresses, no numpy views, no weight conversion; a
  zero-centered weight's 1 + w computed there in fp32, as the general launch computes it);
- on the ``torch`` backend, RMSNorm only: eager's own ops, :func:`addnorm.ops.torch_backend.rms_norm_one_dtype`,
  as that backend runs them. (LayerNorm has no such shortcut: ``F.layer_norm`` on a half tensor differs from the
  contract's fp32 computation by an ulp in some rows, so it stays on the general path.) A zero-centered weight
  only in fp32/fp64, where ``weight + 1`` in x's dtype is the contract's 1 + w; in a half dtype 1 + w is not a
  half value, so those calls take the general path.

The backend is resolved by :func:`addnorm.ops.backends.resolve_cpu_backend`: the general path's answer and errors,
remembered per ``backend`` argument (auto's choice reads no shape: batch invariance); ``ADDNORM_BACKEND`` is read on
every call, and a set override is resolved every call, not remembered.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from addnorm.ops.backends import kernel_module, resolve_cpu_backend
from addnorm.ops.contract import MACHINE_EPS
from addnorm.ops.torch_backend import rms_norm_one_dtype

__all__ = ["try_add_norm", "try_add_norm_"]

_STRIDED = torch.strided  # (sparse and mkldnn layouts: the general path)
_TENSOR_TYPES = frozenset((Tensor, torch.nn.Parameter))  # a parameter passes; subclasses (FakeTensor, DTensor) don't
_STATS_DTYPES = (torch.float32, torch.float64)  # x in one of these: the cast before the weight rounds nothing
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_inference_mode_enabled = torch.is_inference_mode_enabled
_increment_version = torch._C._increment_version  # what contract.bump_versions calls, without its frame


def _unsafe_write(a: Tensor, b: Tensor, rows: int, write_a: bool, w, c, w2=None, c2=None) -> bool:
    """Whether the general path must judge an in-place call that writes b, and a when ``write_a`` (else a is only
    read), reading weights/biases w, c, w2, c2 (None when absent): an inference tensor written outside inference
    mode, a and b overlapping, or a weight/bias overlapping a written tensor. That path raises the refusal.

    What the fast path has already established makes this a few integer comparisons, each address and size read
    once, nothing allocated: a and b contiguous, of one shape and dtype (one byte size), ``rows`` rows; every
    weight/bias contiguous and 1-D with one row's elements in that dtype (one row's bytes)."""
    if not _inference_mode_enabled() and (b.is_inference() or (write_a and a.is_inference())):
        return True
    a0, b0 = a.data_ptr(), b.data_ptr()
    size = a.nbytes
    b1 = b0 + size
    if a0 < b1 and b0 < a0 + size:
        return True  # views of one buffer whose bytes overlap (disjoint ones are fine, as on the general path)
    a1 = a0 + size if write_a else a0  # (a only read: an empty written range)
    row = size // rows
    # unrolled, not a loop over a tuple: ~0.1 us less a call
    if w is not None:
        p0 = w.data_ptr()
        if (p0 < b1 and b0 < p0 + row) or (p0 < a1 and a0 < p0 + row):
            return True
    if c is not None:
        p0 = c.data_ptr()
        if (p0 < b1 and b0 < p0 + row) or (p0 < a1 and a0 < p0 + row):
            return True
    if w2 is not None:
        p0 = w2.data_ptr()
        if (p0 < b1 and b0 < p0 + row) or (p0 < a1 and a0 < p0 + row):
            return True
    if c2 is not None:
        p0 = c2.data_ptr()
        if (p0 < b1 and b0 < p0 + row) or (p0 < a1 and a0 < p0 + row):
            return True
    return False


def _fast_case(x, residual, weight, bias, eps, is_rms):
    """(M, N, eps) when the call is the fast path's case (the module docstring), else None. Every test is a cheap
    attribute read; anything unusual (a bad argument included) answers None and goes to the general path."""
    if _is_compiling() or type(x) is not Tensor or not x.is_cpu or not x.ndim:
        return None
    dt = x.dtype
    if x.layout is not _STRIDED or (
        residual is not None
        and (
            type(residual) is not Tensor
            or residual.dtype is not dt
            or not residual.is_cpu
            or residual.layout is not _STRIDED
            or residual.shape != x.shape
        )
    ):
        return None
    n = x.shape[-1]
    for p in (weight, bias):
        if p is not None and (
            type(p) not in _TENSOR_TYPES
            or p.dtype is not dt
            or not p.is_cpu
            or p.layout is not _STRIDED
            or p.ndim != 1
            or p.shape[0] != n
        ):
            return None
    if dt not in MACHINE_EPS:  # not a float dtype
        return None
    if eps is None:
        if not is_rms:
            return None
        eps = MACHINE_EPS[dt]
    elif not ((type(eps) is float or type(eps) is int) and 0 <= eps < math.inf):
        return None
    if not n or _functorch_active():
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ):
        return None
    m = x.numel() // n
    return (m, n, float(eps)) if m else None


def _kernel_fits(cpu, x, residual, weight, bias, m: int, n: int, rows_contiguous: bool = False) -> bool:
    """Whether the serial kernel takes the call (``rows_contiguous``: x's and residual's contiguity already seen)."""
    return (
        m * n < cpu.PARALLEL_MIN_ELEMENTS  # large calls: the general launch (threads), where Python is noise
        and x.dtype in cpu.fast_launch.DTYPES
        and (rows_contiguous or (x.is_contiguous() and (residual is None or residual.is_contiguous())))
        and (weight is None or weight.is_contiguous())
        and (bias is None or bias.is_contiguous())
    )


def _flags(cpu, residual, weight, bias, is_rms, zero_centered_weight, cast_before_weight, dtype) -> int:
    fl = cpu.fast_launch
    has_b = bias is not None and not is_rms
    flags = (fl.HAS_RES if residual is not None else 0) | (fl.HAS_W if weight is not None else 0)
    if zero_centered_weight and weight is not None:
        flags |= fl.ZC
    flags |= (fl.HAS_B if has_b else 0) | (fl.IS_RMS if is_rms else 0)
    # the cast changes nothing without an affine step, or in fp32 (the statistics dtype): as run_add_norm drops it
    if cast_before_weight and (weight is not None or has_b) and dtype not in _STATS_DTYPES:
        flags |= fl.CAST
    return flags


def try_add_norm(
    x,
    residual,
    weight,
    bias,
    eps,
    is_rms,
    dropout_p,
    residual_dtype,
    zero_centered_weight,
    cast_before_weight,
    out_dtype,
    backend,
):
    """run_add_norm's arguments; (out, residual_out) when the fast path took the call, else None."""
    if (
        type(dropout_p) not in (float, int)
        or dropout_p != 0
        or (residual_dtype is not None and residual_dtype is not getattr(x, "dtype", None))
        or (out_dtype is not None and out_dtype is not getattr(x, "dtype", None))
    ):
        return None
    rows = _fast_case(x, residual, weight, bias, eps, is_rms)
    if rows is None:
        return None
    m, n, eps = rows
    name = resolve_cpu_backend(backend)
    if name == "cpu":
        cpu = kernel_module("cpu")
        if not _kernel_fits(cpu, x, residual, weight, bias, m, n):
            return None
        out = torch.empty_like(x)
        # without a residual, residual_out is x itself (nothing added, nothing rounded), as on the general path
        res_out = None if residual is None else torch.empty_like(x)
        flags = _flags(cpu, residual, weight, bias, is_rms, zero_centered_weight, cast_before_weight, x.dtype)
        if res_out is not None:
            flags |= cpu.fast_launch.STORE
        cpu.fast_launch.forward_ptr(x, residual, weight, bias, out, res_out, m, n, flags, eps)
        return out, (x if res_out is None else res_out)
    if name == "torch" and is_rms:
        if zero_centered_weight and weight is not None:
            if x.dtype not in _STATS_DTYPES:
                return None  # the contract's 1 + w is fp32, no half value: the general path
            weight = weight + 1  # the general path's 1 + w, in the statistics dtype that x has
        cast = cast_before_weight and x.dtype not in _STATS_DTYPES
        return rms_norm_one_dtype(x, residual, weight, eps, cast)
    return None


def try_add_norm_(x, residual, weight, bias, eps, is_rms, zero_centered_weight, cast_before_weight, backend) -> bool:
    """The in-place ops' arguments; True when the fast path wrote x and residual, False to take the general path
    (which also raises every refusal: tensors that require grad, aliasing, shared memory)."""
    if type(residual) is not Tensor or x is residual:
        return False
    rows = _fast_case(x, residual, weight, bias, eps, is_rms)
    if rows is None or x.requires_grad or residual.requires_grad:
        return False
    if torch.is_grad_enabled() and (
        (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
    ):
        return False
    # contiguous (no element stored twice; a weight/bias spanning one row's bytes from its address, which is what
    # _unsafe_write compares: a strided weight starting before the written rows reaches into them), then the
    # general path's write-safety checks (_unsafe_write)
    if not (
        x.is_contiguous()
        and residual.is_contiguous()
        and (weight is None or weight.is_contiguous())
        and (bias is None or bias.is_contiguous())
    ):
        return False
    m, n, eps = rows
    if _unsafe_write(x, residual, m, True, weight, bias):
        return False
    name = resolve_cpu_backend(backend)
    if name == "cpu":
        cpu = kernel_module("cpu")
        if not _kernel_fits(cpu, x, residual, weight, bias, m, n, True):
            return False
        flags = _flags(cpu, residual, weight, bias, is_rms, zero_centered_weight, cast_before_weight, x.dtype)
        flags |= cpu.fast_launch.STORE | cpu.fast_launch.IN_PLACE
        cpu.fast_launch.forward_ptr(x, residual, weight, bias, x, residual, m, n, flags, eps)
        _increment_version((x, residual))  # (bump_versions) written through pointers: counters as add_/copy_ leave
        return True
    if name == "torch" and is_rms:
        if zero_centered_weight and weight is not None:
            if x.dtype not in _STATS_DTYPES:
                return False  # (as out of place)
            weight = weight + 1
        # residual += x, then x = RMSNorm(residual) with the one-dtype ops: the out-of-place call's bits
        residual.add_(x)
        cast = cast_before_weight and x.dtype not in _STATS_DTYPES
        x.copy_(rms_norm_one_dtype(residual, None, weight, eps, cast)[0])
        return True
    return False
