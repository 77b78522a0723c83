"""The host-overhead fast path of the norm-then-add ops (:mod:`addnorm.ops.norm_add`): a decode step's calls (a few
rows of a few thousand), where validation, backend resolution and numpy views would cost several times the kernel.
The rules of :mod:`addnorm.ops.fast_path`: the common inference case is checked with a few attribute reads,

    plain contiguous CPU tensors (no subclass, not while compiling or under a torch.func transform), nothing to
    differentiate, y, residual, weights and biases in one dtype (bf16, fp16, fp32) with matching shapes, eps a
    finite number >= 0 (or None for RMSNorm), below the cpu backend's parallel threshold, ``backend`` resolving to
    ``cpu``

and anything else (a bad argument included) answers None and goes to the general path, which validates it. What
runs is the general path's serial kernel (:mod:`addnorm.ops.cpu.norm_add_fast_launch`), with its bits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from addnorm.ops.backends import kernel_module, resolve_cpu_backend
from addnorm.ops.contract import MACHINE_EPS
from addnorm.ops.fast_path import _unsafe_write

__all__ = ["try_norm_add", "try_norm_add_"]

_TENSOR_TYPES = frozenset((Tensor, torch.nn.Parameter))
_HALF = (torch.bfloat16, torch.float16)  # the cast before the weight rounds something only here
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_increment_version = torch._C._increment_version


def _parallel_min() -> int:
    return kernel_module("cpu").PARALLEL_MIN_ELEMENTS


def _fast_launch():
    """addnorm.ops.cpu.norm_add_fast_launch, imported on first use (it compiles numba entry points)."""
    global _FAST
    if _FAST is None:
        from addnorm.ops.cpu import norm_add_fast_launch

        _FAST = norm_add_fast_launch
    return _FAST


_FAST = None


def _eps(eps, is_rms: bool, dt) -> float | None:
    if eps is None:
        return MACHINE_EPS[dt] if is_rms else 1e-5
    if (type(eps) is float or type(eps) is int) and 0 <= eps < math.inf:
        return float(eps)
    return None


def _flags_and_eps(y, residual, params, eps1, eps2, norms, zc, cbw, has_norm2):
    """(M, N, flags, eps1, eps2) when the call is the fast path's case, else None."""
    if _is_compiling() or type(y) is not Tensor or type(residual) is not Tensor:
        return None
    dt = y.dtype
    if (
        dt not in MACHINE_EPS
        or dt is torch.float64
        or not y.is_cpu
        or residual.dtype is not dt
        or not residual.is_cpu
        or residual.shape != y.shape
        or not y.ndim
        or not (y.is_contiguous() and residual.is_contiguous())
    ):
        return None
    n = y.shape[-1]
    for p in params:
        if p is not None and (
            type(p) not in _TENSOR_TYPES
            or p.dtype is not dt
            or not p.is_cpu
            or p.ndim != 1
            or p.shape[0] != n
            or not p.is_contiguous()
        ):
            return None
    if norms[0] not in ("rms", "layer") or norms[1] not in ("rms", "layer"):
        return None
    is_rms1, is_rms2 = norms[0] == "rms", norms[1] == "rms"
    w1, b1, w2, b2 = params
    if (b1 is not None and is_rms1) or (b2 is not None and is_rms2):
        return None  # the general path names the error
    e1, e2 = _eps(eps1, is_rms1, dt), _eps(eps2, is_rms2, dt)
    if e1 is None or e2 is None or not n or _functorch_active():
        return None
    if torch.is_grad_enabled() and (
        y.requires_grad
        or residual.requires_grad
        or (w1 is not None and w1.requires_grad)
        or (b1 is not None and b1.requires_grad)
        or (w2 is not None and w2.requires_grad)
        or (b2 is not None and b2.requires_grad)
    ):
        return None
    m = y.numel() // n
    if not m or m * n >= _parallel_min():
        return None
    half = dt in _HALF
    # the flag word of addnorm.ops.cpu.norm_add_fast_launch: bit k is the kernels' flag k
    flags = (is_rms1 << 0) | ((w1 is not None) << 1) | ((b1 is not None) << 2) | (has_norm2 << 4) | (is_rms2 << 5)
    flags |= ((w2 is not None) << 6) | ((b2 is not None) << 7)
    if cbw[0] and half and (w1 is not None or b1 is not None):
        flags |= 1 << 3
    if cbw[1] and half and has_norm2 and (w2 is not None or b2 is not None):
        flags |= 1 << 8
    # zero-centered weights (1 + w, computed by the launch as the general launch does); ZC1 = 1 << 10, ZC2 = 1 << 11
    flags |= (bool(zc[0] and w1 is not None) << 10) | (bool(zc[1] and has_norm2 and w2 is not None) << 11)
    return m, n, flags, e1, e2


def try_norm_add(y, residual, params, eps1, eps2, norms, zc, cbw, has_norm2, backend):
    """(h, out2 | None) when the fast path took the call, else None. params: (w1, b1, w2, b2)."""
    case = _flags_and_eps(y, residual, params, eps1, eps2, norms, zc, cbw, has_norm2)
    if case is None or resolve_cpu_backend(backend) != "cpu":
        return None
    fast = _fast_launch()
    m, n, flags, e1, e2 = case
    h = torch.empty_like(y)
    out2 = torch.empty_like(y) if has_norm2 else None
    fast.forward_ptr(y, residual, h, out2, *params, m, n, flags, e1, e2)
    return h, out2


def try_norm_add_(y, residual, params, eps1, eps2, norms, zc, cbw, has_norm2, backend) -> bool:
    """True when the fast path wrote the in-place result (h into residual, N2(h) into y), False to take the general
    path (which also raises every refusal)."""
    if type(residual) is not Tensor or y is residual or y.requires_grad or residual.requires_grad:
        return False
    case = _flags_and_eps(y, residual, params, eps1, eps2, norms, zc, cbw, has_norm2)
    if case is None:
        return False
    m, n, flags, e1, e2 = case
    # an inference tensor written outside inference mode, y and residual overlapping, or a weight/bias in written
    # memory (y is written with the second norm only, as the general path's _check_inplace has it): refused there
    w1, b1, w2, b2 = params
    if _unsafe_write(y, residual, m, has_norm2, w1, b1, w2, b2):
        return False
    if resolve_cpu_backend(backend) != "cpu":
        return False
    fast = _fast_launch()
    fast.forward_ptr(y, residual, residual, y if has_norm2 else None, *params, m, n, flags | fast.IN_PLACE, e1, e2)
    # (bump_versions) written through pointers: PyTorch's counters as copy_ leaves them
    _increment_version((y, residual) if has_norm2 else (residual,))
    return True
