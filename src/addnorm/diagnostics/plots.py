"""Plots of a :class:`~addnorm.diagnostics.Monitor` history: a steps x layers heatmap and per-layer curves.

Both take ``history`` (a list of records, e.g. ``mon.history`` or the lines of a JSONL log), draw with matplotlib's
object API (no pyplot state, no display needed), save to ``path`` when given, and return the Figure.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from addnorm.diagnostics.monitor import layer_series

__all__ = ["plot_layer_heatmap", "plot_layer_curves", "load_jsonl"]


def _matplotlib():
    try:
        from matplotlib.colors import LogNorm, Normalize
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("addnorm.diagnostics.plots needs matplotlib: pip install 'addnorm[plots]'") from e
    return Figure, LogNorm, Normalize


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a Monitor JSONL log back into a history list."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _matrix(history: Sequence[dict], key: str) -> tuple[list[int], list[list[float]]]:
    if not history:
        raise ValueError("history is empty: nothing to plot")
    steps, rows = layer_series(history, key)
    n = max(len(r) for r in rows)
    # Missing or non-finite values become NaN, which matplotlib leaves blank.
    grid = [
        [float(v) if v is not None and math.isfinite(v) else math.nan for v in r] + [math.nan] * (n - len(r))
        for r in rows
    ]
    if all(math.isnan(v) for r in grid for v in r):
        raise ValueError(f"key={key!r}: no layer has a value for it in this history")
    return steps, grid


def plot_layer_heatmap(
    history: Sequence[dict],
    key: str = "grad_norm",
    path: str | os.PathLike | None = None,
    *,
    log: bool = True,
    title: str | None = None,
):
    """Heatmap of ``record["layers"][i][key]``: layers on the y axis (first layer at the bottom), records on x,
    log colour scale (values <= 0 are left blank on it). Returns the matplotlib Figure."""
    Figure, LogNorm, Normalize = _matplotlib()
    steps, grid = _matrix(history, key)
    layers = list(zip(*grid))  # layers x records
    positive = [v for r in grid for v in r if v > 0]
    if log and positive:
        norm = LogNorm(vmin=min(positive), vmax=max(positive))
        layers = [[v if v > 0 else math.nan for v in row] for row in layers]
    else:
        finite = [v for r in grid for v in r if not math.isnan(v)]
        norm = Normalize(vmin=min(finite), vmax=max(finite))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    x0, x1 = steps[0], steps[-1] if len(steps) > 1 else steps[0] + 1
    image = ax.imshow(
        layers,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        norm=norm,
        cmap="viridis",
        extent=(x0, x1, -0.5, len(layers) - 0.5),
    )
    fig.colorbar(image, ax=ax, label=key + (" (log scale)" if log else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title(title or f"{key} per layer")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_layer_curves(
    history: Sequence[dict],
    key: str = "residual_rms",
    path: str | os.PathLike | None = None,
    *,
    layers: Sequence[int] | None = None,
    log: bool = True,
    title: str | None = None,
):
    """One line per layer of ``key`` against the step (log y axis by default). Returns the matplotlib Figure."""
    Figure, _, _ = _matplotlib()
    steps, grid = _matrix(history, key)
    n = len(grid[0])
    chosen = list(range(n)) if layers is None else list(layers)
    for i in chosen:
        if not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"layers: {i!r} is not a layer index in [0, {n})")
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    cmap = __import__("matplotlib").colormaps["viridis"]
    for j, i in enumerate(chosen):
        ax.plot(steps, [row[i] for row in grid], color=cmap(j / max(len(chosen) - 1, 1)), label=f"layer {i}")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or f"{key} per layer")
    if len(chosen) <= 12:
        ax.legend(fontsize="small", ncols=2)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
