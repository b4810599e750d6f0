"""A rank whose train step has not finished `--comm.timeout_seconds` after it began gives up: one line
on stderr and the exit code of a failed collective.

With gloo a collective that a dead peer never joins raises in the training thread. With NCCL it does
not: the training thread sits in a CUDA synchronisation, and at the process group's timeout NCCL's own
watchdog thread aborts the process (SIGABRT, exit -6, a C++ stack trace in the log). This watchdog
fires first on both, so a step ends the same way on GPUs as in the CPU tests: it counts from the start
of the step, before any of the step's collectives is issued, and the process groups wait `MARGIN_S`
longer (`group_timeout`). Outside a train step (start-up, checkpoints) the groups' own timeouts remain.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Iterator

from .errors import print_error

MARGIN_S = 30
"""How much longer a collective may wait than a step: time for this watchdog to see a step past its
deadline (it looks every `POLL_S`) and end the process before the collective's own timeout does."""
POLL_S = 0.5


def group_timeout(timeout_s: int) -> timedelta:
    """The timeout of a process group for a job whose steps time out after `timeout_s`."""
    return timedelta(seconds=timeout_s + MARGIN_S)


class StepWatchdog:
    """`with watchdog.step(n):` around a train step; past the deadline, `message(n)` and `exit_code`."""

    def __init__(self, timeout_s: float, message: Callable[[int], str], exit_code: int):
        self.timeout_s = timeout_s
        self.message = message
        self.exit_code = exit_code
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._step = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        with self._lock:
            self._deadline = time.monotonic() + self.timeout_s
            self._step = step
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                deadline, step = self._deadline, self._step
            if deadline is not None and time.monotonic() > deadline:
                print_error(self.message(step))
                # The training thread is blocked in a collective that will not complete: no clean-up
                # can run (it would wait on the same dead peer).
                os._exit(self.exit_code)
