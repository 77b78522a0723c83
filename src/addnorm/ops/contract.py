"""What every backend and op of the add + norm contract shares (the contract itself is written in
:mod:`addnorm.ops.add_norm`): its dtype rules (the float dtypes, the statistics dtype, eps=None's default), the
dropout seed every backend draws the same way, and the validation that names a bad argument.

This module sits below every backend and op file: it imports nothing of addnorm.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = [
    "FLOAT_DTYPES",
    "as_dtype",
    "check_affine",
    "check_float",
    "check_disjoint",
    "check_like_x",
    "default_rms_eps",
    "draw_seed",
    "stats_dtype",
    "validate",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)  # membership by hash, for tensor dtypes: every call checks 2-4


def stats_dtype(x_dtype: torch.dtype, residual_dtype: torch.dtype) -> torch.dtype:
    """Statistics are fp32 unless x or the residual stream is fp64."""
    return torch.float64 if torch.float64 in (x_dtype, residual_dtype) else torch.float32


def draw_seed(device: torch.device) -> Tensor:
    """The dropout seed of one call: a 0-dim int64 tensor in [0, 2^31 - 1) drawn from ``device``'s generator, so it
    never leaves the device (a captured CUDA graph replays the draw itself, so each replay should get a fresh mask:
    tools/gpu_graph_check.py checks it on a GPU; activation checkpointing restores the generator). Every
    backend draws it this way, which is what makes a seed give the same mask on all of them."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    # Tensor.to with the same dtype returns t, but only after a trip through the dispatcher (~1-2 us on CPU, several
    # times per call): on small tensors that is a visible share of the whole op
    return t if t.dtype == dtype else t.to(dtype)


def default_rms_eps(x, residual, residual_dtype):
    """eps=None: machine epsilon of the dtype being normalized, residual_out's (residual_dtype, else the residual's
    dtype, else x's), as F.rms_norm takes its input's. x's dtype would be wrong for an fp32 residual stream with
    bf16 activations: 2^-7 instead of 1.2e-7. Unusable input is left for validate to name (None stays None)."""
    for dt in (residual_dtype, getattr(residual, "dtype", None), getattr(x, "dtype", None)):
        if dt is not None:
            return _MACHINE_EPS.get(dt) if dt in FLOAT_DTYPES else None
    return None


_MACHINE_EPS = {dt: torch.finfo(dt).eps for dt in FLOAT_DTYPES}  # torch.finfo() costs ~0.5 us a call


# --------------------------------------------------------------------------------------------------------------
# Validation: bad input gets an error naming the argument and what was seen
# --------------------------------------------------------------------------------------------------------------


def check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPE_SET:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_like_x(name: str, t: Tensor, x: Tensor) -> None:
    """A second stream input (residual, x1): float, x's shape, x's device."""
    check_float(name, t)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def check_affine(name: str, p: Tensor | None, n: int, x: Tensor) -> None:
    """A weight or bias (None allowed): float, shape (n,), x's device."""
    if p is None:
        return
    check_float(name, p)
    if p.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match x's last dim, got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {p.device}")


def validate(x, residual, weight, bias, eps, dropout_p, residual_dtype) -> None:
    check_float("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension (the normalized one), got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"x's last dimension (the normalized one) must be > 0, got shape {tuple(x.shape)}")
    if residual is not None:
        check_like_x("residual", residual, x)
    check_affine("weight", weight, n, x)
    check_affine("bias", bias, n, x)
    # before eps: eps=None is derived from residual_dtype
    if residual_dtype is not None and residual_dtype not in FLOAT_DTYPES:  # (any value: no hashing)
        raise TypeError(f"residual_dtype must be a floating dtype or None, got {residual_dtype!r}")
    if not _is_real(eps) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not _is_real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def _is_real(v) -> bool:
    # numbers.Real: numpy scalars too (np.float32 is no float subclass), as torch.nn.functional accepts them; float
    # and int first, since an isinstance check against the ABC costs about a microsecond on every call
    return type(v) is float or type(v) is int or isinstance(v, numbers.Real)


# --------------------------------------------------------------------------------------------------------------
# Memory overlap of two tensors a call writes (in-place forms, out=)
# --------------------------------------------------------------------------------------------------------------


def byte_span(t: Tensor) -> tuple[int, int]:
    """[start, end) of the bytes t's elements lie in, from its first element to one past its last, gaps of a
    strided view included. Addresses, except on the meta device, whose tensors all sit at address 0: there, offsets
    in t's storage."""
    size = t.element_size()
    start = t.storage_offset() * size if t.device.type == "meta" else t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))  # strides are >= 0 in torch
    return start, start + (last + 1) * size


def check_disjoint(name_a: str, a: Tensor, name_b: str, b: Tensor, why: str) -> None:
    """Refuse a and b when their byte spans intersect: two views of one buffer are fine when their ranges are
    disjoint (a serving workspace: ``buf[0]``, ``buf[1]``). Judged by range, not element by element: views whose
    elements interleave within one range (``buf[:, 0::2]``, ``buf[:, 1::2]``) are refused too, conservatively."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return
    if a.device.type == "meta" and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return  # meta tensors have no memory: only views of one storage can overlap
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    if a0 < b1 and b0 < a1:
        base = min(a0, b0)
        raise ValueError(
            f"{name_a} and {name_b} must not overlap in memory ({why}): {name_a} spans bytes [{a0 - base}, "
            f"{a1 - base}) and {name_b} [{b0 - base}, {b1 - base}) of the same memory. Views of one buffer are "
            "accepted when these byte ranges are disjoint; the check compares ranges, not elements, so views "
            f"whose elements interleave (buf[:, 0::2] and buf[:, 1::2]) are refused too: pass a clone of one"
        )
