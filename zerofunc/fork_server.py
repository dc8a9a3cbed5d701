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
from typing import Optional

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
    (stop_signals.catch_stop_signals). Off the main thread no handler can be set: the server then starts
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


def server_death() -> Optional[str]:
    """How the fork server died ("killed by SIGKILL", "exit code 1"), or None while it runs (or where
    there is none). Looked at without reaping it: multiprocessing reaps it itself when it next starts
    one. With the server dead, every rank's exit code reads 255 (its channel closed), whatever the rank
    is doing."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # private: a CPython detail
    if pid is None or not hasattr(os, "waitid"):
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"killed by {signal.Signals(info.si_status).name}"
    return f"exit code {info.si_status}"


class Lifeline:
    """A pipe the launcher holds open while its ranks run: a rank exits when it closes.

    A rank is the fork server's child, not the launcher's, and the server outlives the launcher while
    any rank does (each holds its liveness pipe, by multiprocessing's design). So a launcher killed
    outright (SIGKILL, the OOM killer), or one whose fork server died and so cannot see its ranks, left
    them running: waiting on a collective until its timeout, holding their memory (a GPU's too). Handed
    to a rank, the read end is watched by a thread there. The launcher `cut`s it when `spawn` ends,
    saying so first; a launcher that dies says nothing, and the rank says why it exits."""

    def __init__(self):
        self._read, self._write = os.pipe()

    def __reduce__(self):
        return _watched, (reduction.DupFd(self._read),)

    def cut(self, ranks: int) -> None:
        """Any of the `ranks` still running exits, quietly: a byte said for each, as they share the pipe (one
        byte for all, the first rank to read it would take it, and the others read the end of file)."""
        os.write(self._write, b"x" * ranks)
        for fd in (self._read, self._write):
            os.close(fd)


def _watched(held) -> None:
    """In a rank, unpickling its `Lifeline`: the thread that ends the rank when the launcher cuts it."""
    fd = held.detach()
    threading.Thread(target=_exit_when_cut, args=(fd,), name="zerofunc-lifeline", daemon=True).start()


def _exit_when_cut(fd: int) -> None:
    if not os.read(fd, 1):  # end of file, nothing said: the launcher died
        try:  # one write, so that ranks' lines do not interleave
            os.write(2, f"rank {os.environ.get('RANK', '?')}: its launcher is gone; exiting\n".encode())
        except OSError:  # the launcher's output may be gone with it
            pass
    os._exit(1)
