"""Two stages of model seeds: more seeds where the spread asks for it, decided by a rule fixed before the run.

An experiment registers ``second_stage=K`` (core.Experiment). The runner runs it once with its first-stage model
seeds (``ctx.model_seeds(n)``: the first n of the lab seed). If that run's evidence leaves a rule, claim or control,
undecided (its bootstrap 95% interval straddles its threshold: evidence.undecided), the runner runs it once more
with ``ctx.extra_seeds = K``: the same n seeds and the K after them, and that run's result is the experiment's.
Never a third time, whatever the second stage shows; an experiment without a second stage runs once.

The trigger is computed from this run alone, not from the pooled record: a run's content must not depend on which
other runs someone recorded (the cache key, ``lab merge`` and ``lab seeds``' "two runs of one code at one lab seed
agree" all rest on that), so each lab seed's run is a complete two-stage design of its own, and every run of the
same code at the same lab seed takes the same stages.

The second call reuses the first stage's work: its ``ctx.map`` tasks come from this module's memo (so ``--fresh``
does not train them twice), and the batched engine groups the second stage's seeds apart from the first's
(training_batch.train_runs), so the first stage's tasks are the same tasks. :func:`run_stages` checks that the
second stage kept every first-stage unit unchanged and added the units of K new model seeds.

The record says what happened (``stages`` in results.json, a line in the report): the declared counts, whether
the second stage was taken, the rules that asked for it with their first-stage intervals, and the first stage's
verdict.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from addnorm.io import json_default
from addnorm.lab.core import Context, Experiment, Result
from addnorm.lab.evidence import undecided
from addnorm.lab.tasks import task_name

__all__ = ["Memo", "run_stages", "second_stage_reasons", "check_second_stage"]


class Memo:
    """A ``Context.mapper`` that remembers every task's result (as JSON text) and serves a task it has seen from
    memory, handing only the others to ``mapper`` (in one call, in order)."""

    def __init__(self, mapper: Callable[[Callable[..., Any], Sequence[dict[str, Any]]], list[Any]]) -> None:
        self.mapper = mapper
        self.results: dict[str, str] = {}
        self.served = 0  # tasks answered from memory

    @staticmethod
    def key(fn: Callable[..., Any], task: dict[str, Any]) -> str:
        return task_name(fn) + "\0" + json.dumps(task, sort_keys=True, default=json_default)

    def __call__(self, fn: Callable[..., Any], tasks: Sequence[dict[str, Any]]) -> list[Any]:
        tasks = list(tasks)
        keys = [self.key(fn, t) for t in tasks]
        missing = [i for i, k in enumerate(keys) if k not in self.results]
        fresh = list(self.mapper(fn, [tasks[i] for i in missing])) if missing else []
        out: list[Any] = [None] * len(tasks)
        for i, value in zip(missing, fresh):
            self.results[keys[i]] = json.dumps(value, default=json_default)
            out[i] = value
        known = [i for i in range(len(tasks)) if i not in set(missing)]
        for i in known:
            out[i] = json.loads(self.results[keys[i]])  # a copy: the caller may change what it gets
        self.served += len(known)
        return out


def second_stage_reasons(evidence: dict[str, Any] | None) -> list[str]:
    """Why the second stage is needed: each undecided rule with its role and interval (empty: every rule decided)."""
    if evidence is None:
        return []
    return [
        f"{r.name} ({r.role}): {j.estimate:.3g} [{j.low:.3g}, {j.high:.3g}] over {j.n} units straddles {_bar(r, j)}"
        for r, j in undecided(evidence)
    ]


def _bar(rule, judgement) -> str:
    if rule.op in (">", "<"):
        return f"{rule.op} {rule.threshold:g}"
    margin = judgement.margin if judgement.margin is not None else rule.threshold
    return f"{'inside' if rule.op == 'within' else 'outside'} +-{margin:.3g}"


def _unit_seeds(evidence: dict[str, Any]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for name, us in evidence["units"].items():
        by_seed = out.setdefault(name, {})
        for u in us:
            if u["seed"] in by_seed:
                raise ValueError(f"rule {name!r} has two units of model seed {u['seed']}")
            by_seed[u["seed"]] = u
    return out


def check_second_stage(first: dict[str, Any], second: dict[str, Any] | None, added: int) -> list[int]:
    """That ``second`` (the second stage's evidence) holds every unit of ``first`` unchanged, under the same rules,
    and the units of ``added`` new model seeds; returns the new seeds. Raises ValueError naming what differs."""
    if second is None:
        raise ValueError("the second stage returned no evidence")
    if second["rules"] != first["rules"]:
        raise ValueError("the second stage was judged by other rules than the first")
    a, b = _unit_seeds(first), _unit_seeds(second)
    new: set[int] = set()
    for name, units in a.items():
        changed = [s for s, u in units.items() if b.get(name, {}).get(s) != u]
        if changed:
            raise ValueError(
                f"the second stage changed the first stage's units of rule {name!r} (model seeds {sorted(changed)}): "
                "the first stage's runs must be reused unchanged"
            )
        new |= set(b.get(name, {})) - set(units)
    first_seeds = {s for units in a.values() for s in units}
    if len(new) != added or new & first_seeds:
        raise ValueError(
            f"the second stage should add the units of {added} new model seeds, got {sorted(new)}: does the "
            "experiment take its seeds from ctx.model_seeds?"
        )
    return sorted(new)


def run_stages(exp: Experiment, ctx: Context, call: Callable[[Context], Result], *, between=None) -> tuple:
    """(the experiment's result, its ``stages`` record or None). ``call(ctx)`` runs the experiment once and returns
    its checked Result; ``between()`` runs before a second stage (the runner clears the first stage's figures)."""
    if not exp.second_stage:
        return call(ctx), None
    memo = Memo(ctx.mapper)
    ctx.mapper = memo
    first = call(ctx)
    if first.evidence is None:
        raise ValueError(f"experiment {exp.name!r} declares a second stage but returned no evidence to decide it on")
    seeds = sorted({u["seed"] for us in first.evidence["units"].values() for u in us})
    why = second_stage_reasons(first.evidence)
    record: dict[str, Any] = {
        "declared": {"first": len(seeds), "second": exp.second_stage},
        "taken": bool(why),
        "why": why,
        "first_stage": {"verdict": first.verdict, "seeds": seeds},
        "second_stage_seeds": [],
    }
    if not why:
        return first, record
    ctx.progress(f"second stage: {exp.second_stage} more model seeds")
    if between is not None:
        between()
    second = call(dataclasses.replace(ctx, extra_seeds=exp.second_stage))  # the same mapper: the memo
    record["second_stage_seeds"] = check_second_stage(first.evidence, second.evidence, exp.second_stage)
    return second, record
