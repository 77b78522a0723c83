"""Modules: drop-in norms (and, built on them, residual placements, layers, models and presets)."""

from addnorm.nn.attention import MultiHeadAttention, RotaryEmbedding, max_attention_logits, record_attention_logits
from addnorm.nn.config import PRESETS, TransformerConfig
from addnorm.nn.ffn import FFN_KINDS, FeedForward
from addnorm.nn.layers import DecoderLayer, EncoderLayer, ParallelBlock, make_block, residual_chain
from addnorm.nn.models import TransformerEncoder, TransformerEncoderDecoder, TransformerLM
from addnorm.nn.norm_kinds import NORM_KINDS, DyT, NoNorm, ScaleNorm, SequenceBatchNorm, make_norm
from addnorm.nn.norms import LayerNorm, RMSNorm
from addnorm.nn.placements import PLACEMENTS
from addnorm.nn.residual import DeepNormCoefficients, Residual, deepnorm_coefficients

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "NORM_KINDS",
    "ScaleNorm",
    "DyT",
    "SequenceBatchNorm",
    "NoNorm",
    "make_norm",
    "PLACEMENTS",
    "Residual",
    "DeepNormCoefficients",
    "deepnorm_coefficients",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "record_attention_logits",
    "max_attention_logits",
    "FFN_KINDS",
    "FeedForward",
    "PRESETS",
    "TransformerConfig",
    "EncoderLayer",
    "DecoderLayer",
    "ParallelBlock",
    "make_block",
    "residual_chain",
    "TransformerLM",
    "TransformerEncoder",
    "TransformerEncoderDecoder",
]
