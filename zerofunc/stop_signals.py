"""Signals to stop, taken as requests: the first SIGINT or SIGTERM, to the launcher or to a rank, only records
a stop request (`stop_signal`), which the caller acts on at a point of its choosing (the trainer: at a step's
end, train/preempt.py); the launcher forwards it to every rank as SIGTERM (zerofunc/launch.py). Copies of one
request arrive together (a terminal's Ctrl-C reaches the launcher and the ranks at once; torchrun forwards
the signal it gets), so only a signal more than `REPEAT_S` after the first counts as a second one, and that
one stops at once. A SIGTERM to the launcher's whole process group (GNU timeout, a scheduler) reaches the
ranks as well, but not the fork server they start from (zerofunc/fork_server.py).
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Optional

REPEAT_S = 1.0  # a signal this long after the first is a second request: stop at once


class StopRequests:
    """Signals to stop: the first is a request (`arrive` says True), one more at least
    `REPEAT_S` later a demand to stop at once (KeyboardInterrupt), copies in between nothing."""

    def __init__(self):
        self.signal: Optional[str] = None
        self._first = 0.0

    def arrive(self, signum) -> bool:
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._first = signal.Signals(signum).name, now
            return True
        if now - self._first > REPEAT_S:
            raise KeyboardInterrupt
        return False


_requests = StopRequests()  # this process's


def stop_signal() -> Optional[str]:
    """The name of the signal that asked this process to stop (SIGTERM, SIGINT), or None."""
    return _requests.signal


def _on_signal(signum, frame) -> None:
    _requests.arrive(signum)


def catch_stop_signals() -> None:
    """Let SIGINT and SIGTERM record a stop request (see the module's docstring)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _on_signal)
