"""The residual connection with its norm, in every placement, plus DeepNorm's constants and init scaling.

``Residual(F, d_model, placement=...)`` runs a sublayer F in one of the placements of :mod:`addnorm.nn.placements`
(their formulas are there, with the forward this module and the batched trainer share): "post", "pre",
"deepnorm", "sandwich", "none", "rezero", "branch-output", and the lab's "post-noskip" and "pre-noskip".

DeepNorm (Wang et al. 2022, Table 1): with N encoder and M decoder layers,

    encoder-only / decoder-only:  alpha = (2N)^(1/4),            beta = (8N)^(-1/4)
    encoder-decoder, encoder:     alpha = 0.81 (N^4 M)^(1/16),   beta = 0.87 (N^4 M)^(-1/16)
    encoder-decoder, decoder:     alpha = (3M)^(1/4),            beta = (12M)^(-1/4)

beta multiplies the Xavier init of the FFN weights and the value and output projections only, never Q and K.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from addnorm.nn.norm_kinds import call_norm, make_norm
from addnorm.nn.norms import LayerNorm, RMSNorm
from addnorm.nn.placements import PLACEMENTS, Placement, branch_forward, residual_forward
from addnorm.ops.norm_add import norm_add, norm_add_norm

__all__ = [
    "Residual",
    "DeepNormCoefficients",
    "deepnorm_coefficients",
    "residual_scaled_std",
    "deepnorm_scaled_weights",
    "residual_output_weights",
    "scale_weights_",
]


def _is_number(value) -> bool:
    """An int or float, not a bool (bool is an int subclass: ``alpha=True`` is a mistake, not 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` would run hooks (its own or global ones) that a direct op call would skip."""
    g = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )


def _op_norm(norm: nn.Module | None) -> dict | None:
    """``norm`` as the arguments of :func:`addnorm.ops.norm_add` (weight, bias, eps, kind, options), when the op
    computes bit for bit what calling the module does; else None. That holds for addnorm's LayerNorm and RMSNorm
    themselves (a subclass may compute otherwise) over one dimension without a ``residual_dtype`` (which would
    change the dtype normalized, and with it RMSNorm's default eps). A norm with hooks runs as a module, so that
    its hooks (the Monitor's, a user's) see every call."""
    if type(norm) not in (LayerNorm, RMSNorm) or len(norm.normalized_shape) != 1 or _hooked(norm):
        return None
    w = norm.weight
    if (w is not None and w.dim() != 1) or getattr(norm, "residual_dtype", None) is not None:
        return None
    return dict(
        weight=w,
        bias=getattr(norm, "bias", None),
        eps=norm.eps,
        norm="rms" if type(norm) is RMSNorm else "layer",
        zero_centered_weight=norm.zero_centered_weight,
        cast_before_weight=getattr(norm, "cast_before_weight", False),
        backend=norm.backend,
    )


class Residual(nn.Module):
    """A sublayer F with its residual connection and norm(s) in one of :data:`PLACEMENTS`.

    ``forward(x, *args, norm_padding_mask=None, **kwargs)`` calls ``F(h, *args, **kwargs)``;
    ``norm_padding_mask`` (True at padded positions) reaches only the norms that use one (batchnorm).
    ``norm`` is a kind for :func:`make_norm`; ``norm_kwargs`` go to it (bias, zero_centered_weight, backend, ...).
    ``norm_output_scale`` multiplies the branch's normalized input, ``F(s * Norm(x))`` (pre and sandwich only; 1 by
    default): LayerNorm Scaling (Sun et al. 2025) sets s = 1/sqrt(l) in layer l.
    Sandwich and branch-output add ``x + Norm_out(F(h))`` as one :func:`addnorm.ops.norm_add` call where Norm_out
    is a LayerNorm or RMSNorm without hooks and no dropout runs (:meth:`add_branch`; the same bits as the norm's
    call and the add); the fused chains of addnorm.nn.layers also take the next sublayer's norm into that call.
    Attributes: ``sublayer``, ``norm`` (the placement's norm; Norm_in for sandwich; None for "none"),
    ``norm_out`` (sandwich's Norm_out; branch-output's only norm), ``alpha`` (deepnorm only), ``rezero_alpha``
    (rezero only: the learned scalar on the branch, 0 at init, so every block starts as the identity).
    """

    def __init__(
        self,
        sublayer: nn.Module,
        d_model: int,
        *,
        placement: str = "pre",
        norm: str = "layernorm",
        eps: float | None = None,
        dropout: float = 0.0,
        alpha: float | None = None,
        norm_kwargs: dict | None = None,
        norm_output_scale: float = 1.0,
    ):
        super().__init__()
        parts = Placement.named(placement)
        # checked here whatever the placement: make_norm checks it too, but a placement without a norm never calls it
        if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model <= 0:
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        # bool is an int subclass: refuse it for the numbers below, where True or False is a mistake, not 1 or 0
        if not _is_number(norm_output_scale) or not math.isfinite(norm_output_scale):
            raise ValueError(f"norm_output_scale must be a finite number, got {norm_output_scale!r}")
        if norm_output_scale != 1.0 and not parts.starts_with_norm:
            scaled = ", ".join(n for n in PLACEMENTS if Placement.named(n).starts_with_norm)
            raise ValueError(
                f"norm_output_scale scales the norm on the branch's input, which only placements {scaled} have; "
                f"got placement {placement!r} with scale {norm_output_scale!r}"
            )
        if not _is_number(dropout) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if parts.scaled_skip:
            if alpha is None:
                raise ValueError(
                    "placement 'deepnorm' needs alpha (the residual scale); take it from "
                    "deepnorm_coefficients(num_encoder_layers=..., num_decoder_layers=...)"
                )
            if not _is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
                raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        elif alpha is not None:
            raise ValueError(f"alpha applies to placement 'deepnorm' only, not to {placement!r}")
        kw = dict(norm_kwargs or {})
        self.sublayer = sublayer
        self.placement = placement
        self.parts = parts
        self.d_model = d_model
        self.alpha = None if alpha is None else float(alpha)
        self.norm = make_norm(norm, d_model, eps, **kw) if parts.norm else None
        self.norm_out = make_norm(norm, d_model, eps, **kw) if parts.norm_out else None
        self.rezero_alpha = nn.Parameter(torch.zeros(())) if parts.gate else None
        self.norm_output_scale = float(norm_output_scale)
        self.dropout = nn.Dropout(dropout)

    # The pieces, used by forward and by the fused chains of addnorm.nn.layers
    @property
    def ends_with_add(self) -> bool:
        """True when the output is ``x + branch`` with nothing after the add (pre, sandwich, none)."""
        return self.parts.ends_with_add

    @property
    def starts_with_norm(self) -> bool:
        """True when the branch reads ``Norm(x)`` (pre, sandwich): that norm can fuse with a preceding add."""
        return self.parts.starts_with_norm

    def branch(self, h: Tensor, *args, **kwargs) -> Tensor:
        """Dropout(F(h)), Dropout(Norm_out(F(h))) for sandwich and branch-output, Dropout(a * F(h)) for rezero: what
        is added to the stream. For pre and sandwich ``h`` is Norm(x), scaled by ``norm_output_scale`` on the way into F
        (not in forward, so the fused chains of addnorm.nn.layers, which call the branch directly, scale too)."""
        y = branch_forward(self.parts, lambda h: self._f(h, args, kwargs), h, self.norm_out, self.rezero_alpha)
        return self.dropout(y)

    def _f(self, h: Tensor, args: tuple, kwargs: dict) -> Tensor:
        """F(s * h): the sublayer on its (scaled) input."""
        if self.norm_output_scale != 1.0:
            h = h * self.norm_output_scale
        return self.sublayer(h, *args, **kwargs)

    def _norm_out_op(self) -> dict | None:
        """Norm_out as :func:`norm_add`'s arguments when ``x + branch(h)`` is ``x + Norm_out(F(h))`` with nothing
        between the norm and the add (dropout off: p = 0 or eval) and the op computes what the module does."""
        if not self.parts.norm_out or self.parts.gate or (self.dropout.training and self.dropout.p > 0):
            return None
        return _op_norm(self.norm_out)

    def add_branch(self, x: Tensor, h: Tensor, /, *args, **kwargs) -> Tensor:
        """``x + branch(h)``; for sandwich and branch-output one :func:`addnorm.ops.norm_add` call,
        ``x + Norm_out(F(h))``, where Norm_out is a norm the op describes and no dropout runs (the same bits as the
        norm's call and the add)."""
        op = self._norm_out_op()
        if op is None:
            return x + self.branch(h, *args, **kwargs)
        return norm_add(self._f(h, args, kwargs), x, **op)

    def add_branch_norm(
        self, x: Tensor, h: Tensor, norm: nn.Module, /, *args, norm_padding_mask: Tensor | None = None, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """``(norm(s), s)`` with ``s = x + branch(h)``: this step's add fused with the next sublayer's norm. For a
        sandwich step into a norm the ops describe, one :func:`addnorm.ops.norm_add_norm` call (Norm_out, the add and
        the next norm); else one fused add+norm call of ``norm``.

        norm_add_norm's ``s`` has the promoted dtype of x and F(h), and ``norm(s)`` s's dtype, where the fused
        add+norm call keeps x's and F(h)'s: the two agree when F(h) has x's dtype, so only then is it called."""
        op1 = self._norm_out_op()
        op2 = None if op1 is None else _op_norm(norm)
        if op2 is None or op1["backend"] != op2["backend"]:
            return call_norm(norm, self.branch(h, *args, **kwargs), x, norm_padding_mask)
        y = self._f(h, args, kwargs)
        if y.dtype != x.dtype:  # dropout is off here: Norm_out(y) is the branch
            return call_norm(norm, self.norm_out(y), x, norm_padding_mask)
        w1, w2, b1, b2, e1, e2 = op1["weight"], op2["weight"], op1["bias"], op2["bias"], op1["eps"], op2["eps"]
        return norm_add_norm(
            y,
            x,
            w1,
            w2,
            b1,
            b2,
            e1,
            e2,
            norm=op1["norm"],
            norm2=op2["norm"],
            zero_centered_weight=(op1["zero_centered_weight"], op2["zero_centered_weight"]),
            cast_before_weight=(op1["cast_before_weight"], op2["cast_before_weight"]),
            backend=op1["backend"],
        )

    def forward(self, x: Tensor, *args, norm_padding_mask: Tensor | None = None, **kwargs) -> Tensor:
        return residual_forward(
            self.parts,
            x,
            branch=lambda h: self.branch(h, *args, **kwargs),
            norm=lambda h: call_norm(self.norm, h, padding_mask=norm_padding_mask),
            add_norm=lambda y, r: call_norm(self.norm, y, r, norm_padding_mask)[0],  # Norm(y + r): one fused call
            alpha=self.alpha,
            add_branch=lambda x, h: self.add_branch(x, h, *args, **kwargs),
        )

    def extra_repr(self) -> str:
        scale = f", norm_output_scale={self.norm_output_scale:.4g}" if self.norm_output_scale != 1.0 else ""
        return f"placement={self.placement!r}" + (f", alpha={self.alpha:.4g}" if self.alpha is not None else "") + scale


@dataclass(frozen=True)
class DeepNormCoefficients:
    """DeepNorm's residual scale alpha and init scale beta per side (None for a side the model lacks)."""

    encoder_alpha: float | None
    encoder_beta: float | None
    decoder_alpha: float | None
    decoder_beta: float | None


def deepnorm_coefficients(num_encoder_layers: int = 0, num_decoder_layers: int = 0) -> DeepNormCoefficients:
    """DeepNorm's alpha and beta for a model with N encoder and M decoder layers (0 = no such side)."""
    for name, v in (("num_encoder_layers", num_encoder_layers), ("num_decoder_layers", num_decoder_layers)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    n, m = num_encoder_layers, num_decoder_layers
    if n == 0 and m == 0:
        raise ValueError("deepnorm_coefficients needs num_encoder_layers > 0 or num_decoder_layers > 0")
    if m == 0:
        return DeepNormCoefficients((2 * n) ** 0.25, (8 * n) ** -0.25, None, None)
    if n == 0:
        return DeepNormCoefficients(None, None, (2 * m) ** 0.25, (8 * m) ** -0.25)
    return DeepNormCoefficients(
        encoder_alpha=0.81 * (n**4 * m) ** (1 / 16),
        encoder_beta=0.87 * (n**4 * m) ** (-1 / 16),
        decoder_alpha=(3 * m) ** 0.25,
        decoder_beta=(12 * m) ** -0.25,
    )


def residual_scaled_std(std: float, n_layers: int) -> float:
    """GPT-2's init for projections that write into the residual stream: std / sqrt(2 * n_layers).

    Two residual branches per layer each add a term of variance ~std^2; scaling keeps the stream's variance at the
    output independent of depth.
    """
    if n_layers <= 0:
        raise ValueError(f"n_layers must be > 0, got {n_layers!r}")
    return std / math.sqrt(2 * n_layers)


def _collect(module: nn.Module, method: str) -> list[Tensor]:
    out: list[Tensor] = []
    seen: set[int] = set()
    for m in module.modules():
        fn = getattr(m, method, None)
        if callable(fn):
            for w in fn():
                if id(w) not in seen:
                    seen.add(id(w))
                    out.append(w)
    return out


def deepnorm_scaled_weights(module: nn.Module) -> list[Tensor]:
    """The weights DeepNorm's beta scales, found in ``module``: FFN weights, value and output projections.

    Sublayers declare them through a ``deepnorm_scaled_weights()`` method (MultiHeadAttention: v_proj and
    out_proj; FeedForward: every linear), so Q and K are never touched.
    """
    return _collect(module, "deepnorm_scaled_weights")


def residual_output_weights(module: nn.Module) -> list[Tensor]:
    """The weights that write into the residual stream (attention out_proj, FFN fc_out) found in ``module``."""
    return _collect(module, "residual_output_weights")


@torch.no_grad()
def scale_weights_(weights: Iterable[Tensor], factor: float) -> None:
    """Multiply each tensor in place by ``factor`` (an init rescaling; no autograd history)."""
    for w in weights:
        w.mul_(factor)
