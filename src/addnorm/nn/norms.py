"""Drop-in LayerNorm and RMSNorm with an optional fused residual add.

They subclass ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``: same constructor, parameter names and state_dict keys,
so either loads the other's weights. ``forward(x)`` returns a tensor; ``forward(x, residual)`` returns
``(norm(x + residual), x + residual)``, the fused Add & Norm of a pre-norm block.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from addnorm.ops import add_norm as _ops
from addnorm.ops.add_norm import add_layer_norm, add_rms_norm
from addnorm.ops.contract import check_bools

__all__ = ["LayerNorm", "RMSNorm"]


def _check_trailing(name: str, x: Tensor, normalized_shape: tuple[int, ...]) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k :]) != tuple(normalized_shape):
        raise ValueError(
            f"{name}'s trailing shape must be normalized_shape {tuple(normalized_shape)}, got {tuple(x.shape)}"
        )


def _flatten_normalized(name: str, x: Tensor, normalized_shape: tuple[int, ...]) -> Tensor:
    """Merge the normalized trailing dims into one, so the functional ops normalize over the last dim only."""
    _check_trailing(name, x, normalized_shape)
    k = len(normalized_shape)
    return x if k == 1 else x.reshape(*x.shape[: x.dim() - k], -1)


class _AddNormMixin:
    """Shared forward: flatten the normalized dims, call the fused op, restore the shape."""

    def _extra_init(
        self, zero_centered_weight: bool, cast_before_weight: bool, residual_dtype: torch.dtype | None, backend: str
    ) -> None:
        # refused here, not at the first forward: reset_parameters reads zero_centered_weight below
        check_bools(("zero_centered_weight", zero_centered_weight), ("cast_before_weight", cast_before_weight))
        self.zero_centered_weight = zero_centered_weight
        self.cast_before_weight = cast_before_weight
        self.residual_dtype = residual_dtype
        self.backend = backend
        if zero_centered_weight:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()  # the torch.nn class next in the MRO
        # with a zero-centered weight the effective scale is 1 + weight: start it at 1
        if getattr(self, "zero_centered_weight", False) and self.weight is not None:
            nn.init.zeros_(self.weight)

    def extra_repr(self) -> str:
        # torch.nn's fields, then addnorm's options where they differ from the default: a Gemma norm (1 + weight) or
        # an fp32 residual stream must be visible when printing a model
        # (getattr: a module pickled by an older addnorm may lack an option, as _forward allows for)
        extras = [
            f"{k}={v!r}"
            for k, default in (
                ("zero_centered_weight", False),
                ("cast_before_weight", False),
                ("residual_dtype", None),
                ("backend", "auto"),
            )
            if (v := getattr(self, k, default)) != default
        ]
        return ", ".join([super().extra_repr(), *extras])

    def _norm_params(self):
        w = self.weight.reshape(-1) if self.weight is not None else None
        b = getattr(self, "bias", None)
        return w, (b.reshape(-1) if b is not None else None)

    def _forward_rows(self, x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, is_rms):
        """One normalized dim (every Transformer norm): the op called directly, positionally, with the module's
        parameters as they are (read once by the caller: each ``self.weight`` is a trip through nn.Module's
        __getattr__): no reshapes (a 1-D weight is already flat, the output has x's shape) and no keyword layer.
        What the op validates (the weight's dtype, shape and device, eps, the backend) is read from the module on
        each call, so a parameter replaced or converted after the first call is checked like the first one."""
        shape = self.normalized_shape  # (N,)
        if type(x) is not Tensor or not x.ndim or x.shape[-1] != shape[0]:
            _check_trailing("input", x, shape)
        if residual is not None and (
            type(residual) is not Tensor or not residual.ndim or residual.shape[-1] != shape[0]
        ):
            _check_trailing("residual", residual, shape)
        # through the module attribute: every add + norm call goes through run_add_norm, which tests count
        out, res_out = _ops.run_add_norm(
            x,
            residual,
            weight,
            bias,
            self.eps,
            is_rms,
            0.0,
            self.residual_dtype,
            self.zero_centered_weight,
            getattr(self, "cast_before_weight", False),
            None,
            self.backend,
        )
        return out if residual is None else (out, res_out)

    def _forward(self, fn, x: Tensor, residual: Tensor | None, params: tuple):
        shape = x.shape
        xf = _flatten_normalized("input", x, self.normalized_shape)
        rf = _flatten_normalized("residual", residual, self.normalized_shape) if residual is not None else None
        out, res_out = fn(
            xf,
            rf,
            *params,
            residual_dtype=self.residual_dtype,
            zero_centered_weight=self.zero_centered_weight,
            cast_before_weight=getattr(self, "cast_before_weight", False),
            backend=self.backend,
        )
        out = out.reshape(shape)
        return out if residual is None else (out, res_out.reshape(shape))


class LayerNorm(_AddNormMixin, nn.LayerNorm):
    """``torch.nn.LayerNorm`` with addnorm's kernels and an optional fused residual add.

    Extra keyword options: ``zero_centered_weight`` (scale by 1 + weight, weight initialised to 0),
    ``cast_before_weight`` (round the normalized value to the input dtype before the weight: Hugging Face Llama's
    order), ``residual_dtype`` (dtype of the residual stream returned with a residual), ``backend``.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        zero_centered_weight: bool = False,
        cast_before_weight: bool = False,
        residual_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._extra_init(zero_centered_weight, cast_before_weight, residual_dtype, backend)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        w = self.weight
        if len(self.normalized_shape) == 1 and (w is None or w.dim() == 1):
            return self._forward_rows(x, residual, w, self.bias, False)
        w, b = self._norm_params()
        return self._forward(add_layer_norm, x, residual, (w, b, self.eps))


class RMSNorm(_AddNormMixin, nn.RMSNorm):
    """``torch.nn.RMSNorm`` with addnorm's kernels and an optional fused residual add (eps=None: finfo eps).
    Extra keyword options as :class:`LayerNorm`."""

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        zero_centered_weight: bool = False,
        cast_before_weight: bool = False,
        residual_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._extra_init(zero_centered_weight, cast_before_weight, residual_dtype, backend)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        w = self.weight
        if len(self.normalized_shape) == 1 and (w is None or w.dim() == 1):
            return self._forward_rows(x, residual, w, None, True)
        w, _ = self._norm_params()
        return self._forward(add_rms_norm, x, residual, (w, self.eps))
