"""A time limit on a block of Python code, by an interval timer's signal (shared by the doctor and the survey)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn


@contextlib.contextmanager
def time_limit(seconds: float | None, on_expiry: Callable[[], NoReturn], *, cpu_time: bool = False) -> Iterator[None]:
    """Call ``on_expiry`` (it raises) once ``seconds`` of wall time (SIGALRM) or, with ``cpu_time``, of this
    process's CPU time (SIGPROF) have passed inside the block; 0 or None: no limit. A signal interrupts Python code
    and sleeps, while a single long C call (one huge matmul) finishes first. Without interval timers, or outside
    the main thread (where no signal handler can be set), the block runs without a limit."""
    name, timer = ("SIGPROF", "ITIMER_PROF") if cpu_time else ("SIGALRM", "ITIMER_REAL")
    usable = hasattr(signal, "setitimer") and hasattr(signal, name)
    if not seconds or not usable or threading.current_thread() is not threading.main_thread():
        yield
        return
    sig, which = getattr(signal, name), getattr(signal, timer)
    previous = signal.signal(sig, lambda signum, frame: on_expiry())
    signal.setitimer(which, seconds)
    try:
        yield
    finally:
        signal.setitimer(which, 0)
        signal.signal(sig, previous)
