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
