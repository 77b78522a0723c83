"""Liger-Kernel's fused add + RMSNorm API (``liger_kernel.ops.fused_add_rms_norm`` and
``liger_kernel.transformers``), served by addnorm's kernels on every backend (GPU and CPU)::

    from addnorm.compat.liger import LigerFusedAddRMSNorm, LigerFusedAddRMSNormFunction, liger_fused_add_rms_norm

Both return ``(Y, S)``: ``S = X + R`` and ``Y = RMSNorm(S) * (offset + W)``, each in X's dtype, as Liger does.
How Liger's arguments map onto addnorm's contract (:mod:`addnorm.ops.add_norm`):

- ``casting_mode="llama"``: ``cast_before_weight=True`` (the normalized value is rounded to X's dtype before the
  weight). ``"gemma"``: one rounding at the end (addnorm's default). ``"none"``: Liger then computes in X's own
  dtype; addnorm keeps its fp32 statistics and rounds once, which is at least as accurate.
- ``offset=0``: the weight as is; ``offset=1``: ``zero_centered_weight`` (Gemma, fused); any other offset is
  composed: the weight plus the offset is formed in fp32 and passed as the weight (gradients flow back to W).
- ``in_place``: in Liger this only lets the *backward* write dX into dY's memory; the forward never overwrites X
  or R. addnorm's backward allocates dX, so the flag changes nothing here but memory; it is accepted for
  compatibility. (addnorm's own in-place op, :func:`addnorm.add_rms_norm_`, overwrites X and R in the forward,
  which no Liger argument asks for; use it directly for inference.)
- statistics (rstd) are fp32 (fp64 for fp64 input), in every mode.

``backend=`` (addnorm's: "auto", "torch", "reference", "cpu", "triton") is an extra keyword argument.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from addnorm.ops.add_norm import add_rms_norm

__all__ = ["LigerFusedAddRMSNormFunction", "liger_fused_add_rms_norm", "LigerFusedAddRMSNorm"]

_CASTING_MODES = ("llama", "gemma", "none")
# Liger's kernels also take the casting mode as its integer code (its _CASTING_MODE_* constants)
_CASTING_CODES = {0: "llama", 1: "gemma", -1: "none"}


def _casting_mode(casting_mode) -> str:
    """Liger's ``fused_add_rms_norm_forward``: a mode name or its integer code; anything else fails its
    ``assert`` (an AssertionError, kept here under ``python -O``)."""
    if isinstance(casting_mode, int) and not isinstance(casting_mode, bool) and casting_mode in _CASTING_CODES:
        return _CASTING_CODES[casting_mode]
    if isinstance(casting_mode, str) and casting_mode in _CASTING_MODES:
        return casting_mode
    raise AssertionError(f"Invalid casting mode: {casting_mode}")


def _fused_add_rms_norm(X, R, W, eps, offset, casting_mode, backend):
    casting_mode = _casting_mode(casting_mode)
    if not isinstance(offset, numbers.Real):
        raise TypeError(f"offset must be a number, got {type(offset).__name__}")
    if not isinstance(W, Tensor):
        raise TypeError(f"W must be a torch.Tensor, got {type(W).__name__}")
    if W.dim() == 0 or X.shape[-1] != W.shape[0]:
        # Liger's check, as an AssertionError with its message
        raise AssertionError("Incompatible hidden size dimension between tensor1.shape[1] and tensor2.shape[0]")
    zero_centered = bool(offset == 1)  # a bool, as the op requires: np.float64(1.0) == 1 is a numpy bool
    if offset not in (0, 1):
        W = W.float() + float(offset) if W.dtype != torch.float64 else W + float(offset)
    return add_rms_norm(
        X,
        R,
        W,
        eps,
        residual_dtype=X.dtype,
        out_dtype=X.dtype,
        zero_centered_weight=zero_centered,
        cast_before_weight=casting_mode == "llama",
        backend=backend,
    )


class LigerFusedAddRMSNormFunction:
    """Liger's autograd function, called the same way: ``LigerFusedAddRMSNormFunction.apply(X, R, W, eps,
    offset=0.0, casting_mode="llama", in_place=False)`` returns ``(Y, S)``; gradients reach X, R and W."""

    @staticmethod
    def apply(
        X: Tensor,
        R: Tensor,
        W: Tensor,
        eps: float,
        offset: float = 0.0,
        casting_mode: str = "llama",
        in_place: bool = False,
        row_mode=None,
        *,
        backend: str = "auto",
    ) -> tuple[Tensor, Tensor]:
        # in_place and row_mode tune Liger's own kernels (backward memory, launch shape); see the module docstring
        return _fused_add_rms_norm(X, R, W, eps, offset, casting_mode, backend)


def liger_fused_add_rms_norm(
    X: Tensor,
    R: Tensor,
    W: Tensor,
    eps: float,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = True,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Liger's functional form: ``(Y, S)`` with ``S = X + R``, ``Y = RMSNorm(S) * (offset + W)``."""
    return _fused_add_rms_norm(X, R, W, eps, offset, casting_mode, backend)


class LigerFusedAddRMSNorm(nn.Module):
    """Liger's module: ``forward(hidden_states, residual) -> (normed, hidden_states + residual)``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        init_fn: str = "ones",
        in_place: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if init_fn not in ("ones", "zeros"):
            raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")
        if casting_mode not in _CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {_CASTING_MODES}, got {casting_mode!r}")
        init = torch.ones if init_fn == "ones" else torch.zeros
        self.weight = nn.Parameter(init(hidden_size))
        self.variance_epsilon, self.offset, self.casting_mode, self.in_place = eps, offset, casting_mode, in_place
        self.backend = backend

    def forward(self, hidden_states: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return _fused_add_rms_norm(
            hidden_states, residual, self.weight, self.variance_epsilon, self.offset, self.casting_mode, self.backend
        )

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, "
            f"casting_mode={self.casting_mode}, in_place={self.in_place}"
        )
