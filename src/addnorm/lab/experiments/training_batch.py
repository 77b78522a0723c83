"""How the training experiments hand their runs to the executor: :func:`train_runs`, in place of
``ctx.map(train_task, tasks)``, under the run's engine (``ctx.engine``, ``addnorm lab --engine``).

``sequential`` (the default) is exactly ``ctx.map(train_task, tasks)``: one model per task, trained by
:func:`addnorm.train.loop.train`, bitwise the same for any ``--jobs``, cached or not. The recorded results
(docs/lab-results.md) use it.

``batched`` puts the runs that can share one stacked computation into groups and trains each group as one task,
:func:`train_group_task`, with :func:`addnorm.train.batched.train_batched` (2-2.9x the throughput per model on a
CPU thread at the lab's sizes, ``benchmarks/results/batched_train.md``). A group's members have one model config
that :class:`addnorm.train.stacked.StackedLM` covers, one language (vocabulary and seed) and equal values of the
TrainConfig fields batched members must share (:data:`addnorm.train.batched.SHARED_FIELDS`); seeds, learning
rates, warmups, schedules, decay, clipping and z-loss may differ. Each member is initialised exactly as
:func:`train_task` initialises its run, and its dict has train_task's keys, with numbers equal to train_task's up
to float rounding (batched kernels sum in another order): a verdict at a criterion's boundary can differ.

A run trains alone (through :func:`train_task`) when batched training cannot do what it asks: a ``probe`` (it may
hook the model, which the stacked computation never calls), ``init_record`` (train()'s Monitor record has fields
the batched monitor does not keep, such as ``norm_input_rms``), a model config StackedLM does not cover (BatchNorm,
rotary positions, ...), a large output layer (:data:`MAX_LOGITS_PER_MEMBER`: there batching is slower), a
TrainConfig that writes logs or checkpoints, or no partner to batch with.
``hidden_probe``, ``layer_grads``, ``track_mean_logit`` and the monitor's max attention logit are batched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from addnorm.lab.core import Context
from addnorm.lab.experiments.training_setup import (
    BATCH,
    SEQ,
    VOCAB,
    build_run,
    hidden_stats,
    model_config,
    probe_batch,
    run_output,
    train_task,
)

__all__ = ["MAX_LOGITS_PER_MEMBER", "MAX_MEMBERS", "group_key", "plan", "train_group_task", "train_runs"]

# Members per group task. The batched speedup saturates near K = 6-7 (K = 21 is no faster per model than K = 7,
# benchmarks/results/batched_train.md), so larger groups are split into near-equal chunks of at most this many:
# nothing is lost per model, and an experiment of 2 x 9 runs still gives --jobs 2 four tasks to share.
MAX_MEMBERS = 8

# Batching pays where a step is mostly per-op overhead (the lab's d_model 32, vocabulary 32 models). A large output
# layer turns the step into memory-bound work on the logits instead, which stacking makes larger than the cache:
# measured on the 2-core machine (6 members, 2 layers, B 8, T 32, CPU time, 2 rounds, load ~10): a model vocabulary
# of 512 (131072 logits per member and step) 1.38-1.57x faster batched, 1024 0.97-1.09x, 4096 (z-loss) 0.66-0.81x.
# Runs with more logits per step than this train alone.
MAX_LOGITS_PER_MEMBER = 8 * 32 * 512

# The keywords of train_task a group member may carry (the rest make it train alone: see the module docstring).
_BATCHED_OPTIONS = {
    "model",
    "train",
    "lang_seed",
    "vocab",
    "curve_points",
    "hidden_probe",
    "layer_grads",
    "track_mean_logit",
    "init_record",
    "probe",
}


def group_key(task: dict[str, Any]) -> str | None:
    """What a task must share with the others of its group (a JSON string), or None when it must train alone."""
    from addnorm.train.batched import SHARED_FIELDS
    from addnorm.train.config import TrainConfig
    from addnorm.train.stacked import check_batchable

    if set(task) - _BATCHED_OPTIONS or task.get("probe") is not None or task.get("init_record"):
        return None
    model, train, vocab = task.get("model", {}), task.get("train", {}), task.get("vocab", VOCAB)
    try:  # anything that does not even build is left to train_task, whose error then names it
        config = model_config(**{"vocab_size": vocab, **model})
        check_batchable(config)
        cfg = TrainConfig(**{"batch_size": BATCH, "seq_len": SEQ, "eval_batches": 2, **train})
    except (TypeError, ValueError):
        return None
    if cfg.out_dir or cfg.resume or cfg.batch_size * cfg.seq_len * config.vocab_size > MAX_LOGITS_PER_MEMBER:
        return None
    shared = {name: getattr(cfg, name) for name in SHARED_FIELDS}
    key = {"model": model, "vocab": vocab, "lang_seed": task.get("lang_seed"), "shared": shared}
    try:
        return json.dumps(key, sort_keys=True)
    except (TypeError, ValueError):
        return None


def plan(
    tasks: Sequence[dict[str, Any]], max_members: int = MAX_MEMBERS, apart: frozenset[int] = frozenset()
) -> list[list[int]]:
    """The task indices of each unit of work: a group of >= 2 batchable tasks (split into near-equal chunks of at
    most ``max_members``), or a single task that trains alone. Units are ordered by their first task, members keep
    their task order. Tasks whose model seed is in ``apart`` (a second stage's) never share a group with the others,
    so the other tasks' groups are the same with or without them."""
    groups: dict[str, list[int]] = {}
    units: list[list[int]] = []
    for i, task in enumerate(tasks):
        key = group_key(task)
        if key is not None and task.get("train", {}).get("seed") in apart:
            key += " second stage"
        if key is None:
            units.append([i])
        elif key in groups:
            groups[key].append(i)
        else:
            groups[key] = [i]
            units.append(groups[key])  # the same list: later members land in it
    out: list[list[int]] = []
    for unit in units:
        chunks = -(-len(unit) // max_members)
        size, extra = divmod(len(unit), chunks)
        start = 0
        for c in range(chunks):  # near-equal chunks (9 -> 5 + 4, not 8 + 1)
            end = start + size + (c < extra)
            out.append(unit[start:end])
            start = end
    return out


def train_runs(ctx: Context, tasks: Sequence[dict[str, Any]]) -> list[dict]:
    """``ctx.map(train_task, tasks)`` under the sequential engine; under the batched one the same results (to float
    rounding) from the units of :func:`plan`, each one :func:`train_group_task`, in one ``ctx.map`` call (so the
    executor runs them in parallel), returned in task order."""
    tasks = list(tasks)
    if ctx.engine == "sequential":
        return ctx.map(train_task, tasks)
    units = plan(tasks, apart=frozenset(ctx.second_stage_seeds))
    outs = ctx.map(train_group_task, [{"tasks": [tasks[i] for i in unit]} for unit in units])
    results: list[Any] = [None] * len(tasks)
    for unit, out in zip(units, outs):
        for i, value in zip(unit, out):
            results[i] = value
    return results


def train_group_task(*, tasks: list[dict[str, Any]]) -> list[dict]:
    """The runs ``tasks`` (train_task keywords, one unit of :func:`plan`) trained as one batched computation: one
    dict per run in train_task's format (its numbers to float rounding), in order. A unit of one task is
    ``[train_task(**task)]``, bitwise the sequential result."""
    from addnorm.train.batched import train_batched

    if len(tasks) == 1:  # a run with no partner, or one that must train alone: exactly the sequential task
        return [train_task(**tasks[0])]
    keys = [group_key(t) for t in tasks]
    if keys[0] is None or len(set(keys)) != 1:
        raise ValueError("train_group_task needs tasks of one group (see training_batch.plan)")
    runs = [
        build_run(model=t.get("model", {}), train=t["train"], lang_seed=t["lang_seed"], vocab=t.get("vocab", VOCAB))
        for t in tasks
    ]
    cfgs, nets = [r[0] for r in runs], [r[1] for r in runs]
    data = runs[0][2]  # one language for the group: every member's CachedBatches are the same batches
    probes = [probe_batch(data, cfg) for cfg in cfgs]
    hidden_init = [hidden_stats(net, x) if t.get("hidden_probe") else None for t, net, x in zip(tasks, nets, probes)]
    mean_logits: list[list[float]] = [[] for _ in tasks]
    track = any(t.get("track_mean_logit") for t in tasks)

    def record(step: dict) -> None:
        for k, v in zip(step["active"], step["mean_logits"]):
            mean_logits[k].append(v)

    results = train_batched(nets, data, cfgs, callback=record if track else None)
    return [
        run_output(
            res,
            cfg,
            net,
            lang_seed=t["lang_seed"],
            vocab=t.get("vocab", VOCAB),
            curve_points=t.get("curve_points", 50),
            hidden=(h, x) if t.get("hidden_probe") else None,
            layer_grads=bool(t.get("layer_grads")),
            mean_logits=mean_logits[k] if t.get("track_mean_logit") else None,
        )
        for k, (t, res, cfg, net, h, x) in enumerate(zip(tasks, results, cfgs, nets, hidden_init, probes))
    ]
