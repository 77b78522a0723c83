"""Transformer layers built from Residual sublayers, and the fused pre-norm chain they run through.

    EncoderLayer   x = R(SelfAttn)(x); x = R(FFN)(x)                              2 Add & Norm (causal option)
    DecoderLayer   x = R(SelfAttn, causal)(x); x = R(CrossAttn)(x, mem); x = R(FFN)(x)   3 Add & Norm
    ParallelBlock  x = x + Attn(Norm(x)) + FFN(Norm(x))                           PaLM, one shared norm

The fusion (as Apex and Megatron-LM do on GPUs): in a pre-norm layer the residual add of one sublayer is
immediately followed by the norm of the next, so both run as one fused add+norm call that reads x and the branch
once and writes the new stream and its normalized copy together:

    h = norm1(x)
    a = attn(h)
    h, x = norm2(a, x)        # x = x + a and h = norm2(x), one call
    x = x + ffn(h)

:func:`residual_chain` applies this to any sequence of Residuals: whenever a step ends with a plain add (pre,
sandwich, none) and the next starts by normalizing the stream (pre, sandwich), the two run fused. A sandwich step's
Norm_out joins them (``h, x = norm_add_norm(F(h), x, ...)``: x = x + Norm_out(F(h)), h = Norm_in(x), one op), and a
sandwich or branch-output step whose sum feeds no norm adds through one ``norm_add`` (x + Norm_out(F(h))); see
:meth:`Residual.add_branch`. Every other placement runs its own (already fused where it can be) forward. The
numbers equal the unfused code's exactly.

Fusion stops at layer boundaries: each layer returns the full residual stream, so a forward hook on a layer sees
the stream after it. Inside a fused chain ``Residual.forward`` itself is not called (its norm, sublayer and dropout
are), so hook the sublayer, the norm or the layer rather than the Residual (a norm with hooks is called as a
module, not folded into norm_add or norm_add_norm, so its hooks see it); ``fuse_add_norm=False`` calls every
Residual's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from addnorm.nn.attention import MultiHeadAttention, RotaryEmbedding
from addnorm.nn.config import TransformerConfig
from addnorm.nn.ffn import FeedForward
from addnorm.nn.norm_kinds import call_norm, make_norm
from addnorm.nn.placements import Placement
from addnorm.nn.residual import Residual

__all__ = ["residual_chain", "EncoderLayer", "DecoderLayer", "ParallelBlock", "make_block"]

Step = tuple[Residual, tuple, dict]


def residual_chain(
    x: Tensor, steps: Sequence[Step], *, fused: bool = True, padding_mask: Tensor | None = None
) -> Tensor:
    """Run ``x`` through Residual steps ``(residual, args, kwargs)`` in order; adjacent add -> norm pairs fused.
    A step's branch runs when the next step takes its sum (:meth:`Residual.add_branch_norm`) or the layer ends
    (:meth:`Residual.add_branch`), so that a sandwich step's Norm_out joins the add.

    ``padding_mask`` (True at padded positions) reaches the norms that use one (batchnorm).
    """
    pending: Step | None = None  # the previous step, its branch input h in place of args: x + branch(h) not yet run
    for res, args, kwargs in steps:
        if pending is not None:
            prev, (h, *pargs), pkwargs = pending
            pending = None
            if fused and res.starts_with_norm:
                # x = x + branch(h); h = Norm(x): one call (with the branch's Norm_out too, for sandwich)
                h, x = prev.add_branch_norm(x, h, res.norm, *pargs, norm_padding_mask=padding_mask, **pkwargs)
                pending = (res, (h, *args), kwargs)
                continue
            x = prev.add_branch(x, h, *pargs, **pkwargs)
        if fused and res.ends_with_add:
            h = x if res.norm is None else call_norm(res.norm, x, padding_mask=padding_mask)
            pending = (res, (h, *args), kwargs)
        else:
            x = res(x, *args, norm_padding_mask=padding_mask, **kwargs)
    if pending is not None:
        prev, (h, *pargs), pkwargs = pending
        x = prev.add_branch(x, h, *pargs, **pkwargs)
    return x


def _residual(
    config: TransformerConfig, sublayer: nn.Module, placement: str, alpha: float | None, layer_idx: int = 0
) -> Residual:
    return Residual(
        sublayer,
        config.d_model,
        placement=placement,
        norm=config.norm,
        eps=config.eps,
        dropout=config.dropout,
        alpha=alpha if Placement.named(placement).scaled_skip else None,
        norm_kwargs=config.norm_factory_kwargs(),
        norm_output_scale=config.norm_output_scale(layer_idx),
    )


def _attention(config: TransformerConfig, *, causal: bool, rotary: RotaryEmbedding | None) -> MultiHeadAttention:
    qk = None
    if config.qk_norm:
        # normalize q and k with the model's norm when it is a real one (LayerNorm/RMSNorm), else LayerNorm
        qk = config.norm if config.norm in ("layernorm", "rmsnorm") else "layernorm"
    return MultiHeadAttention(
        config.d_model,
        config.n_heads,
        causal=causal,
        bias=config.bias,
        dropout=config.dropout,
        qk_norm=qk,
        eps=config.eps,
        rotary=rotary,
        record_logits=config.record_logits,
        norm_kwargs=dict(backend=config.backend, bias=config.bias),
    )


def _ffn(config: TransformerConfig) -> FeedForward:
    return FeedForward(config.d_model, config.ffn_dim, activation=config.ffn, bias=config.bias)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each in a :class:`Residual` (``self.attn``, ``self.ffn``).

    ``causal=True`` makes it the block of a decoder-only LM (GPT-style). Placement per layer comes from the config
    (``layer_placement`` resolves Mix-LN); ``deepnorm_alpha`` is used when that placement is "deepnorm".
    ``forward(x, padding_mask=None)``: x (B, T, d); padding_mask (B, T), True at padded positions.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_idx: int = 0,
        *,
        causal: bool = False,
        deepnorm_alpha: float | None = None,
        n_layers: int | None = None,
        rotary: RotaryEmbedding | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.placement = config.layer_placement(layer_idx, n_layers)
        self.fused = config.fuse_add_norm
        attention = _attention(config, causal=causal, rotary=rotary)
        self.attn = _residual(config, attention, self.placement, deepnorm_alpha, layer_idx)
        self.ffn = _residual(config, _ffn(config), self.placement, deepnorm_alpha, layer_idx)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        steps = [(self.attn, (), {"key_padding_mask": padding_mask}), (self.ffn, (), {})]
        return residual_chain(x, steps, fused=self.fused, padding_mask=padding_mask)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, FFN: three Residuals
    (``self.self_attn``, ``self.cross_attn``, ``self.ffn``).

    ``forward(x, memory, padding_mask=None, memory_padding_mask=None)``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_idx: int = 0,
        *,
        deepnorm_alpha: float | None = None,
        n_layers: int | None = None,
        rotary: RotaryEmbedding | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.placement = config.layer_placement(layer_idx, n_layers)
        self.fused = config.fuse_add_norm
        p, a = self.placement, deepnorm_alpha
        self.self_attn = _residual(config, _attention(config, causal=True, rotary=rotary), p, a, layer_idx)
        # positions of the decoder and the encoder are unrelated: no rotary in cross-attention
        self.cross_attn = _residual(config, _attention(config, causal=False, rotary=None), p, a, layer_idx)
        self.ffn = _residual(config, _ffn(config), p, a, layer_idx)

    def forward(
        self, x: Tensor, memory: Tensor, padding_mask: Tensor | None = None, memory_padding_mask: Tensor | None = None
    ) -> Tensor:
        steps = [
            (self.self_attn, (), {"key_padding_mask": padding_mask}),
            (self.cross_attn, (memory,), {"key_padding_mask": memory_padding_mask}),
            (self.ffn, (), {}),
        ]
        return residual_chain(x, steps, fused=self.fused, padding_mask=padding_mask)


class ParallelBlock(nn.Module):
    """PaLM's parallel block: ``x + Dropout(Attn(Norm(x))) + Dropout(FFN(Norm(x)))`` with one shared norm.

    Attention and FFN read the same normalized input, so their input projections can run as one matmul on
    hardware that benefits; here they are separate modules (``self.attn``, ``self.ffn``, ``self.norm``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_idx: int = 0,
        *,
        causal: bool = True,
        rotary: RotaryEmbedding | None = None,
        **_unused,
    ):
        super().__init__()
        if config.placement != "pre":
            raise ValueError(f"ParallelBlock supports placement 'pre' only, got {config.placement!r}")
        self.layer_idx = layer_idx
        self.placement = "pre"
        self.norm = make_norm(config.norm, config.d_model, config.eps, **config.norm_factory_kwargs())
        self.attn = _attention(config, causal=causal, rotary=rotary)
        self.ffn = _ffn(config)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.ffn_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        h = call_norm(self.norm, x, padding_mask=padding_mask)
        return x + self.attn_dropout(self.attn(h, key_padding_mask=padding_mask)) + self.ffn_dropout(self.ffn(h))


def make_block(
    config: TransformerConfig,
    layer_idx: int,
    *,
    causal: bool,
    deepnorm_alpha: float | None = None,
    n_layers: int | None = None,
    rotary: RotaryEmbedding | None = None,
) -> nn.Module:
    """The self-attention block the config describes: :class:`ParallelBlock` or :class:`EncoderLayer`."""
    kw: dict[str, Any] = dict(causal=causal, rotary=rotary)
    if config.parallel:
        return ParallelBlock(config, layer_idx, **kw)
    return EncoderLayer(config, layer_idx, deepnorm_alpha=deepnorm_alpha, n_layers=n_layers, **kw)
