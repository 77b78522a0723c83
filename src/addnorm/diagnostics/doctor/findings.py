"""The doctor's findings (what was found, where, how to fix it) and the thresholds of its checks."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Finding", "DoctorConfig", "SEVERITIES", "sort_findings"]

SEVERITIES = ("error", "warning", "info")


@dataclass(kw_only=True)
class Finding:
    """One problem (or note) about the model: ``code``, ``severity`` ("error"|"warning"|"info"), the module path,
    what was seen, and how to fix it."""

    code: str
    severity: str
    module: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class DoctorConfig:
    """Thresholds of the checks (each one stated in the module docstring)."""

    post_norm_depth: int = 12  # Post-Norm blocks from which a deep-Post-Norm warning is given
    growth_factor: float = 2.0  # residual-growth fires above growth_factor * sqrt((1 + 1.5 L) / 1.5)
    identity_rtol: float = 1e-3  # zeroed block vs x (a scaled/projected skip is off by far more)
    norm_rtol: float = 5e-2  # zeroed Post-Norm block vs Norm(x) up to a gain (eps shifts it by ~1%)
    coupling_rtol: float = 1e-4  # output change at untouched positions, relative to the output's scale


def sort_findings(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
