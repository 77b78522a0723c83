"""Fake lab experiments for the runner, cache, merge and command-line tests: they count their calls and write a
tiny figure, so caching and merging are visible without running a real experiment."""

from __future__ import annotations

from pathlib import Path

from addnorm.lab.core import Context, Experiment, Result, verdict_from
from addnorm.lab.runner import RunOptions

# A 1x1 PNG, so fake experiments can emit a figure without matplotlib.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201a5f6a1d50000000049454e44ae426082"
)


def make_registry(calls: dict[str, int], *, fail: set[str] = frozenset(), n: int = 4) -> dict[str, Experiment]:
    """Fake experiments that count their calls; their metrics depend on the seed and quick so caching is visible."""

    def make(name: str):
        def fn(ctx: Context) -> Result:
            calls[name] = calls.get(name, 0) + 1
            if name in fail:
                raise RuntimeError(f"{name} broke")
            ctx.figure_path("fig.png").write_bytes(PNG)
            value = ctx.seed * 10 + len(name) + (0.5 if ctx.quick else 0) + ctx.config["offset"]
            return Result(
                verdict=verdict_from(value > 3),
                metrics={"value": value, "criterion": "value > 3"},
                figures=["fig.png"],
                summary=f"value {value}",
            )

        return fn

    reg = {}
    for i in range(n):
        name = f"fake-{i}"
        reg[name] = Experiment(name=name, claim=f"claim {i}", source="test", run=make(name), config={"offset": i})
    return reg


def opts(out: Path, **kw) -> RunOptions:
    return RunOptions(out=out, progress=False, device="cpu", **kw)


# ---- a fake experiment with a pre-registered second stage (stages.py) ------------------------------------------
TASK_CALLS: list[int] = []  # the model seeds echo_task ran for (jobs=1: in this process)


def echo_task(*, seed: int, value: float | None) -> dict:
    """A stand-in for a training run: returns the value planted for its model seed."""
    TASK_CALLS.append(seed)
    return {"value": value}


def make_staged(
    values: list[float | None],
    calls: list[int],
    *,
    second_stage: int = 3,
    first: int = 3,
    role: str = "claim",
    own_seeds: bool = True,
    name: str = "staged",
) -> Experiment:
    """An experiment whose rule ("x" > 0.5, of ``role``, beside a claim that always holds when ``role`` is a
    control) is judged on ``values[k]`` for model seed k of the lab seed; ``calls`` gets each call's
    ``ctx.extra_seeds``. ``own_seeds=False``: it takes its seeds without ``ctx.model_seeds`` (a bug the runner
    must catch)."""
    from addnorm.lab.evidence import Rule, evidence, judge_evidence, units
    from addnorm.lab.seeds import STRIDE, model_seeds

    rules = [Rule(name="x", statistic="planted value", op=">", threshold=0.5, role=role)]
    if role != "claim":
        rules.append(Rule(name="holds", statistic="1", op=">", threshold=0.5))

    def fn(ctx: Context) -> Result:
        calls.append(ctx.extra_seeds)
        seeds = ctx.model_seeds(first) if own_seeds else model_seeds(ctx.seed, first)
        got = ctx.map(echo_task, [{"seed": s, "value": values[s % STRIDE]} for s in seeds])
        unit_map = {"x": units([g["value"] for g in got], seeds, ctx.seed)}
        if role != "claim":
            unit_map["holds"] = units([1.0] * len(seeds), seeds, ctx.seed)
        ev = evidence(rules, unit_map)
        verdict, reason, _ = judge_evidence(ev)
        ctx.figure_path(f"fig{len(seeds)}.png").write_bytes(PNG)
        return Result(
            verdict=verdict,
            reason=reason,
            metrics={"seeds": seeds},
            figures=[f"fig{len(seeds)}.png"],
            evidence=ev,
        )

    return Experiment(
        name=name, claim="planted", source="test", run=fn, config={"values": values}, second_stage=second_stage
    )
