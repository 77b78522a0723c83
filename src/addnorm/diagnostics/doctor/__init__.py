"""``addnorm doctor``: find Add & Norm mistakes in a model, statically and with one forward and backward.

    diagnosis.py      diagnose(model, batch): runs the checks, adds the stack-level ones; the table of checks
    example_run.py    the one forward and backward, with hooks recording what each block and norm received
    norm_checks.py    per norm: normalized over the wrong axis, statistics in half precision
    block_checks.py   per block: is the skip path the identity, which placement, causal attention, DeepNorm
    designs.py        deliberate designs whose skip path is not x, explained by a note instead of an error
    findings.py       Finding (what, where, how to fix) and DoctorConfig (the thresholds)
    cli.py            the command: loads FILE.py:FACTORY or a Hugging Face config, guards against the target

Names are imported on first use (PEP 562), as in :mod:`addnorm.diagnostics`: ``addnorm --help`` imports ``cli.py``,
which must not import torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "diagnose": "addnorm.diagnostics.doctor.diagnosis",
    "Finding": "addnorm.diagnostics.doctor.findings",
    "DoctorConfig": "addnorm.diagnostics.doctor.findings",
    "SEVERITIES": "addnorm.diagnostics.doctor.findings",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'addnorm.diagnostics.doctor' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
