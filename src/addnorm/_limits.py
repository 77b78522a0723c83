"""A time limit on a block of Python code, by an interval timer's signal (shared by the doctor and the survey)."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

# The longest interval timer every platform takes: setitimer overflowed (OverflowError) between 2**31 and 1e10 s
# here. 1e8 s is three years: any longer limit is no limit, and is capped to this.
MAX_SECONDS = 1e8


def check_seconds(seconds: float, flag: str, *, minimum: float = 0.0) -> float:
    """A time limit from the command line: 0 (no limit) or a finite number of seconds in [minimum, MAX_SECONDS];
    a ValueError naming ``flag`` otherwise (nan and inf included: 0 is how to ask for no limit)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        raise ValueError(f"{flag} must be a finite number of seconds (0: no limit), got {seconds!r}")
    if seconds < 0:
        raise ValueError(f"{flag} must be >= 0 (0: no limit), got {seconds:g}")
    if seconds and seconds < minimum:
        raise ValueError(f"{flag} must be 0 (no limit) or at least {minimum:g} s, got {seconds:g}")
    if seconds > MAX_SECONDS:
        raise ValueError(f"{flag} must be at most {MAX_SECONDS:g} s (0: no limit), got {seconds:g}")
    return float(seconds)


@contextlib.contextmanager
def time_limit(seconds: float | None, on_expiry: Callable[[], NoReturn], *, cpu_time: bool = False) -> Iterator[None]:
    """Call ``on_expiry`` (it raises) once ``seconds`` of wall time (SIGALRM) or, with ``cpu_time``, of this
    process's CPU time (SIGPROF) have passed inside the block; 0 or None: no limit. A signal interrupts Python code
    and sleeps, while a single long C call (one huge matmul) finishes first. Without interval timers, or outside
    the main thread (where no signal handler can be set), the block runs without a limit. A limit beyond
    ``MAX_SECONDS`` is capped to it (longer is no limit, and the timer would overflow); nan is a ValueError."""
    if seconds is not None and math.isnan(seconds):
        raise ValueError("time limit: nan seconds")
    name, timer = ("SIGPROF", "ITIMER_PROF") if cpu_time else ("SIGALRM", "ITIMER_REAL")
    usable = hasattr(signal, "setitimer") and hasattr(signal, name)
    if not seconds or not usable or threading.current_thread() is not threading.main_thread():
        yield
        return
    sig, which = getattr(signal, name), getattr(signal, timer)
    previous = signal.signal(sig, lambda signum, frame: on_expiry())
    signal.setitimer(which, min(seconds, MAX_SECONDS))
    try:
        yield
    finally:
        signal.setitimer(which, 0)
        signal.signal(sig, previous)
