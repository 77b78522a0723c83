"""SIGTERM stops a long command (``addnorm lab``, ``addnorm train``) the way Ctrl-C does.

``timeout``, batch schedulers and ``kill`` send SIGTERM, whose default action ends the process on the spot: no
``finally`` runs, so the worker pool is not stopped, the multiprocessing semaphores are never released (the
resource tracker then warns of "leaked semaphore objects") and the user is not told that a rerun resumes.
:func:`sigterm_interrupts` turns SIGTERM into :class:`Terminated`, a KeyboardInterrupt, so it takes Ctrl-C's path:
the lab's executor stops its workers, finished experiments and tasks stay in the cache (train keeps its checkpoint),
and the command prints its resume hint and exits with 128 + the signal's number (143), as a shell reports a
process ended by that signal. It lives beside the commands, not in the lab, because train imports nothing of the lab.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """The run was stopped by a signal other than Ctrl-C's; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` in the main thread, once: a second SIGTERM while the
    run cleans up is ignored, so the cleanup finishes (SIGKILL still ends it at once). Nothing changes off the main
    thread (where Python cannot set a handler) or where the caller has its own SIGTERM handler or ignores it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
