"""The lab's building blocks: an experiment states a claim and its source, runs, and returns a verdict computed
from a criterion fixed in its code before the run.

    @experiment("ln-vs-rms", claim="...", source="seed 000, exercise 1")
    def ln_vs_rms(ctx: Context) -> Result:
        ...
        return Result(verdict=verdict_from(passed), metrics={...}, figures=[...], summary="...")

Experiments register on import; :data:`EXPERIMENTS` keeps them in registration order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

VERDICTS = ("reproduced", "not reproduced", "inconclusive")


@dataclass(kw_only=True)
class Result:
    """What an experiment found. ``metrics`` must be JSON-serializable; ``figures`` are file names in the figure
    directory (PNG)."""

    verdict: str
    metrics: dict[str, Any]
    figures: list[str] = field(default_factory=list)
    summary: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclass(kw_only=True)
class Context:
    """What an experiment may use: sizes (``quick``), the seed, the device, where figures go, a progress hook, and
    the experiment's registered ``config`` (a copy, so an experiment cannot change its own cache key)."""

    quick: bool = False
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    figure_dir: Path = Path(".")
    progress: Callable[[str], None] = lambda message: None
    config: dict[str, Any] = field(default_factory=dict)

    def figure_path(self, name: str) -> Path:
        self.figure_dir.mkdir(parents=True, exist_ok=True)
        return self.figure_dir / name


@dataclass(kw_only=True)
class Experiment:
    name: str
    claim: str
    source: str
    run: Callable[[Context], Result]
    # Anything that changes the result besides quick/seed/device: part of the cache key.
    config: dict[str, Any] = field(default_factory=dict)
    # The verdict's rule in words, fixed before the run; the report shows it next to the verdict.
    criterion: str = ""


EXPERIMENTS: dict[str, Experiment] = {}


def experiment(
    name: str, *, claim: str, source: str, config: dict[str, Any] | None = None, criterion: str = ""
):
    """Register ``fn(ctx) -> Result`` as the experiment ``name``; ``criterion`` states the verdict's rule."""

    def register(fn: Callable[[Context], Result]) -> Callable[[Context], Result]:
        if name in EXPERIMENTS:
            raise ValueError(f"experiment {name!r} is registered twice")
        EXPERIMENTS[name] = Experiment(
            name=name, claim=claim, source=source, run=fn, config=dict(config or {}), criterion=criterion
        )
        return fn

    return register


def verdict_from(passed: bool | None) -> str:
    """True -> reproduced, False -> not reproduced, None (the run could not decide) -> inconclusive."""
    return "inconclusive" if passed is None else ("reproduced" if passed else "not reproduced")
