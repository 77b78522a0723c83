"""Multi-head attention (self or cross, causal option, optional QK-norm and rotary positions).

    q, k, v = x Wq, c Wk, c Wv            # c = x for self-attention, the encoder output for cross-attention
    q, k    = Norm(q), Norm(k)            # QK-norm, per head over head_dim (ViT-22B; Wortsman et al. 2023)
    out     = softmax(q k^T / sqrt(dh) + mask) v Wo

The fast path is ``F.scaled_dot_product_attention``. With ``record_logits=True`` the scores are computed explicitly
instead, and ``max_logit`` holds the largest attention logit q.k/sqrt(dh) over unmasked pairs of the last forward
(a detached scalar): the quantity whose growth precedes divergence without QK-norm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.nn.norm_kinds import make_norm

__all__ = ["MultiHeadAttention", "RotaryEmbedding", "record_attention_logits", "max_attention_logits"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021), rotating pairs (i, i + dh/2) of each head's features."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T, dh/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, H, T, dh)."""
        t = x.shape[-2]
        if t > self.cos.shape[0]:
            raise ValueError(f"sequence length {t} exceeds the rotary table's max_seq_len {self.cos.shape[0]}")
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate Q, K, V and output projections (DeepNorm scales V and O only).

    ``forward(x, context=None, *, key_padding_mask=None)``: x (B, T, d); context (B, S, d) for cross-attention
    (None: self-attention); key_padding_mask (B, S) bool, True at padded key positions. ``causal`` masks future
    keys (self-attention only). ``qk_norm`` is a norm kind ("layernorm", "rmsnorm", ...) or None.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        causal: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        qk_norm: str | None = None,
        eps: float | None = None,
        rotary: RotaryEmbedding | None = None,
        record_logits: bool = False,
        norm_kwargs: dict | None = None,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.causal = causal
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        kw = dict(norm_kwargs or {})
        self.q_norm = make_norm(qk_norm, self.head_dim, eps, **kw) if qk_norm else None
        self.k_norm = make_norm(qk_norm, self.head_dim, eps, **kw) if qk_norm else None
        self.rotary = rotary
        self.record_logits = record_logits
        self.max_logit: Tensor | None = None

    def deepnorm_scaled_weights(self) -> list[Tensor]:
        return [self.v_proj.weight, self.out_proj.weight]

    def residual_output_weights(self) -> list[Tensor]:
        return [self.out_proj.weight]

    def _heads(self, t: Tensor) -> Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, dh)

    def _mask(self, b: int, t: int, s: int, key_padding_mask: Tensor | None, device) -> Tensor | None:
        """Boolean (B or 1, 1, T, S) mask, True where attending is allowed; None when everything is."""
        allowed = None
        if self.causal:
            allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)[None, None]
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool:
                # an int mask is ambiguous (Hugging Face's attention_mask uses 1 for *real* tokens): insist on bool
                raise TypeError(
                    f"key_padding_mask must be a bool tensor, True at padded positions; got {key_padding_mask.dtype}"
                )
            if key_padding_mask.shape != (b, s):
                raise ValueError(f"key_padding_mask must have shape {(b, s)}, got {tuple(key_padding_mask.shape)}")
            keep = ~key_padding_mask[:, None, None, :]
            allowed = keep if allowed is None else allowed & keep
        if allowed is not None and key_padding_mask is not None:
            # a query with no allowed key (e.g. a left-padded first position) would give NaN, and NaN in a padded
            # position poisons real ones through 0 * NaN; let such rows attend everywhere: their output is unused
            allowed = allowed | ~allowed.any(-1, keepdim=True)
        return allowed

    def forward(self, x: Tensor, context: Tensor | None = None, *, key_padding_mask: Tensor | None = None) -> Tensor:
        if context is not None and self.causal:
            raise ValueError("causal masking applies to self-attention only; pass context=None")
        c = x if context is None else context
        b, t, _ = x.shape
        s = c.shape[1]
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(c)), self._heads(self.v_proj(c))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        p = self.dropout if self.training else 0.0
        if self.record_logits:
            y = self._explicit_attention(q, k, v, self._mask(b, t, s, key_padding_mask, x.device), p)
        elif key_padding_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal and t > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, self._mask(b, t, s, key_padding_mask, x.device), dropout_p=p)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.d_model))

    def _explicit_attention(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, p: float) -> Tensor:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, S)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        self.max_logit = scores.detach().amax()
        attn = torch.softmax(scores, dim=-1)
        if p > 0:
            attn = F.dropout(attn, p)
        return attn @ v

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, causal={self.causal}"


def record_attention_logits(model: nn.Module, enabled: bool = True) -> list[MultiHeadAttention]:
    """Switch ``record_logits`` on (or off) in every attention module of ``model``; returns those modules.

    Recording computes attention explicitly instead of with SDPA: slower, same result.
    """
    mods = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    for m in mods:
        m.record_logits = enabled
        if not enabled:
            m.max_logit = None
    return mods


def max_attention_logits(model: nn.Module) -> dict[str, float]:
    """``{module name: max attention logit of its last forward}`` for every attention module that recorded one."""
    return {
        name: float(m.max_logit)
        for name, m in model.named_modules()
        if isinstance(m, MultiHeadAttention) and m.max_logit is not None
    }
