"""The residual connection with its norm, in every placement, plus DeepNorm's constants and init scaling.

``Residual(F, d_model, placement=...)`` computes, for a sublayer F (dropout applies to the branch just before the
residual add, i.e. to F's output, after Norm_out for sandwich):

    "post"         Norm(x + F(x))                      original Transformer, BERT (one fused add+norm)
    "pre"          x + F(Norm(x))                      GPT-2 onwards
    "deepnorm"     Norm(alpha * x + F(x))              DeepNet (Wang et al. 2022); alpha > 1 from the depth
    "sandwich"     x + Norm_out(F(Norm_in(x)))         Sandwich-LN / Peri-LN
    "none"         x + F(x)                            no norm at all
    "rezero"       x + a * F(x), a a learned scalar    ReZero (Bachlechner et al. 2020): a = 0 at init, no norm
    "branch-output" x + Norm(F(x))                     the norm on the branch's output only (OLMo 2's "reordered")
    "post-noskip"  Norm(F(x))                          lab only: no residual path
    "pre-noskip"   F(Norm(x))                          lab only: no residual path

Mix-LN (Post-LN in the first layers, Pre-LN after) is a property of the stack: see
:meth:`addnorm.nn.TransformerConfig.layer_placement`.

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

__all__ = [
    "PLACEMENTS",
    "Residual",
    "DeepNormCoefficients",
    "deepnorm_coefficients",
    "residual_scaled_std",
    "deepnorm_scaled_weights",
    "residual_output_weights",
    "scale_weights_",
]

PLACEMENTS = ("post", "pre", "deepnorm", "sandwich", "none", "post-noskip", "pre-noskip", "rezero", "branch-output")

# placements whose output is "stream + branch" with nothing after the add: the add can fuse with the next norm
_ENDS_WITH_ADD = ("pre", "sandwich", "none", "rezero", "branch-output")
# placements whose branch input is Norm(stream): that norm can fuse with the previous add
_STARTS_WITH_NORM = ("pre", "sandwich")
_NEEDS_NORM = ("post", "pre", "deepnorm", "sandwich", "post-noskip", "pre-noskip")


class Residual(nn.Module):
    """A sublayer F with its residual connection and norm(s) in one of :data:`PLACEMENTS`.

    ``forward(x, *args, norm_padding_mask=None, **kwargs)`` calls ``F(h, *args, **kwargs)``;
    ``norm_padding_mask`` (True at padded positions) reaches only the norms that use one (batchnorm).
    ``norm`` is a kind for :func:`make_norm`; ``norm_kwargs`` go to it (bias, zero_centered_weight, backend, ...).
    ``norm_output_scale`` multiplies the branch's normalized input, ``F(s * Norm(x))`` (pre and sandwich only; 1 by
    default): LayerNorm Scaling (Sun et al. 2025) sets s = 1/sqrt(l) in layer l.
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
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
        if not isinstance(norm_output_scale, (int, float)) or not math.isfinite(norm_output_scale):
            raise ValueError(f"norm_output_scale must be a finite number, got {norm_output_scale!r}")
        if norm_output_scale != 1.0 and placement not in _STARTS_WITH_NORM:
            raise ValueError(
                f"norm_output_scale scales the norm on the branch's input, which only placements "
                f"{', '.join(_STARTS_WITH_NORM)} have; got placement {placement!r} with scale {norm_output_scale!r}"
            )
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if placement == "deepnorm":
            if alpha is None:
                raise ValueError(
                    "placement 'deepnorm' needs alpha (the residual scale); take it from "
                    "deepnorm_coefficients(num_encoder_layers=..., num_decoder_layers=...)"
                )
            if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
                raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        elif alpha is not None:
            raise ValueError(f"alpha applies to placement 'deepnorm' only, not to {placement!r}")
        kw = dict(norm_kwargs or {})
        self.sublayer = sublayer
        self.placement = placement
        self.d_model = d_model
        self.alpha = None if alpha is None else float(alpha)
        self.norm = make_norm(norm, d_model, eps, **kw) if placement in _NEEDS_NORM else None
        self.norm_out = make_norm(norm, d_model, eps, **kw) if placement in ("sandwich", "branch-output") else None
        self.rezero_alpha = nn.Parameter(torch.zeros(())) if placement == "rezero" else None
        self.norm_output_scale = float(norm_output_scale)
        self.dropout = nn.Dropout(dropout)

    # The pieces, used by forward and by the fused chains of addnorm.nn.layers
    @property
    def ends_with_add(self) -> bool:
        """True when the output is ``x + branch`` with nothing after the add (pre, sandwich, none)."""
        return self.placement in _ENDS_WITH_ADD

    @property
    def starts_with_norm(self) -> bool:
        """True when the branch reads ``Norm(x)`` (pre, sandwich): that norm can fuse with a preceding add."""
        return self.placement in _STARTS_WITH_NORM

    def branch(self, h: Tensor, *args, **kwargs) -> Tensor:
        """Dropout(F(h)), Dropout(Norm_out(F(h))) for sandwich and branch-output, Dropout(a * F(h)) for rezero: what
        is added to the stream. For pre and sandwich ``h`` is Norm(x), scaled here by ``norm_output_scale`` (here
        rather than in forward, so the fused chains of addnorm.nn.layers, which call branch directly, scale too)."""
        if self.norm_output_scale != 1.0:
            h = h * self.norm_output_scale
        y = self.sublayer(h, *args, **kwargs)
        if self.norm_out is not None:
            y = self.norm_out(y)
        if self.rezero_alpha is not None:
            y = self.rezero_alpha * y
        return self.dropout(y)

    def forward(self, x: Tensor, *args, norm_padding_mask: Tensor | None = None, **kwargs) -> Tensor:
        p = self.placement
        if p in ("pre", "sandwich"):
            return x + self.branch(call_norm(self.norm, x, padding_mask=norm_padding_mask), *args, **kwargs)
        if p in ("none", "rezero", "branch-output"):
            return x + self.branch(x, *args, **kwargs)
        if p == "post":
            # Norm(x + F(x)) is itself one fused add+norm
            return call_norm(self.norm, self.branch(x, *args, **kwargs), x, norm_padding_mask)[0]
        if p == "deepnorm":
            return call_norm(self.norm, self.branch(x, *args, **kwargs), self.alpha * x, norm_padding_mask)[0]
        if p == "post-noskip":
            return call_norm(self.norm, self.branch(x, *args, **kwargs), padding_mask=norm_padding_mask)
        # pre-noskip
        return self.branch(call_norm(self.norm, x, padding_mask=norm_padding_mask), *args, **kwargs)

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
