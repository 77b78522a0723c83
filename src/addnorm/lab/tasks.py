"""One ``ctx.map`` task as the executor (executor.py) runs it: with the globals a fresh worker process has, its
result as JSON text, in this process or in a worker, and cached in a file of its own for resuming.

Task cache: ``DIR/<hash>.json`` per finished task (written atomically, as soon as it finishes), keyed by the task
function's module and qualname, its keyword arguments and a *salt* the caller gives (the runner passes the
experiment's cache key, which covers the code version, sizes, seed and device). A file that is unreadable or of
the wrong shape is a cache miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from addnorm.io import atomic_write_text, json_default


def task_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


# ------------------------------------------------------------------------------------ running one task
_SEED = 0


@contextlib.contextmanager
def _isolated_globals():
    """What a fresh worker process has, for a task run here too: one torch thread, global RNGs seeded to 0, the
    float32 default dtype, gradients on; the caller's threads, RNG states and dtype afterwards.

    A task should seed its own generators; this makes one that forgets deterministic anyway, and the same in a
    worker as here (where it must not change what the driver draws next, nor see the driver's no_grad)."""
    np = sys.modules.get("numpy")
    saved = save_globals()
    threads = torch.get_num_threads()
    try:
        if threads != 1:
            torch.set_num_threads(1)
        torch.manual_seed(_SEED)
        random.seed(_SEED)
        if np is not None:
            np.random.seed(_SEED)
        torch.set_default_dtype(torch.float32)
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        restore_globals(saved)


def save_globals() -> tuple:
    np = sys.modules.get("numpy")
    return (
        torch.random.get_rng_state(),
        random.getstate(),
        np.random.get_state() if np is not None else None,
        torch.get_default_dtype(),
    )


def restore_globals(saved: tuple) -> None:
    torch_state, py_state, np_state, dtype = saved
    torch.random.set_rng_state(torch_state)
    random.setstate(py_state)
    if np_state is not None:
        sys.modules["numpy"].random.set_state(np_state)
    torch.set_default_dtype(dtype)


def run_task(fn: Callable[..., Any], task: dict[str, Any]) -> str:
    """``fn(**task)`` under :func:`_isolated_globals`, as JSON text (non-finite floats allowed)."""
    with _isolated_globals():
        result = fn(**task)
    try:
        return json.dumps(result, allow_nan=True, default=json_default)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"task {task_name(fn)} returned data that is not JSON-serializable ({err}); ctx.map tasks "
            "must return dicts, lists, numbers, strings or None"
        ) from None


# What torchrun tells its ranks. A worker inherits them from its rank, and addnorm.train's loop would then join the
# rank's process group and train data-parallel, averaging its gradients with whatever task the other ranks run.
_LAUNCHER_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def single_process_environment() -> None:
    """Make this process a single one as far as torch.distributed and addnorm.train can tell: a task is a pure
    function of its arguments, the same on a torchrun rank's worker as in a plain run."""
    for name in list(os.environ):
        if name in _LAUNCHER_VARIABLES or name.startswith("TORCHELASTIC_"):
            del os.environ[name]


def init_worker(lifeline: Any) -> None:
    # Ctrl-C reaches the whole process group, and so does the SIGTERM of `timeout` or a scheduler: the parent
    # decides (it stops the pool, killing its workers); a worker must neither print a KeyboardInterrupt traceback
    # for every task it was running nor die first, which would record its tasks as failed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    single_process_environment()
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set (a reused process): harmless
        torch.set_num_interop_threads(1)
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True, name="addnorm-lab-lifeline").start()


def _exit_with_parent(lifeline: Any) -> None:
    """End this worker when the lab's process is gone (SIGKILL, os._exit, out of memory): its end of the pipe
    closes with it. An orphaned worker would wait for tasks forever, holding the terminal's pipes open (and a
    pid check is fooled by the parent's zombie until someone reaps it)."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            lifeline.recv()
    os._exit(1)


# ------------------------------------------------------------------------------------------- task cache
def _key_default(obj: Any) -> Any:
    if isinstance(obj, (torch.device, torch.dtype)):
        return str(obj)
    return json_default(obj)


class TaskCache:
    """Finished tasks' results, one JSON file each under ``directory`` (None: no cache). With ``read=False``
    (``--fresh``) finished tasks are stored but none is reused."""

    def __init__(self, directory: Path | None, *, read: bool = True) -> None:
        self.directory = None if directory is None else Path(directory)
        self.read = read

    def key(self, salt: str, fn: Callable[..., Any], task: dict[str, Any]) -> str:
        try:
            blob = json.dumps({"fn": task_name(fn), "task": task, "salt": salt}, sort_keys=True, default=_key_default)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"ctx.map task arguments of {task_name(fn)} must be JSON-like values (numbers, strings, "
                f"lists, dicts) so a finished task can be found again: {err}"
            ) from None
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.json"

    def load(self, key: str) -> tuple[bool, Any]:
        """(True, result) for a readable record of ``key``; (False, None) for anything else."""
        path = self.path(key)
        if path is None or not self.read:
            return False, None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False, None
        if not isinstance(record, dict) or record.get("key") != key or "result" not in record:
            return False, None
        return True, record["result"]

    def store(self, key: str, fn: Callable[..., Any], text: str) -> None:
        path = self.path(key)
        if path is not None:
            atomic_write_text(path, f'{{"key": "{key}", "fn": {json.dumps(task_name(fn))}, "result": {text}}}\n')
