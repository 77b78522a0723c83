"""Diagnostics for any PyTorch model: per-layer telemetry, anomaly detection, and a static + runtime "doctor".

- :class:`Monitor`: per-block gradient norms, residual-stream RMS, norm-input RMS, attention logits, log Z and the
  DeepNet update size, through removable hooks; JSONL/TensorBoard output.
- :class:`SpikeDetector`, :class:`NonFiniteSentinel`, :func:`localize_jump`: spikes, the first NaN, the first
  layer that jumped.
- :func:`diagnose` (``addnorm doctor FILE.py:FACTORY``): norm over the wrong axis, a non-identity skip path,
  deep Post-Norm, half-precision statistics, a missing final norm, fast residual growth.
- :mod:`addnorm.diagnostics.plots`: steps x layers heatmaps and per-layer curves (matplotlib).

Names are imported on first use (PEP 562): the ``addnorm doctor`` command is registered from
:mod:`addnorm.diagnostics.doctor.cli`, and ``addnorm --help`` must not import torch through this package.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Monitor": "addnorm.diagnostics.monitor",
    "find_blocks": "addnorm.diagnostics.blocks",
    "layer_series": "addnorm.diagnostics.monitor",
    "SpikeDetector": "addnorm.diagnostics.anomaly",
    "NonFiniteSentinel": "addnorm.diagnostics.anomaly",
    "Jump": "addnorm.diagnostics.anomaly",
    "localize_jump": "addnorm.diagnostics.anomaly",
    "Finding": "addnorm.diagnostics.doctor.findings",
    "diagnose": "addnorm.diagnostics.doctor.diagnosis",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'addnorm.diagnostics' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
