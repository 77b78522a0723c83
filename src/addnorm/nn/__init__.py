"""Modules: drop-in norms (and, built on them, residual placements, layers, models and presets)."""

from addnorm.nn.norms import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
