"""Parallel sweeps (``--jobs``): a simulation process killed from outside (SIGKILL, as the kernel's
OOM killer does) ends the sweep with a clear error instead of leaving it waiting for the lost task
forever (multiprocessing.Pool replaced the worker and never returned its result)."""
import os
import signal
import time

import pytest

from cpd.sim import sweep


def _job(x: int) -> int:
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return x * 10


def test_a_killed_simulation_process_is_an_error_not_a_hang():
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="simulation process died"):
        list(sweep._imap(_job, [1, 2, 3, 4], 2))
    assert time.monotonic() - t < 30
    assert list(sweep._imap(_job, [1, 3, 4], 2)) == [10, 30, 40]  # results in work order
