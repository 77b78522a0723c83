"""Every normalization a Transformer block can use, behind one factory: ``make_norm(kind, d_model)``.

Kinds (x: the last dimension, d features):

- ``"layernorm"``:  w * (x - mean) / sqrt(var + eps) + b               (:class:`addnorm.nn.LayerNorm`, fused kernels)
- ``"rmsnorm"``:    w * x / sqrt(mean(x^2) + eps)                        (:class:`addnorm.nn.RMSNorm`, fused kernels)
- ``"scalenorm"``:  g * x / max(||x||, eps), one scalar g initialised to sqrt(d)   (Nguyen & Salazar 2019)
- ``"dyt"``:        gamma * tanh(alpha * x) + beta, scalar alpha initialised to 0.5  (Dynamic Tanh, 2025)
- ``"batchnorm"``:  per feature channel over batch and sequence positions, optionally leaving padded positions out
                    of the statistics. Its statistics mix positions (and, in a causal LM, future tokens), which is
                    exactly why Transformers do not use it; it is here for comparisons.
- ``"none"``:       identity.

Every module here follows the calling convention of :class:`addnorm.nn.LayerNorm`: ``norm(x)`` returns a tensor and
``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``, so the blocks can call any kind the same way.
Only LayerNorm and RMSNorm run the add and the norm as one fused kernel; the others add, then normalize.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = ["NORM_KINDS", "ScaleNorm", "DyT", "SequenceBatchNorm", "NoNorm", "make_norm", "call_norm"]

NORM_KINDS = ("layernorm", "rmsnorm", "scalenorm", "dyt", "batchnorm", "none")


def _added(x: Tensor, residual: Tensor | None) -> Tensor:
    return x if residual is None else x + residual


class ScaleNorm(nn.Module):
    """``g * x / max(||x||, eps)`` over the last dimension; g is one learned scalar initialised to sqrt(d)."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # with g = sqrt(d) the output has unit RMS, like LayerNorm's
        nn.init.constant_(self.scale, math.sqrt(self.d_model))

    def forward(self, x: Tensor, residual: Tensor | None = None):
        h = _added(x, residual)
        out = self.scale * h / h.norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return out if residual is None else (out, h)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class DyT(nn.Module):
    """Dynamic Tanh: ``gamma * tanh(alpha * x) + beta``; alpha a learned scalar (init 0.5), gamma/beta per feature.

    No statistics at all: an elementwise squashing that stands in for the norm.
    """

    def __init__(self, d_model: int, *, alpha_init: float = 0.5, bias: bool = True):
        super().__init__()
        self.d_model = d_model
        self.alpha_init = alpha_init
        self.alpha = nn.Parameter(torch.empty(()))
        self.weight = nn.Parameter(torch.empty(d_model))
        self.bias = nn.Parameter(torch.empty(d_model)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha_init)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        h = _added(x, residual)
        out = self.weight * torch.tanh(self.alpha * h)
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else (out, h)

    def extra_repr(self) -> str:
        return f"{self.d_model}, alpha_init={self.alpha_init}, bias={self.bias is not None}"


class SequenceBatchNorm(nn.Module):
    """BatchNorm over feature channels, with statistics across batch *and* sequence positions.

    Input ``(..., d)``; every leading position is one sample of each channel. ``padding_mask`` (bool, the input's
    leading shape, True at padded positions) leaves padded positions out of the batch statistics when
    ``mask_padding`` is on (the default); with ``mask_padding=False`` the mask is ignored, as a naive BatchNorm
    would. Padded positions are still normalized (with the statistics of the real ones). Training mode uses the
    batch statistics and updates running averages (momentum as in ``torch.nn.BatchNorm1d``); eval mode uses the
    running averages.
    """

    def __init__(
        self, d_model: int, eps: float = 1e-5, *, momentum: float = 0.1, bias: bool = True, mask_padding: bool = True
    ):
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        self.d_model = d_model
        self.eps = eps
        self.momentum = momentum
        self.mask_padding = mask_padding
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        self.register_buffer("running_mean", torch.zeros(d_model))
        self.register_buffer("running_var", torch.ones(d_model))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.running_mean.zero_()
        self.running_var.fill_(1.0)

    def forward(self, x: Tensor, residual: Tensor | None = None, padding_mask: Tensor | None = None):
        h = _added(x, residual)
        if self.training:
            flat = h.reshape(-1, self.d_model)
            if padding_mask is not None and self.mask_padding:
                if padding_mask.dtype != torch.bool:
                    raise TypeError(
                        f"padding_mask must be a bool tensor, True at padded positions; got {padding_mask.dtype}"
                    )
                if padding_mask.shape != h.shape[:-1]:
                    raise ValueError(
                        f"padding_mask must have the input's leading shape {tuple(h.shape[:-1])}, "
                        f"got {tuple(padding_mask.shape)}"
                    )
                flat = flat[~padding_mask.reshape(-1)]
            n = flat.shape[0]
            if n < 2:
                raise ValueError(f"batchnorm needs at least 2 unpadded positions in training mode, got {n}")
            mean = flat.mean(0)
            var = flat.var(0, unbiased=False)
            with torch.no_grad():
                # running variance is the unbiased estimate, as in torch.nn.BatchNorm1d
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), self.momentum)
                unbiased = var.detach() * (n / (n - 1))
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
        else:
            mean, var = self.running_mean.to(h.dtype), self.running_var.to(h.dtype)
        out = (h - mean) * torch.rsqrt(var + self.eps) * self.weight
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else (out, h)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, momentum={self.momentum}, mask_padding={self.mask_padding}"


class NoNorm(nn.Module):
    """The identity, with the norms' calling convention (``norm(x, residual)`` returns ``(x + residual,) * 2``)."""

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if residual is None:
            return x
        h = x + residual
        return h, h


def make_norm(
    kind: str,
    d_model: int,
    eps: float | None = None,
    *,
    bias: bool = True,
    zero_centered_weight: bool = False,
    backend: str = "auto",
    **kw,
) -> nn.Module:
    """Build a norm of ``kind`` (one of :data:`NORM_KINDS`) over ``d_model`` features.

    ``eps=None`` takes each kind's default (LayerNorm/BatchNorm/ScaleNorm 1e-5, RMSNorm the dtype's machine
    epsilon); DyT and "none" have no eps. ``bias``: LayerNorm's, DyT's beta and BatchNorm's shift (RMSNorm and
    ScaleNorm have none). ``zero_centered_weight`` (scale by 1 + w) and ``backend`` apply to the fused kinds
    (layernorm, rmsnorm) only. Further keywords go to the module's constructor (e.g. ``residual_dtype`` for the
    fused kinds, ``mask_padding``/``momentum`` for batchnorm, ``alpha_init`` for dyt).
    """
    if not isinstance(kind, str) or kind not in NORM_KINDS:
        raise ValueError(f"norm kind must be one of {', '.join(NORM_KINDS)}; got {kind!r}")
    if not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    if eps is not None and (not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0):
        raise ValueError(f"eps must be a finite number >= 0 or None, got {eps!r}")
    if zero_centered_weight and kind not in ("layernorm", "rmsnorm"):
        raise ValueError(f"zero_centered_weight applies to layernorm and rmsnorm only, not to norm kind {kind!r}")
    if kind == "layernorm":
        return LayerNorm(
            d_model,
            1e-5 if eps is None else eps,
            bias=bias,
            zero_centered_weight=zero_centered_weight,
            backend=backend,
            **kw,
        )
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps, zero_centered_weight=zero_centered_weight, backend=backend, **kw)
    if kind == "scalenorm":
        return ScaleNorm(d_model, 1e-5 if eps is None else eps, **kw)
    if kind == "dyt":
        return DyT(d_model, bias=bias, **kw)
    if kind == "batchnorm":
        return SequenceBatchNorm(d_model, 1e-5 if eps is None else eps, bias=bias, **kw)
    return NoNorm(**kw)


def call_norm(norm: nn.Module, x: Tensor, residual: Tensor | None = None, padding_mask: Tensor | None = None):
    """``norm(x[, residual])``, handing ``padding_mask`` on to the norms that use one (batchnorm)."""
    if isinstance(norm, SequenceBatchNorm):
        return norm(x, residual, padding_mask)
    return norm(x) if residual is None else norm(x, residual)
