"""Run ``ctx.map(fn, tasks)`` on worker processes or torchrun ranks, with a per-task cache for resuming.

This module knows nothing of experiments. It gives the runner three things:

* :meth:`Executor.mapper` -- the ``Context.mapper`` of one experiment: ``fn(**task)`` for every task, results in
  task order. ``jobs == 1`` runs them here, in order (not under torchrun, below); ``jobs > 1`` on a pool of worker
  processes (forkserver, or spawn where there is none: torch and OpenMP after a plain fork can hang). Every task runs with one torch thread,
  with the global RNGs (torch, numpy, random) seeded to 0 and the caller's states restored afterwards, and its
  result goes through JSON on every path, so the results are bitwise identical for any ``jobs``, cached or not.
* :meth:`Executor.run_concurrently` -- several callables (the experiments' drivers) at once, on threads of this
  process, so that one experiment with few tasks does not leave the pool idle. Only one driver runs Python at a
  time (it holds the *baton*); a driver hands the baton on while it waits for its tasks, and the global RNG
  states and default dtype are saved and restored around that wait, so each driver sees the same state as if it
  had run alone. The results therefore do not depend on how the drivers interleave, provided a driver keeps no
  other process-wide state across a ``ctx.map`` call (module globals it mutates, pyplot's *current* figure: use
  the ``fig`` that ``plt.subplots`` returns).
* torchrun: with ``WORLD_SIZE > 1`` (:func:`init_group`), every rank runs the same drivers in the same order;
  each ``ctx.map`` gives rank ``r`` the tasks ``r, r + W, ...`` of what is not cached, and ``all_gather_object``
  hands every rank all the results. Rank 0 alone reads and writes the task cache (other ranks may be on other
  machines, without the output folder). A task that raises on one rank raises on all of them, with its message,
  so the ranks' collectives stay in step. A rank runs its tasks on its worker pool even with ``jobs == 1``, and
  the workers forget torchrun's variables (tasks.single_process_environment): in the rank's own process, or with
  the variables, ``addnorm.train``'s loop would join the ranks' process group and train data-parallel, averaging
  its gradients with the other ranks' (different) tasks.

Worker processes are started with forkserver or spawn, which import the main module again: a script that calls
the runner with ``jobs > 1`` needs the usual ``if __name__ == "__main__":`` guard (``addnorm lab`` and
``python -m addnorm`` have it). Workers ignore SIGINT and SIGTERM (both reach the whole process group from a
terminal or ``timeout``): the lab's process stops them (SIGKILL) when it is interrupted, and they end when it dies,
however it dies.

How one task runs (its globals, its JSON result, a worker's start) and its cache file: tasks.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from addnorm.lab.tasks import TaskCache, init_worker, restore_globals, run_task, save_globals, task_name
from addnorm.train.distributed import DistInfo, current

# How many tasks per worker a torchrun round hands out before the ranks gather (and rank 0 caches) the results:
# small enough that a killed run keeps most finished tasks, large enough that ranks rarely wait on each other.
ROUND_TASKS_PER_WORKER = 4


def default_jobs() -> int:
    """Worker processes per rank when ``--jobs`` is not given: the CPUs this process may use, shared by the
    torchrun ranks on this machine."""
    if hasattr(os, "process_cpu_count"):  # 3.13+: respects the affinity mask
        cpus = os.process_cpu_count() or 1
    elif hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0)) or 1
    else:
        cpus = os.cpu_count() or 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cpus // max(1, local_world))


class TaskError(RuntimeError):
    """A task raised on a torchrun rank (the message carries its error and traceback)."""


class Cancelled(BaseException):
    """The executor was closed (Ctrl-C, another driver's interrupt) while a driver was using it. A BaseException,
    so an experiment's ``except Exception`` does not record it as the experiment's own failure."""


# ------------------------------------------------------------------------------------ handing out tasks
def _noop() -> None:
    """What :meth:`Executor.warm_up` submits: starting a worker is the point."""


def _check_picklable(fn: Callable[..., Any], task: dict[str, Any]) -> None:
    """Refuse what a worker process could not receive, with every ``--jobs`` (so jobs=1 cannot hide it)."""
    try:
        pickle.dumps((fn, task))
    except Exception as err:  # noqa: BLE001 - pickle raises many types
        raise TypeError(
            f"ctx.map needs a module-level function and picklable task arguments, so tasks can run in "
            f"worker processes; {task_name(fn)} with {sorted(task)}: {err}"
        ) from None


# ------------------------------------------------------------------------------------------------ torchrun
def init_group() -> DistInfo:
    """Join the torchrun ranks (``WORLD_SIZE > 1`` in the environment) over gloo: the lab exchanges Python objects
    between CPU processes, whatever device its experiments use. A single process is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return DistInfo()
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 (torchrun) but this torch build has no torch.distributed")
    if dist.is_initialized():
        return current()
    dist.init_process_group(backend="gloo")
    return dataclasses.replace(current(), initialized_here=True)


# ----------------------------------------------------------------------------------------------- executor
_MISSING = object()


class Executor:
    """Runs tasks for ``ctx.map`` (see the module docstring). Use as a context manager: it owns a process pool."""

    def __init__(
        self,
        jobs: int = 1,
        *,
        cache_dir: Path | None = None,
        read_cache: bool = True,
        group: DistInfo | None = None,
        on_tasks: Callable[[int, int], None] | None = None,
    ) -> None:
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
        self.jobs = jobs
        self.group = group or DistInfo()
        # Under torchrun a task never runs in the rank's own process, whose process group addnorm.train would join
        # (training data-parallel with another rank's task): always on workers, which are single processes.
        self.in_workers = jobs > 1 or self.group.enabled
        # Only rank 0 touches the cache (module docstring).
        self.cache = TaskCache(cache_dir if self.group.is_main else None, read=read_cache)
        self._on_tasks = on_tasks
        self._pool: cf.ProcessPoolExecutor | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._holder: object | None = None  # the driver that holds the baton (None: free, or no concurrency)
        self._waiting_for_baton = 0
        self._pending = 0  # tasks submitted to the pool and not finished
        self._used = False  # a task was submitted (not only warm_up's no-ops)
        self._lifeline: Any = None  # the write end of the pipe the workers watch
        self.tasks_done = 0
        self.tasks_total = 0
        self.cache_files: dict[str, list[Path]] = {}  # salt -> the cache files its tasks used
        self._saved_state: dict[int, tuple] = {}  # a waiting driver's RNG states and default dtype

    # -- lifecycle
    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)

    def close(self, cancel: bool = False) -> None:
        """Stop the pool; ``cancel`` kills running tasks (Ctrl-C) and makes waiting drivers raise Cancelled. A pool
        that was only warmed up is stopped without waiting for its start-up."""
        with self._cond:
            self._closed = True
            pool, self._pool = self._pool, None
            self._cond.notify_all()
        lifeline, self._lifeline = self._lifeline, None
        if pool is None:
            return
        try:
            self._stop(pool, cancel=cancel or not self._used)
        finally:
            if lifeline is not None:
                lifeline.close()

    @staticmethod
    def _stop(pool: cf.ProcessPoolExecutor, cancel: bool) -> None:
        if cancel:
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:  # no public way to stop running tasks before Python 3.14
                with contextlib.suppress(Exception):
                    p.kill()  # SIGKILL: the workers ignore SIGTERM (tasks.init_worker)
            for p in processes:
                with contextlib.suppress(Exception):
                    p.join(timeout=5)
        else:
            pool.shutdown(wait=True)

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        with self._cond:
            if self._closed:
                raise Cancelled()
            if self._pool is None:
                method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
                ctx = multiprocessing.get_context(method)
                if method == "forkserver":  # import torch once in the server, not once per worker
                    ctx.set_forkserver_preload(["torch", "addnorm.lab.executor"])
                # Only this process holds the write end: the workers see EOF when it dies (tasks._exit_with_parent).
                lifeline, self._lifeline = ctx.Pipe(duplex=False)
                self._pool = cf.ProcessPoolExecutor(
                    max_workers=self.jobs, mp_context=ctx, initializer=init_worker, initargs=(lifeline,)
                )
            return self._pool

    def warm_up(self) -> None:
        """Start the worker processes now, in the background (importing torch in them takes seconds), so they are
        ready when the first experiment hands out tasks. Nothing to do when tasks run here or the pool exists."""
        if self.in_workers and self._pool is None and not self._closed:
            pool = self._get_pool()
            for _ in range(self.jobs):
                pool.submit(_noop)

    def forget(self, salt: str) -> None:
        """Delete the cached tasks of ``salt`` (its experiment's record now holds what they were for)."""
        for path in self.cache_files.pop(salt, []):
            path.unlink(missing_ok=True)

    def _count(self, done: int = 0, total: int = 0) -> None:
        with self._cond:
            self.tasks_done += done
            self.tasks_total += total
            snapshot = (self.tasks_done, self.tasks_total)
        if self._on_tasks is not None:
            self._on_tasks(*snapshot)

    # -- the mapper
    def mapper(self, salt: str) -> Callable[[Callable[..., Any], Sequence[dict[str, Any]]], list[Any]]:
        """A ``Context.mapper`` whose task cache keys include ``salt``."""
        return lambda fn, tasks: self.map(fn, tasks, salt=salt)

    def map(self, fn: Callable[..., Any], tasks: Sequence[dict[str, Any]], *, salt: str = "") -> list[Any]:
        tasks = list(tasks)
        if self._closed:
            raise Cancelled()
        for task in tasks:
            _check_picklable(fn, task)
        keys = [self.cache.key(salt, fn, t) for t in tasks]
        files = self.cache_files.setdefault(salt, [])
        files += [p for p in map(self.cache.path, keys) if p is not None]
        results: list[Any] = [_MISSING] * len(tasks)
        if self.group.is_main:
            for i, key in enumerate(keys):
                hit, value = self.cache.load(key)
                if hit:
                    results[i] = value
        if self.group.enabled:  # the other ranks learn what rank 0 found in its cache
            cached = self.group.broadcast({i: r for i, r in enumerate(results) if r is not _MISSING})
            results = [cached.get(i, _MISSING) for i in range(len(tasks))]
        missing = [i for i, r in enumerate(results) if r is _MISSING]
        self._count(done=len(tasks) - len(missing), total=len(tasks))
        if not missing:
            return results
        if self.group.enabled:
            self._map_ranks(fn, tasks, keys, missing, results)
        else:

            def store(i: int, text: str) -> None:
                self.cache.store(keys[i], fn, text)
                results[i] = json.loads(text)

            self._compute(fn, tasks, missing, store)
        return results

    def _compute(
        self, fn: Callable[..., Any], tasks: list[dict[str, Any]], indices: list[int], done: Callable[[int, str], None]
    ) -> None:
        """Run ``tasks[i]`` for ``i`` in ``indices``; ``done(i, json_text)`` as each finishes. Raises the first
        task error (after cancelling this call's other tasks)."""
        if not self.in_workers:
            for i in indices:
                if self._closed:
                    raise Cancelled()
                done(i, run_task(fn, tasks[i]))
                self._count(done=1)
            return
        pool = self._get_pool()
        futures: dict[cf.Future, int] = {}
        failures: list[BaseException] = []  # a done() that failed (disk full while caching): raised below
        # wait() can return before a future's callbacks have run: count the callbacks that have not finished
        unsettled = [len(indices)]

        def settle(future: cf.Future) -> None:  # on the pool's thread, as each task ends
            try:
                if not future.cancelled() and future.exception() is None:
                    done(futures[future], future.result())
                    self._count(done=1)
            except Exception as err:  # noqa: BLE001 - raised in the driver, not lost in the pool's thread
                failures.append(err)
            finally:
                with self._cond:
                    self._pending -= 1
                    unsettled[0] -= 1
                    self._cond.notify_all()

        with self._cond:
            self._pending += len(indices)
            self._used = True
        try:
            for i in indices:
                future = pool.submit(run_task, fn, tasks[i])
                futures[future] = i
        except RuntimeError:  # the pool was shut down between _get_pool and submit (Ctrl-C)
            with self._cond:
                self._pending -= len(indices)
            for f in futures:
                f.cancel()
            raise Cancelled() from None
        for f in futures:  # after the loop: `settle` looks the future up in `futures`
            f.add_done_callback(settle)
        self._release_baton()
        try:
            cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        finally:
            self._take_baton()
        if self._closed:
            for f in futures:
                f.cancel()
            raise Cancelled()
        errors = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if errors:
            for f in futures:
                f.cancel()
            first = min(errors, key=futures.get).exception()
            if isinstance(first, BrokenProcessPool):
                with self._cond:  # a worker died (killed, out of memory): the next map gets a fresh pool
                    if self._pool is pool:
                        self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise first
        with self._cond:
            while unsettled[0] > 0:
                self._cond.wait()
        if failures:
            raise failures[0]

    def _map_ranks(
        self,
        fn: Callable[..., Any],
        tasks: list[dict[str, Any]],
        keys: list[str],
        missing: list[int],
        results: list[Any],
    ) -> None:
        """torchrun: in rounds, each rank computes its share of the missing tasks; everyone gets all results."""
        world, rank = self.group.world_size, self.group.rank
        per_round = world * self.jobs * ROUND_TASKS_PER_WORKER
        for start in range(0, len(missing), per_round):
            chunk = missing[start : start + per_round]
            mine: dict[int, tuple[str, str]] = {}
            error = None
            try:
                self._compute(fn, tasks, chunk[rank::world], lambda i, text: mine.__setitem__(i, ("ok", text)))  # noqa: B023 - called in this iteration
            except Exception as err:  # noqa: BLE001 - sent to every rank, so all raise together
                import traceback

                error = f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}"
            gathered = self.group.all_gather({"results": mine, "error": error})
            errors = [g["error"] for g in gathered if g["error"]]
            if errors:
                raise TaskError(errors[0])
            for part in gathered:
                for i, (_, text) in part["results"].items():
                    results[i] = json.loads(text)
                    self.cache.store(keys[i], fn, text)  # rank 0 only (others have no cache)
            self._count(done=len(chunk) - len(chunk[rank::world]))

    # -- concurrent drivers
    def _release_baton(self) -> Any:
        """Hand the baton on while this driver waits; returns what _take_baton needs to restore."""
        me = threading.get_ident()
        with self._cond:
            if self._holder != me:
                return
            self._saved_state[me] = save_globals()
            self._holder = None
            self._cond.notify_all()

    def _take_baton(self) -> None:
        me = threading.get_ident()
        with self._cond:
            saved = self._saved_state.pop(me, None)
            if saved is None:  # this driver did not hold the baton (no concurrency): nothing to take back
                return
            self._waiting_for_baton += 1
            while self._holder is not None:
                self._cond.wait()
            self._waiting_for_baton -= 1
            self._holder = me
        restore_globals(saved)

    def run_concurrently(
        self, calls: Sequence[Callable[[], Any]], on_done: Callable[[int, Any], None] = lambda i, r: None
    ) -> list[Any]:
        """``[call() for call in calls]``, overlapping calls while they wait for tasks (module docstring).

        A new call starts only when no driver holds the baton or waits for it, and the pool has fewer pending tasks
        than workers, so calls start in order and only when a core would otherwise idle. ``on_done(i, result)``
        runs on the main thread as each call finishes. An exception a call lets through (KeyboardInterrupt,
        SystemExit, a bug) stops the others (they raise Cancelled at their next task wait) and is raised here."""
        if self.jobs == 1 or self.group.enabled or len(calls) <= 1:
            results = []
            for i, call in enumerate(calls):
                results.append(call())
                on_done(i, results[-1])
            return results
        results: list[Any] = [_MISSING] * len(calls)
        finished: list[tuple[int, Any, BaseException | None]] = []
        threads: list[threading.Thread] = []

        def drive(i: int, call: Callable[[], Any]) -> None:
            outcome, error = None, None
            try:
                outcome = call()
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                error = err
            finally:
                with self._cond:
                    if self._holder == threading.get_ident():
                        self._holder = None
                    finished.append((i, outcome, error))
                    self._cond.notify_all()

        next_call, running, error = 0, 0, None
        try:
            while True:
                with self._cond:
                    while finished:
                        i, outcome, err = finished.pop(0)
                        running -= 1
                        if err is not None and error is None and not isinstance(err, Cancelled):
                            error = err
                        if err is None:
                            results[i] = outcome
                            on_done(i, outcome)
                    if error is not None:
                        break
                    idle = self._holder is None and self._waiting_for_baton == 0 and self._pending < self.jobs
                    if next_call < len(calls) and idle:
                        thread = threading.Thread(
                            target=drive,
                            args=(next_call, calls[next_call]),
                            daemon=True,
                            name=f"addnorm-lab-driver-{next_call}",
                        )
                        thread.start()
                        self._holder = thread.ident  # handed over before anyone else can take it
                        threads.append(thread)
                        next_call += 1
                        running += 1
                        continue
                    if next_call >= len(calls) and running == 0:
                        break
                    self._cond.wait(timeout=0.5)
        except BaseException:
            self.close(cancel=True)
            _join(threads)
            raise
        if error is not None:
            self.close(cancel=True)
            _join(threads)
            raise error
        return results


def _join(threads: list[threading.Thread], timeout: float = 10.0) -> None:
    """Wait (a bounded time) for drivers that were told to stop, so none keeps writing after the run returns."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
