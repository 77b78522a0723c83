"""Diagnostics for any PyTorch model: per-layer telemetry, anomaly detection, and a static + runtime "doctor".

- :class:`Monitor`: per-block gradient norms, residual-stream RMS, norm-input RMS, attention logits, log Z and the
  DeepNet update size, through removable hooks; JSONL/TensorBoard output.
- :class:`SpikeDetector`, :class:`NonFiniteSentinel`, :func:`localize_jump`: spikes, the first NaN, the first
  layer that jumped.
- :func:`diagnose` (``addnorm doctor FILE.py:FACTORY``): norm over the wrong axis, a non-identity skip path,
  deep Post-Norm, half-precision statistics, a missing final norm, fast residual growth.
- :mod:`addnorm.diagnostics.plots`: steps x layers heatmaps and per-layer curves (matplotlib).
"""

from addnorm.diagnostics.anomaly import Jump, NonFiniteSentinel, SpikeDetector, localize_jump
from addnorm.diagnostics.doctor import Finding, diagnose
from addnorm.diagnostics.monitor import Monitor, find_blocks, layer_series

__all__ = [
    "Monitor",
    "find_blocks",
    "layer_series",
    "SpikeDetector",
    "NonFiniteSentinel",
    "Jump",
    "localize_jump",
    "Finding",
    "diagnose",
]
