"""addnorm._limits.time_limit: the doctor's wall-time and the survey's CPU-time limits share it."""

from __future__ import annotations

import threading
import time

import pytest

from addnorm._limits import time_limit


class Expired(Exception):
    pass


def _expire():
    raise Expired


@pytest.mark.parametrize("cpu_time", [False, True], ids=["wall", "cpu"])
def test_the_limit_interrupts_a_busy_loop_and_is_removed_after(cpu_time):
    t0 = time.process_time()
    with pytest.raises(Expired):
        with time_limit(0.05, _expire, cpu_time=cpu_time):
            while time.process_time() - t0 < 5:  # busy: both clocks advance
                pass
    assert time.process_time() - t0 < 2
    with time_limit(0.05, _expire, cpu_time=cpu_time):  # a block that ends in time: no signal left behind
        pass
    time.sleep(0.1)
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass


def test_no_limit_for_zero_and_outside_the_main_thread():
    with time_limit(0, _expire):
        time.sleep(0.02)
    errors = []

    def worker():
        try:
            with time_limit(0.01, _expire):
                time.sleep(0.05)
        except BaseException as e:  # noqa: BLE001 - the test reports any
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors == []
