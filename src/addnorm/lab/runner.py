"""Run lab experiments with a result cache, so a second run is instant and a killed run resumes where it stopped.

Layout of an output directory::

    OUT/runs/<name>-<key>/result.json   one finished experiment (written atomically, last; see cache.py)
    OUT/runs/<name>-<key>/*.png         its figures
    OUT/runs/tasks/<hash>.json          finished ctx.map tasks of an unfinished experiment (see tasks.py)
    OUT/results.json, report.md, index.html   the report over the selected experiments (see report.py)
    OUT/.lock                           held (flock) by the run that writes into OUT (see outdir.py)

A finished experiment is reused while its cache key matches (cache.py says what the key covers and which stored
records count). An experiment that raises is recorded as "inconclusive" with the error, and is not cached (so the
next run retries it; its finished tasks are); Ctrl-C (and SIGTERM, which raises a KeyboardInterrupt here),
KeyboardInterrupt and SystemExit are not caught: the run stops, keeping what finished. The outputs of ``--shard``
runs are combined by merge.py. An experiment that declares a second stage of model seeds runs twice when its first
stage leaves a rule undecided (stages.py).

Experiments run through the executor (``--jobs``, torchrun; see executor.py): their tasks on worker processes or
ranks, their drivers overlapped while they wait for tasks. The records, figures and report are the same for any
number of jobs or ranks. Under torchrun, rank 0 alone reads and writes OUT; the other ranks run the same drivers
with their figures in a temporary folder.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from addnorm.interrupt import sigterm_interrupts

# The writers live in addnorm.io (train's checkpoints use them too); re-exported here for existing callers.
from addnorm.io import atomic_write_json, atomic_write_text, strict_json  # noqa: F401
from addnorm.io import json_default as _json_default
from addnorm.lab import cache
from addnorm.lab.core import ENGINES, EXPERIMENTS, Context, Experiment, Result
from addnorm.lab.executor import Executor, default_jobs, init_group
from addnorm.lab.machine import run_meta
from addnorm.lab.outdir import out_lock, prepare_out_dir
from addnorm.lab.registry import record_fields
from addnorm.lab.stages import run_stages
from addnorm.train.distributed import DistInfo

# Experiments derive seeds such as seed * 1000 + repeat and hand them to numpy and torch generators.
SEED_LIMIT = 2**32
# --jobs beyond this many worker processes per core only waits on the CPU (each holds torch: ~200 MB); 100000 of
# them hung the machine instead of failing.
JOBS_PER_CORE = 4


# ----------------------------------------------------------------------------------------------- small utilities
def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 1 <= K <= N."""
    try:
        k_text, n_text = str(text).split("/")
        k, n = int(k_text), int(n_text)
    except ValueError:
        raise ValueError(f"shard must look like K/N (e.g. 2/3), got {text!r}") from None
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device (--device) must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda", "mps"):  # meta computes nothing; xla and the rest are untested here
        raise ValueError(f"device (--device) {device!r}: the lab runs on cpu, cuda (or mps where available)")
    if dev.type == "mps" and not (torch.backends.mps.is_available()):
        raise ValueError(f"device (--device) {device!r} was asked for but torch.backends.mps.is_available() is False")
    if dev.type == "cuda" and not torch.cuda.is_available():
        # fail before running anything, not once per experiment
        raise ValueError(f"device {device!r} was asked for but torch.cuda.is_available() is False")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def experiment_key(exp: Experiment, *, quick: bool, seed: int, device: torch.device, engine: str = "sequential") -> str:
    """The experiment's cache key (cache.py) under ``engine``. The sequential engine's is cache.cache_key itself (so
    existing caches stay valid); another engine's is that key hashed with the engine's name: a batched result is
    never served to a sequential run or the other way round, and its ctx.map tasks (salted with this key) neither."""
    if engine not in ENGINES:
        raise ValueError(f"engine (--engine) must be one of {', '.join(ENGINES)}, got {engine!r}")
    key = cache.cache_key(exp, quick=quick, seed=seed, device=device)
    if engine == "sequential":
        return key
    import hashlib

    return hashlib.sha256(f"{key}+engine={engine}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- selection
def load_experiments() -> dict[str, Experiment]:
    """Import every experiment module (registering them) and return the registry."""
    import addnorm.lab.experiments  # noqa: F401 - importing registers

    return EXPERIMENTS


RUN_SUITES = ("core", "all")  # --suite: the "core" experiments (the default run), or every experiment


def select(
    only: Sequence[str] | None = None,
    shard: tuple[int, int] | None = None,
    registry: dict[str, Experiment] | None = None,
    suite: str = "core",
) -> list[tuple[int, Experiment]]:
    """The experiments to run, as (position in the whole selection, experiment).

    ``suite`` "core" keeps the experiments of the core suite, "all" every one; ``only`` keeps the named ones,
    whatever their suite (unknown names raise ValueError listing the known ones); ``shard=(K, N)`` then
    keeps every N-th starting at the K-th, so the N shards partition the selection the same way on every machine.
    """
    registry = load_experiments() if registry is None else registry
    if suite not in RUN_SUITES:
        raise ValueError(f"suite (--suite) must be one of {', '.join(RUN_SUITES)}, got {suite!r}")
    if only:
        unknown = [n for n in only if n not in registry]
        if unknown:
            raise ValueError(f"unknown experiment(s) {unknown}; known: {', '.join(registry)}")
        wanted = set(only)
        chosen = [e for e in registry.values() if e.name in wanted]
    else:
        chosen = [e for e in registry.values() if suite == "all" or e.suite == "core"]
    indexed = list(enumerate(chosen))
    if shard is not None:
        k, n = shard
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"shard K/N needs 1 <= K <= N, got {k}/{n}")
        indexed = [(i, e) for i, e in indexed if i % n == k - 1]
        if not indexed:  # an empty run would replace OUT/results.json by an empty report
            raise ValueError(
                f"--shard {k}/{n} selects no experiment: the selection has {len(chosen)} (N must be at most that)"
            )
    return indexed


# ------------------------------------------------------------------------------------------------------- run
@dataclass(kw_only=True)
class RunOptions:
    """What ``addnorm lab`` was asked to do (one field per flag)."""

    out: Path = Path("addnorm-report")
    only: list[str] | None = None
    quick: bool = False
    seed: int = 0
    device: str = "auto"
    fresh: bool = False
    shard: tuple[int, int] | None = None
    progress: bool = True  # tqdm bar on stderr
    # torch intra-op threads for the run (None: leave torch's setting). The experiments' tensors are tiny, so on a
    # busy machine one thread is often several times faster than threads that wait on each other.
    threads: int | None = None
    # Worker processes for the experiments' tasks (None: this machine's cores, shared by torchrun ranks on it;
    # 1: in this process). Results are the same for any value.
    jobs: int | None = None
    # "core" (the default run) or "all" (every experiment); ignored for the experiments named by ``only``.
    suite: str = "core"
    # How training runs train (core.ENGINES): "sequential" (the default, bitwise reproducible; the recorded results
    # use it) or "batched" (faster; equal to the sequential numbers up to float rounding).
    engine: str = "sequential"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine (--engine) must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.suite not in RUN_SUITES:
            raise ValueError(f"suite (--suite) must be one of {', '.join(RUN_SUITES)}, got {self.suite!r}")
        if not str(self.out).strip():  # Path("") is ".": the report would land in the current folder
            raise ValueError("--out is empty: give a directory path ('.' for the current folder)")
        self.out = Path(self.out)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < SEED_LIMIT:  # numpy's generators refuse negative seeds; torch's overflow at 2**64
            raise ValueError(f"seed (--seed) must be in [0, 2**32), got {self.seed}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(
                f"threads (--threads) must be an int >= 1 (or 0 on the command line, None here, to keep torch's "
                f"setting), got {self.threads!r}"
            )
        cores = os.cpu_count() or 1
        if self.threads is not None and self.threads > cores:  # 100000 threads crashed the OpenMP runtime
            raise ValueError(
                f"threads (--threads) {self.threads} is more than the {cores} CPU core(s) of this machine: "
                f"give at most {cores}"
            )
        if self.jobs is not None and (not isinstance(self.jobs, int) or isinstance(self.jobs, bool) or self.jobs < 1):
            raise ValueError(f"jobs (--jobs) must be an int >= 1, got {self.jobs!r}")
        if self.jobs is not None and self.jobs > JOBS_PER_CORE * cores:  # 100000 workers hung the machine
            raise ValueError(
                f"jobs (--jobs) {self.jobs} is more than {JOBS_PER_CORE} worker processes per CPU core of this "
                f"machine ({cores} core(s)): give at most {JOBS_PER_CORE * cores}"
            )


@dataclass(kw_only=True)
class RunSummary:
    records: list[dict]
    meta: dict[str, Any]
    ran: list[str] = field(default_factory=list)  # computed this time
    reused: list[str] = field(default_factory=list)  # taken from the cache
    failed: list[str] = field(default_factory=list)  # raised (recorded as inconclusive)


def _base_record(exp: Experiment, index: int, key: str) -> dict:
    return {
        "name": exp.name,
        "claim": exp.claim,
        "source": exp.source,
        "criterion": exp.criterion,
        "kind": exp.kind,
        "suite": exp.suite,
        "precondition": exp.precondition,
        "config": exp.config,
        "index": index,
        "key": key,
        **record_fields(exp),  # the code identity and pre-registration the seed record and report read
    }


def run_one(
    exp: Experiment,
    *,
    index: int,
    out: Path,
    quick: bool,
    seed: int,
    device: torch.device,
    progress: Callable[[str], None] = lambda message: None,
    mapper: Callable[..., list] | None = None,
    engine: str = "sequential",
) -> dict:
    """Run ``exp`` and store its record (atomically) unless it raised. Returns the record. ``mapper`` runs its
    ``ctx.map`` tasks (the executor's; serial in this process when None); ``engine`` how its training runs train
    (core.ENGINES, part of the cache key)."""
    key = experiment_key(exp, quick=quick, seed=seed, device=device, engine=engine)
    d = cache.run_dir(out, exp.name, key)
    if d.exists():  # stale figures from a killed or failed attempt must not leak into this one
        shutil.rmtree(d)
    record = _base_record(exp, index, key)
    ctx = Context(
        quick=quick, seed=seed, device=device, figure_dir=d, progress=progress, config=dict(exp.config), engine=engine
    )
    if mapper is not None:
        ctx.mapper = mapper
    start = time.perf_counter()
    try:  # once, or twice when a declared second stage is needed (stages.py)
        call = functools.partial(_checked_run, exp, d)
        result, stages = run_stages(exp, ctx, call, between=lambda: shutil.rmtree(d, ignore_errors=True))
    except Exception as err:  # noqa: BLE001 - any failure of one experiment is recorded, the run goes on
        record.update(
            verdict="inconclusive",
            metrics={},
            figures=[],
            summary=f"error: {type(err).__name__}: {err}",
            error=f"{type(err).__name__}: {err}",
            traceback=traceback.format_exc(limit=8),
            seconds=round(time.perf_counter() - start, 3),
            cached=False,
        )
        return record
    if stages is not None:
        record["stages"] = stages
    record.update(
        verdict=result.verdict,
        metrics=result.metrics,
        figures=[f"runs/{d.name}/{f}" for f in result.figures],
        summary=result.summary,
        reason=result.reason,
        timings=result.timings,
        evidence=result.evidence,
        seconds=round(time.perf_counter() - start, 3),
    )
    atomic_write_json(d / cache.RECORD_FILE, record)  # last: its presence means "complete"
    return dict(record, cached=False)


def _checked_run(exp: Experiment, d: Path, ctx: Context) -> Result:
    """``exp.run(ctx)`` from the seeded global RNG, its Result checked (figures written, JSON-able numbers)."""
    torch.manual_seed(ctx.seed)
    result = exp.run(ctx)
    if not isinstance(result, Result):
        raise TypeError(f"experiment {exp.name!r} must return a Result, got {type(result).__name__}")
    missing = [f for f in result.figures if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(f"experiment {exp.name!r} listed figures it did not write: {missing}")
    if not isinstance(result.metrics, dict) or not isinstance(result.timings, dict):
        raise TypeError(f"experiment {exp.name!r}: Result.metrics and Result.timings must be dicts")
    json.dumps([result.metrics, result.timings, result.evidence], default=_json_default)  # fail here, not in the report
    return result


def run(options: RunOptions, registry: dict[str, Experiment] | None = None) -> RunSummary:
    """Run (or reuse) the selected experiments, then write the report into ``options.out``.

    Under torchrun every rank calls this; rank 0 returns the summary of what it wrote, the others the same
    records (their figures were in a temporary folder, gone when this returns). SIGTERM stops it as Ctrl-C does
    (interrupt.py)."""
    device = resolve_device(options.device)
    chosen = select(options.only, options.shard, registry, options.suite)
    group = init_group()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(sigterm_interrupts())
            error, out = None, None
            if group.is_main:
                try:
                    out = prepare_out_dir(options.out)
                    stack.enter_context(out_lock(out))
                except ValueError as err:
                    error = str(err)
            error = group.broadcast(error)  # every rank stops, not only rank 0
            if error is not None:
                raise ValueError(error)
            if not group.is_main:
                out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="addnorm-lab-rank")))
            if options.threads is not None:
                threads_before = torch.get_num_threads()
                torch.set_num_threads(options.threads)
                stack.callback(torch.set_num_threads, threads_before)
            return _run_selected(options, chosen, device, out, group)
    finally:
        group.close()


class Progress:
    """The tqdm bar: experiments done out of selected; the postfix names the running experiments with their last
    progress message, and counts tasks. It never shows a finished experiment's verdict (next to another one's
    name, it read as that one's): verdicts are in the table at the end."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="exp", desc="addnorm lab", dynamic_ncols=True)
        self._lock = threading.Lock()
        self.running: dict[str, str] = {}
        self.tasks = (0, 0)

    def postfix(self) -> str:
        names = "; ".join(f"{n}: {m}" if m else n for n, m in self.running.items())
        done, total = self.tasks
        return names + (f" | tasks {done}/{total}" if total else "")

    def _show(self, refresh: bool = True) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix(), refresh=refresh)

    def start(self, name: str) -> None:
        with self._lock:
            self.running[name] = ""
            self._show()

    def message(self, name: str, text: str) -> None:
        with self._lock:
            if name in self.running:
                self.running[name] = str(text)
                self._show()

    def count_tasks(self, done: int, total: int) -> None:
        with self._lock:
            self.tasks = (done, total)
            self._show()

    def finish(self, name: str | None = None, n: int = 1) -> None:
        with self._lock:
            self.running.pop(name, None)
            self._show(refresh=False)
            if self.bar is not None:
                self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _drive(exp: Experiment, index: int, progress: Progress, executor: Executor, key: str, **run_kw: Any) -> dict:
    progress.start(exp.name)
    return run_one(
        exp, index=index, progress=functools.partial(progress.message, exp.name), mapper=executor.mapper(key), **run_kw
    )


def _run_selected(
    options: RunOptions, chosen: list[tuple[int, Experiment]], device: torch.device, out: Path, group: DistInfo
) -> RunSummary:
    from addnorm.lab.report import write_report

    jobs = options.jobs or default_jobs()
    summary = RunSummary(records=[], meta=run_meta(options, device, jobs=jobs, world_size=group.world_size))
    start = time.perf_counter()
    keys = {
        exp.name: experiment_key(exp, quick=options.quick, seed=options.seed, device=device, engine=options.engine)
        for _, exp in chosen
    }
    cached: dict[str, dict] = {}
    if group.is_main and not options.fresh:
        for index, exp in chosen:
            record = cache.load_cached(out, exp, keys[exp.name])
            if record is not None:
                # the suite is where the experiment is listed now, not part of what it computed
                cached[exp.name] = dict(record, index=index, cached=True, suite=exp.suite)
    cached = group.broadcast(cached)  # all ranks skip the same experiments (their collectives stay in step)
    todo = [(index, exp) for index, exp in chosen if exp.name not in cached]
    records = {index: cached[exp.name] for index, exp in chosen if exp.name in cached}

    progress = Progress(options.progress and group.is_main, total=len(chosen))
    progress.finish(n=len(cached))
    run_kw = dict(out=out, quick=options.quick, seed=options.seed, device=device, engine=options.engine)
    try:
        with Executor(
            jobs,
            cache_dir=out / "runs" / cache.TASKS_DIR,
            read_cache=not options.fresh,
            group=group,
            on_tasks=progress.count_tasks,
        ) as executor:

            def finished(j: int, record: dict) -> None:
                index, exp = todo[j]
                records[index] = record
                if "error" not in record:  # the record now holds what its tasks were for
                    executor.forget(keys[exp.name])
                progress.finish(exp.name)

            calls = [
                functools.partial(_drive, exp, index, progress, executor, keys[exp.name], **run_kw)
                for index, exp in todo
            ]
            if todo:
                executor.warm_up()
            executor.run_concurrently(calls, finished)
    finally:
        progress.close()
    summary.records = [records[index] for index, _ in chosen]
    for r in summary.records:
        (summary.reused if r.get("cached") else summary.failed if "error" in r else summary.ran).append(r["name"])
    summary.meta["seconds"] = round(time.perf_counter() - start, 1)  # this run's wall time, cache hits included
    # what computing these results took, when they were computed (all cached: this run itself took ~0 s)
    summary.meta["computed_seconds"] = round(sum(r.get("seconds") or 0.0 for r in summary.records), 1)
    summary.meta["cached"] = len(summary.reused)
    if group.is_main:
        write_report(out, summary.records, summary.meta)
    return summary
