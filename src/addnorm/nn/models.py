"""Transformer models from a :class:`TransformerConfig`: decoder-only LM, encoder, encoder-decoder.

    x = Embed(ids) [+ positions] [-> Norm]            # (B, T, d)
    for block in blocks: x = block(x)                 # each block's output is the residual stream after it
    logits = LMHead(FinalNorm(x))                     # (B, T, V); the final norm only where the placement needs it

Init: every linear N(0, init_std) or Xavier-normal (``config.init``), embeddings N(0, init_std), biases 0, norms
at their own defaults; then ``residual_init_scaling`` divides the weights that write into the stream (attention
out_proj, FFN fc_out) by sqrt(2 * n_layers) (GPT-2), and DeepNorm multiplies FFN, value and output projection
weights by beta (never Q, K).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from addnorm.nn.attention import RotaryEmbedding
from addnorm.nn.config import TransformerConfig
from addnorm.nn.layers import DecoderLayer, make_block
from addnorm.nn.norm_kinds import call_norm, make_norm
from addnorm.nn.residual import (
    deepnorm_coefficients,
    deepnorm_scaled_weights,
    residual_output_weights,
    scale_weights_,
)

__all__ = ["Embeddings", "TransformerLM", "TransformerEncoder", "TransformerEncoderDecoder"]


def _sinusoidal(max_len: int, d: int) -> Tensor:
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(max_len, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : d // 2]
    return table.float()


class Embeddings(nn.Module):
    """Token embedding (times sqrt(d) with ``embed_scale``) plus learned or sinusoidal positions (none for
    RoPE/"none"), optional norm, dropout."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.max_seq_len = config.max_seq_len
        self.scale = math.sqrt(config.d_model) if config.embed_scale else 1.0
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_seq_len, config.d_model) if config.positional == "learned" else None
        if config.positional == "sinusoidal":
            self.register_buffer("sinusoid", _sinusoidal(config.max_seq_len, config.d_model), persistent=False)
        else:
            self.sinusoid = None
        self.norm = (
            make_norm(config.norm, config.d_model, config.eps, **config.norm_factory_kwargs())
            if config.embed_norm
            else None
        )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input ids must be an integer tensor (B, T), got {ids.dtype} {tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.max_seq_len}")
        if ids.device.type != "cpu" and not torch.compiler.is_compiling():
            # an out-of-range id on a GPU is a device-side assert that kills the CUDA context: check first
            if (problem := self._bad_ids(ids)) is not None:
                raise ValueError(problem)
        try:
            x = self.tok(ids)  # (B, T, d)
        except IndexError:  # CPU: torch's bare "index out of range in self"; checked only then, so free otherwise
            if (problem := self._bad_ids(ids)) is None:
                raise
            raise ValueError(problem) from None
        if self.scale != 1.0:
            x = x * self.scale
        if self.pos is not None:
            x = x + self.pos.weight[:t]
        elif self.sinusoid is not None:
            x = x + self.sinusoid[:t].to(x.dtype)
        if self.norm is not None:
            x = call_norm(self.norm, x, padding_mask=padding_mask)
        return self.dropout(x)

    def _bad_ids(self, ids: Tensor) -> str | None:
        """What is wrong with ``ids`` for this vocabulary, or None."""
        if ids.numel() == 0:
            return None
        lo, hi = (int(v) for v in torch.aminmax(ids))
        vocab = self.tok.num_embeddings
        if 0 <= lo and hi < vocab:
            return None
        bad = f"the largest is {hi}" if hi >= vocab else f"the smallest is {lo}"
        return (
            f"token ids must be in [0, vocab_size={vocab}): {bad} (ids range over [{lo}, {hi}]); give a "
            "vocab_size that covers the tokenizer's ids"
        )


def _rotary(config: TransformerConfig) -> RotaryEmbedding | None:
    return RotaryEmbedding(config.head_dim, config.max_seq_len) if config.positional == "rope" else None


def _final_norm(config: TransformerConfig) -> nn.Module | None:
    if not config.use_final_norm:
        return None
    return make_norm(config.norm, config.d_model, config.eps, **config.norm_factory_kwargs())


def _deepnorm(
    config: TransformerConfig, n_enc: int, n_dec: int
) -> tuple[float | None, float | None, float | None, float | None]:
    """(encoder alpha, encoder beta, decoder alpha, decoder beta), config overrides applied; Nones if unused."""
    if config.placement != "deepnorm":
        return None, None, None, None
    c = deepnorm_coefficients(n_enc, n_dec)
    a, b = config.deepnorm_alpha, config.deepnorm_beta

    def pick(override, value):
        return None if value is None else (override if override is not None else value)

    return pick(a, c.encoder_alpha), pick(b, c.encoder_beta), pick(a, c.decoder_alpha), pick(b, c.decoder_beta)


@torch.no_grad()
def _init_weights(model: nn.Module, config: TransformerConfig, stacks: list[tuple[nn.Module, int, float | None]]):
    """Base init of every linear/embedding, then per stack (blocks, depth, DeepNorm beta) the depth scalings."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if config.init == "xavier":
                nn.init.xavier_normal_(m.weight)
            else:
                nn.init.normal_(m.weight, 0.0, config.init_std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    # embeddings last: a tied LM head shares the token embedding's weight and keeps the embedding's init
    for m in embeddings:
        nn.init.normal_(m.weight, 0.0, config.init_std)
    for blocks, depth, beta in stacks:
        if config.residual_init_scaling:
            scale_weights_(residual_output_weights(blocks), 1.0 / math.sqrt(2 * depth))
        if beta is not None:
            scale_weights_(deepnorm_scaled_weights(blocks), beta)


class _LMHead(nn.Module):
    def __init__(self, config: TransformerConfig, embeddings: Embeddings):
        super().__init__()
        self.proj = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.proj.weight = embeddings.tok.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class _BlockStackLM(nn.Module):
    """Embeddings, a stack of blocks, the final norm and the LM head: what the decoder-only and the encoder-only
    models share; they differ in the attention mask and in which side's DeepNorm constants apply."""

    def __init__(self, config: TransformerConfig, *, causal: bool):
        super().__init__()
        self.config = config
        enc_alpha, enc_beta, dec_alpha, dec_beta = (
            _deepnorm(config, 0, config.n_layers) if causal else _deepnorm(config, config.n_layers, 0)
        )
        alpha, beta = (dec_alpha, dec_beta) if causal else (enc_alpha, enc_beta)
        self.deepnorm_alpha, self.deepnorm_beta = alpha, beta
        self.embed = Embeddings(config)
        rotary = _rotary(config)
        self.blocks = nn.ModuleList(
            make_block(config, i, causal=causal, deepnorm_alpha=alpha, rotary=rotary) for i in range(config.n_layers)
        )
        self.final_norm = _final_norm(config)
        self.lm_head = _LMHead(config, self.embed)
        _init_weights(self, config, [(self.blocks, config.n_layers, beta)])

    def hidden_states(self, input_ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """The stream after the last block and the final norm (B, T, d)."""
        x = self.embed(input_ids, padding_mask)
        for block in self.blocks:
            x = block(x, padding_mask)
        if self.final_norm is not None:
            x = call_norm(self.final_norm, x, padding_mask=padding_mask)
        return x

    def forward(self, input_ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, padding_mask))


class TransformerLM(_BlockStackLM):
    """Decoder-only language model: ``forward(input_ids) -> logits`` (B, T, vocab_size).

    ``self.blocks``: one module per layer (hook a block's output to read the residual stream after that layer);
    ``self.final_norm``: the norm before the LM head, or None. ``self.deepnorm_alpha/beta``: DeepNorm's constants
    in use (None unless placement is "deepnorm").
    """

    def __init__(self, config: TransformerConfig):
        super().__init__(config, causal=True)


class TransformerEncoder(_BlockStackLM):
    """Bidirectional encoder (BERT-style): ``forward(input_ids, padding_mask=None) -> logits`` (B, T, V).

    padding_mask (B, T) bool, True at padded positions (no attention to them; batchnorm leaves them out of its
    statistics). ``encode`` returns the final hidden states instead. Attributes as :class:`TransformerLM`.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__(config, causal=False)

    def encode(self, input_ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.hidden_states(input_ids, padding_mask)


class TransformerEncoderDecoder(nn.Module):
    """Encoder-decoder (original Transformer): ``forward(src_ids, tgt_ids) -> logits`` (B, T_tgt, V).

    ``config.n_layers`` encoder layers, ``config.n_decoder_layers`` (default n_layers) decoder layers, one shared
    vocabulary and embedding. DeepNorm uses the encoder-decoder formulas. Attributes: ``encoder_blocks``,
    ``decoder_blocks``, ``encoder_final_norm``, ``decoder_final_norm`` (each None where the placement needs none).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.parallel:
            raise ValueError("parallel blocks are defined for self-attention stacks; use parallel=False here")
        self.config = config
        n, m = config.n_layers, config.decoder_layers
        ea, eb, da, db = _deepnorm(config, n, m)
        self.deepnorm_alpha = {"encoder": ea, "decoder": da}
        self.deepnorm_beta = {"encoder": eb, "decoder": db}
        self.embed = Embeddings(config)
        rotary = _rotary(config)
        self.encoder_blocks = nn.ModuleList(
            make_block(config, i, causal=False, deepnorm_alpha=ea, n_layers=n, rotary=rotary) for i in range(n)
        )
        self.decoder_blocks = nn.ModuleList(
            DecoderLayer(config, i, deepnorm_alpha=da, n_layers=m, rotary=rotary) for i in range(m)
        )
        self.encoder_final_norm = _final_norm(config)
        self.decoder_final_norm = _final_norm(config)
        self.lm_head = _LMHead(config, self.embed)
        _init_weights(self, config, [(self.encoder_blocks, n, eb), (self.decoder_blocks, m, db)])

    def encode(self, src_ids: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        x = self.embed(src_ids, src_padding_mask)
        for block in self.encoder_blocks:
            x = block(x, src_padding_mask)
        if self.encoder_final_norm is not None:
            x = call_norm(self.encoder_final_norm, x, padding_mask=src_padding_mask)
        return x

    def decode(
        self,
        tgt_ids: Tensor,
        memory: Tensor,
        tgt_padding_mask: Tensor | None = None,
        src_padding_mask: Tensor | None = None,
    ) -> Tensor:
        x = self.embed(tgt_ids, tgt_padding_mask)
        for block in self.decoder_blocks:
            x = block(x, memory, tgt_padding_mask, src_padding_mask)
        if self.decoder_final_norm is not None:
            x = call_norm(self.decoder_final_norm, x, padding_mask=tgt_padding_mask)
        return self.lm_head(x)

    def forward(
        self,
        src_ids: Tensor,
        tgt_ids: Tensor,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
    ) -> Tensor:
        memory = self.encode(src_ids, src_padding_mask)
        return self.decode(tgt_ids, memory, tgt_padding_mask, src_padding_mask)
