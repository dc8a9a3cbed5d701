"""Where the launcher's ranks start from: a fork server that imported torch and the engine once.

A rank forks from it in a fraction of a second instead of importing them anew, about 2 s of CPU
each: a world of 4 on 2 cores started in 4 s. The server only imports: it never initializes CUDA or
starts a thread pool, which is what makes forking from it safe (PyTorch's multiprocessing notes: CUDA
needs spawn or forkserver). Where the platform has no fork server, spawn.
"""
from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import threading
from multiprocessing import reduction

import torch.multiprocessing as mp

# What the server imports once, before any rank starts. torch._dynamo too: every rank imports it (a
# model built on the meta device draws its init through torch._refs, which imports it), 2.7 s of CPU a
# rank here, which was most of a small run's time.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zerofunc.engine", "zerofunc.step"]


def start_method() -> mp.context.BaseContext:
    """The context ranks start from, its fork server running (where there is one, see `_start_server`)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    _start_server()
    return ctx


def _start_server() -> None:
    """Start the server, if it is not running, with SIGTERM ignored (Python's server ignores SIGINT
    itself; an ignored signal stays ignored across exec).

    A SIGTERM to the whole process group (GNU timeout, a batch scheduler cancelling a job) reaches the
    server with the launcher and the ranks. Killed by it, the server takes with it the channel the
    launcher reads the ranks' exit codes from: the launcher reads 255 for every rank, says one died,
    and exits, while the ranks, which took the SIGTERM as a request to stop at their next step, run on
    without it. On the seventh GPU run a rank in a long compile so outlived its launcher, and held the
    job's output open until the device call's own limit. The ranks set their handlers themselves
    (launch.catch_stop_signals). Off the main thread no handler can be set: the server then starts
    with the first rank, as multiprocessing starts it."""
    if threading.current_thread() is not threading.main_thread():
        return
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()  # forks and execs the server; returns at once
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)  # None: set outside Python


class LaunchersOutput:
    """The launcher's stdout and stderr as they are when a rank starts, handed to it as file descriptors:
    a fork server's own are those of the moment it started (a test's capture of an earlier test, a
    file the caller has since redirected away from). Duplicated only while the rank is being started."""

    def __reduce__(self):
        return _take_output, (reduction.DupFd(1), reduction.DupFd(2))


def _take_output(out, err) -> None:
    for fd, held in ((1, out), (2, err)):
        got = held.detach()
        if got != fd:
            os.dup2(got, fd)
            os.close(got)
