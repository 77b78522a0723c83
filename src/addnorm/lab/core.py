"""The lab's building blocks: an experiment states a claim and its source, runs, and returns a verdict computed
from a criterion fixed in its code before the run.

    @experiment("ln-vs-rms", claim="...",
                source="Zhang & Sennrich 2019, Root Mean Square Layer Normalization, arXiv:1910.07467")
    def ln_vs_rms(ctx: Context) -> Result:
        ...
        return Result(verdict=verdict_from(passed), metrics={...}, figures=[...], summary="...")

Experiments register on import; :data:`EXPERIMENTS` keeps them in registration order.

Kinds. ``kind="empirical"`` (the default) tests what a paper says happens; only these count in the report's
headline. ``kind="sanity"`` is a deterministic numerics check or identity that must hold if the code is right
(an LN output has RMS 1, fp16 overflows above 65504): shown, labelled, never counted as evidence.
``kind="demonstration"`` illustrates an article's exercise with figures (its verdict says whether the
demonstration showed what it should).

Controls. An empirical experiment states its ``precondition`` (the positive/negative control that shows the
claim could be seen at all). When it fails, the verdict is ``inconclusive`` and ``Result.reason`` says why.

Tasks. An experiment that runs many small independent computations (trainings at several seeds, LRs, depths)
hands them to ``ctx.map(fn, tasks)``: ``fn`` is a module-level function (picklable), each task a dict of keyword
arguments, and the results come back in task order. A task must be deterministic from its arguments (it seeds
its own generators, and runs with one torch thread), and must return JSON-serializable data (dicts, lists,
numbers, strings, None; non-finite floats allowed), so the lab's executor can run tasks on worker processes or
torchrun ranks, cache them for resuming, and give results bitwise identical to running them here in order.

Two stages of model seeds. An experiment may pre-register a ``second_stage``: a fixed number of model seeds the
runner adds, once, when the first stage's evidence leaves a rule undecided (stages.py). The experiment takes its
model seeds from ``ctx.model_seeds(n)``: the first ``n`` of its lab seed in the first stage, those and
``ctx.extra_seeds`` more in the second.

Suites. ``suite="core"`` (the default) puts an experiment in the default run; ``suite="extended"`` only in
``addnorm lab --suite all`` (and ``--only``), so new experiments do not lengthen the default run past its budget.

Timings. Wall-clock measurements go into ``Result.timings``, not ``metrics``: metrics are what the code and the
seed determine (merge compares them across machines); timings differ on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from addnorm.lab.seeds import STRIDE
from addnorm.lab.seeds import model_seeds as _model_seeds

VERDICTS = ("reproduced", "not reproduced", "inconclusive")
KINDS = ("empirical", "sanity", "demonstration")
# Which suite an experiment belongs to. ``addnorm lab`` (``--suite core``) runs the "core" ones, sized to fit the
# default run's time budget; ``--suite all`` adds the "extended" ones. ``--only`` picks from both.
SUITES = ("core", "extended")
# How the training experiments train their runs (``Context.engine``, ``addnorm lab --engine``). "sequential" (the
# default): one model per task with addnorm.train.loop.train, bitwise the same for any --jobs; the recorded results
# use it. "batched": runs that can share one stacked computation train as one task
# (addnorm.train.batched.train_batched), faster on a CPU, equal to the sequential numbers up to float rounding.
ENGINES = ("sequential", "batched")


@dataclass(kw_only=True)
class Result:
    """What an experiment found. ``metrics`` must be JSON-serializable; ``figures`` are file names in the figure
    directory (PNG)."""

    verdict: str
    metrics: dict[str, Any]
    figures: list[str] = field(default_factory=list)
    summary: str = ""
    # Wall-clock measurements (seconds, ratios of times): shown, but not compared by merge (module docstring).
    timings: dict[str, Any] = field(default_factory=dict)
    # Why the verdict is "inconclusive" (a failed precondition/control, a run that could not decide); "" otherwise.
    reason: str = ""
    # The units and pre-registered rules behind the verdict (addnorm.lab.evidence.evidence(...)): what the seed
    # record stores and pools across lab seeds. None for experiments not yet expressed as rules.
    evidence: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


def serial_map(fn: Callable[..., Any], tasks: Sequence[dict[str, Any]]) -> list[Any]:
    """The default task mapper: run each task here, in order."""
    return [fn(**task) for task in tasks]


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
    # How ctx.map runs tasks: serially here by default; the lab's executor puts in a process-pool or torchrun one.
    mapper: Callable[[Callable[..., Any], Sequence[dict[str, Any]]], list[Any]] = serial_map
    # How training runs train (see ENGINES); the runner puts it into the experiment's cache key.
    engine: str = "sequential"
    # The model seeds the second stage adds (Experiment.second_stage), 0 in the first stage (stages.py).
    extra_seeds: int = 0
    # The seeds model_seeds handed out as the second stage's: the batched engine groups them apart from the first
    # stage's, so the first stage's tasks are the same tasks in both calls and are not trained again.
    second_stage_seeds: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine (--engine) must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if isinstance(self.extra_seeds, bool) or not isinstance(self.extra_seeds, int) or self.extra_seeds < 0:
            raise ValueError(f"extra_seeds must be an int >= 0, got {self.extra_seeds!r}")

    def model_seeds(self, n: int) -> list[int]:
        """The experiment's model seeds (seeds.model_seeds of the lab seed): the first ``n``, and in the second
        stage the ``extra_seeds`` after them."""
        seeds = _model_seeds(self.seed, n + self.extra_seeds)
        self.second_stage_seeds.update(seeds[n:])
        return seeds

    def map(self, fn: Callable[..., Any], tasks: Sequence[dict[str, Any]]) -> list[Any]:
        """``[fn(**t) for t in tasks]``, possibly in parallel; results in task order (see the module docstring)."""
        tasks = list(tasks)
        if not all(isinstance(t, dict) for t in tasks):
            raise TypeError("ctx.map tasks must be dicts of keyword arguments")
        return list(self.mapper(fn, tasks))

    def figure_path(self, name: str) -> Path:
        self.figure_dir.mkdir(parents=True, exist_ok=True)
        return self.figure_dir / name


@dataclass(frozen=True, kw_only=True)
class Change:
    """A setup, criterion, control or threshold changed after a run of the experiment had been recorded: the report
    shows it next to the verdict (pre-registration you can audit). ``date`` is YYYY-MM-DD; ``showed`` is what the
    run before the change showed; ``reason`` why the change was made (written before the rerun)."""

    date: str
    what: str
    showed: str
    reason: str

    def __post_init__(self) -> None:
        import datetime

        try:
            datetime.date.fromisoformat(self.date)
        except (TypeError, ValueError):
            raise ValueError(f"Change.date must be YYYY-MM-DD, got {self.date!r}") from None
        for name in ("what", "showed", "reason"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"Change.{name} must say something (date {self.date})")


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
    # "empirical" | "sanity" | "demonstration" (module docstring); only empirical verdicts are counted as evidence.
    kind: str = "empirical"
    # The control that must hold for the experiment to test its claim at all; failing it -> "inconclusive".
    precondition: str = ""
    # "core" (in the default run) | "extended" (only in --suite all and --only); see the module docstring.
    suite: str = "core"
    # The pre-registered rules (addnorm.lab.evidence.Rule) the verdict is read from, claim and controls; when they
    # were fixed ("YYYY-MM-DD at <commit>", the commit the rules were written against); and every change made
    # after a recorded run (Change), oldest first.
    rules: tuple = ()
    fixed: str = ""
    changes: tuple[Change, ...] = ()
    # Model seeds added once when the first stage leaves a rule undecided (0: one stage); see stages.py.
    second_stage: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.suite not in SUITES:
            raise ValueError(f"suite must be one of {SUITES}, got {self.suite!r}")
        n = self.second_stage
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < STRIDE:
            raise ValueError(f"experiment {self.name!r}: second_stage must be an int in [0, {STRIDE}), got {n!r}")


EXPERIMENTS: dict[str, Experiment] = {}


def experiment(
    name: str,
    *,
    claim: str,
    source: str,
    config: dict[str, Any] | None = None,
    criterion: str = "",
    kind: str = "empirical",
    precondition: str = "",
    suite: str = "core",
    rules: Sequence[Any] = (),
    fixed: str = "",
    changes: Sequence[Change] = (),
    second_stage: int = 0,
):
    """Register ``fn(ctx) -> Result`` as the experiment ``name``; ``criterion`` states the verdict's rule,
    ``precondition`` the control, ``kind`` whether it is evidence, ``suite`` which run includes it,
    ``second_stage`` the model seeds a second stage adds (see the module docstring)."""

    def register(fn: Callable[[Context], Result]) -> Callable[[Context], Result]:
        if name in EXPERIMENTS:
            raise ValueError(f"experiment {name!r} is registered twice")
        EXPERIMENTS[name] = Experiment(
            name=name,
            claim=claim,
            source=source,
            run=fn,
            config=dict(config or {}),
            criterion=criterion,
            kind=kind,
            precondition=precondition,
            suite=suite,
            rules=tuple(rules),
            fixed=fixed,
            changes=tuple(changes),
            second_stage=second_stage,
        )
        return fn

    return register


def verdict_from(passed: bool | None) -> str:
    """True -> reproduced, False -> not reproduced, None (the run could not decide) -> inconclusive."""
    return "inconclusive" if passed is None else ("reproduced" if passed else "not reproduced")
