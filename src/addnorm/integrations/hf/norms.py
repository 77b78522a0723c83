"""The norm modules :func:`addnorm.integrations.hf.apply` swaps in: addnorm's RMSNorm/LayerNorm with HF's attribute
names and cast orders, holding the very Parameter objects of the modules they replace."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from addnorm.nn.norms import LayerNorm, RMSNorm
from addnorm.ops import add_norm as _ops
from addnorm.ops.add_norm import add_layer_norm, add_rms_norm

__all__ = [
    "AnyWidthRMSNorm",
    "CastBeforeWeightRMSNorm",
    "HFRMSNorm",
    "OnePlusWeightLayerNorm",
    "cast_before_weight_norm",
    "rms_eps",
    "share_params",
    "zero_centered_norm",
]


class _VarianceEpsilonAlias:
    """``variance_epsilon``, the name HF's RMSNorm code reads and writes, as an alias of ``eps``."""

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value


class CastBeforeWeightRMSNorm(_VarianceEpsilonAlias, RMSNorm):
    """RMSNorm with the cast order of Llama, Mistral and Qwen: ``weight * to(x.dtype)(x * rstd)``, rstd in fp32.

    ``forward(x, residual)`` fuses the residual add as :class:`addnorm.nn.RMSNorm` does. ``variance_epsilon`` is an
    alias of ``eps``, the name HF code reads.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, cast_before_weight=True, **kwargs)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        w = self.weight
        if w is None or w.dtype is x.dtype or torch.promote_types(w.dtype, x.dtype) == x.dtype:
            # HF's ``w * x.to(dtype)`` stays in x's dtype: the fused call with cast_before_weight is its value
            if len(self.normalized_shape) == 1 and (w is None or w.dim() == 1):
                return self._forward_rows(x, residual, w, None, True)  # (RMSNorm.forward's, the weight read once)
            return super().forward(x, residual)
        # a weight of a wider dtype than x (an fp32 weight with bf16 activations) makes HF's output that wider
        # dtype; the kernel writes x's dtype, so normalize without the weight and multiply as HF does
        result = self._forward(add_rms_norm, x, residual, (None, self.eps))
        if residual is None:
            return w * result
        out, residual_out = result
        return w * out, residual_out


class HFRMSNorm(_VarianceEpsilonAlias, RMSNorm):
    """addnorm's RMSNorm with ``variance_epsilon``, the name HF code reads, as an alias of ``eps``."""


class AnyWidthRMSNorm(HFRMSNorm):
    """An RMSNorm without a weight over the last dim of any size: ``x * rsqrt(mean(x^2) + eps)`` in fp32, rounded once
    to x's dtype (nanochat's and HRM's RMSNorm). Those modules have no parameter and no ``normalized_shape`` to read
    a width from, and one class serves rows of any width; so does this one (``normalized_shape`` is a placeholder
    ``(1,)``, never checked: the op normalizes whatever last dim it gets and checks that x and the residual agree)."""

    def __init__(self, eps: float | None = None, device=None, dtype=None):
        super().__init__(1, eps=eps, elementwise_affine=False, device=device, dtype=dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if not isinstance(x, Tensor) or x.dim() == 0:
            raise ValueError(f"input must be a tensor of at least one dim, got {getattr(x, 'shape', type(x))}")
        # RMSNorm._forward_rows without its width check: the same op, positionally
        out, res_out = _ops.run_add_norm(
            x, residual, None, None, self.eps, True, 0.0, self.residual_dtype, False, False, None, self.backend
        )
        return out if residual is None else (out, res_out)

    def extra_repr(self) -> str:
        return f"any width, eps={self.eps}"


class OnePlusWeightLayerNorm(LayerNorm):
    """LayerNorm scaling by ``1 + weight``, the gain formed as Nemotron's LayerNorm1P forms it: ``weight + 1`` in the
    weight's dtype, then a plain LayerNorm. (``zero_centered_weight`` adds the 1 in fp32, which in bf16 is another
    gain: 1 + w rounded to bf16 keeps 8 bits.) ``forward(x, residual)`` fuses the residual add; the ``+ 1`` is one
    extra op on the weight vector per call."""

    def forward(self, x: Tensor, residual: Tensor | None = None):
        w = None if self.weight is None else self.weight + 1.0
        return self._forward(add_layer_norm, x, residual, (w, self.bias, self.eps))


def rms_eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ValueError(f"cannot read eps from {type(module).__name__}: no variance_epsilon or eps attribute")


def share_params(new: nn.Module, old: nn.Module, names=("weight", "bias")) -> nn.Module:
    """Give ``new`` the very Parameter objects of ``old`` (or None where old has none)."""
    for name in names:
        if hasattr(new, name) or hasattr(old, name):
            setattr(new, name, getattr(old, name, None))
    return new


def cast_before_weight_norm(old: nn.Module) -> nn.Module:
    n = old.weight.shape[0]
    new = CastBeforeWeightRMSNorm(n, eps=rms_eps(old), device="meta")  # meta: no throwaway weight allocated
    return share_params(new, old, ("weight",))


def zero_centered_norm(old: nn.Module) -> nn.Module:
    n = old.weight.shape[0]
    new = RMSNorm(n, eps=rms_eps(old), zero_centered_weight=True, device="meta")
    return share_params(new, old, ("weight",))
