"""Start N ranks on this machine, or join the ranks torchrun started.

`spawn(fn, nproc, *args)` runs `fn(*args)` in `nproc` fresh processes (forked from a server
that imported torch once, with the launcher's current environment) joined in one
process group and returns each rank's return value, in rank order. A rank that raises,
or dies, makes `spawn` raise `RankError`; the other ranks are stopped rather than left
waiting on a collective that will never come.

Faults are told in one line: a rank that died is named with the step it was in (ranks
report it through `mark_step`), and a collective that failed or timed out (after the
group's `comm_timeout`) says so without a traceback; so does an exception whose class says
`bad_input = True` (the user's file, found wanting only in a rank, as a checkpoint's
checksum is), and its `RankError` says `bad_input` too. An exception of any other kind is a
bug, and its `RankError` carries the rank's traceback in `detail`.

Signals to stop are requests (zerofunc/stop_signals.py): the launcher forwards the first to every rank
as SIGTERM, and a second one stops them at once.

Ranks end with `os._exit` right after destroying the group: torch 2.13 with gloo can
otherwise abort at interpreter exit after all work is done (see DESIGN.md).
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import re
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from multiprocessing.reduction import ForkingPickler

from zerofunc.fork_server import LaunchersOutput, Lifeline, server_death, start_method
from zerofunc.host_memory import keep_freed_memory
from zerofunc.stop_signals import StopRequests, catch_stop_signals

DEFAULT_COMM_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank failed. The message is one line; `detail` holds the rank's traceback when
    the failure was not a known fault (a bug), else None."""

    def __init__(self, line: str, detail: Optional[str] = None, bad_input: bool = False):
        super().__init__(line)
        self.detail, self.bad_input = detail, bad_input


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_torchrun(backend: str, comm_timeout: float = DEFAULT_COMM_TIMEOUT_S) -> None:
    """Join the process group torchrun set up through the environment."""
    global _comm_timeout
    _comm_timeout = comm_timeout
    _set_up_rank_process()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=comm_timeout))


def _set_up_rank_process() -> None:
    """What every rank's process sets up first, spawned or under torchrun."""
    catch_stop_signals()
    keep_freed_memory()  # a step's buffers, freed, kept for the next step (zerofunc/host_memory.py)
    no_semaphores_left_behind()


def no_semaphores_left_behind() -> None:
    """Give tqdm a thread lock in this rank, before anything makes a bar. Its default is a multiprocessing lock,
    a named semaphore, made by the first bar of the process (torch.fx's interpreter makes a disabled one while
    torch.compile traces an autograd Function: every rank compiled whole), and a rank that ends with
    `os._exit` never unlinks it: multiprocessing's resource tracker then warned of a leaked semaphore per rank
    as the run ended. A rank's bars share no lock with another process's in any case. Without tqdm (a GPU
    image's own packages, the checkout on PYTHONPATH) torch.fx takes torch.hub's stand-in, which makes none."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


# ---- what a rank tells: its step, a failure in one line -------------------------------------------

_progress = None  # the launcher's table of each rank's current step (shared memory); None under torchrun
_step = 0
_comm_timeout = DEFAULT_COMM_TIMEOUT_S


def mark_step(step: int) -> None:
    """Record the step this rank is in: the launcher names it if the rank dies."""
    global _step
    _step = step
    if _progress is not None:
        _progress[dist.get_rank()] = step


def is_comm_failure(e: BaseException) -> bool:
    """A collective that failed because a peer died, hung or cannot be reached. Gloo says a timeout in more
    than one way, by which side gave up first: "Timed out waiting ... for recv", and "Application timeout
    caused pair closure" (without "gloo" in it, seen when a rank hung)."""
    return isinstance(e, getattr(dist, "DistError", ())) or (isinstance(e, RuntimeError) and bool(
        re.search(r"gloo|NCCL|Connection (reset|closed)|Timed out|timeout caused pair closure", str(e))))


def comm_failure_line(rank: int, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\] ", "", first)  # gloo's [file:line] prefix
    text = text.split(". This is typically caused")[0]
    where = f"during step {_step}" if _step else "before the first step"
    if re.search(r"[Tt]imed? ?out|timeout", text):
        return (f"rank {rank}: no answer from the other ranks within --timeout {_comm_timeout:g} s {where} "
                f"(a rank hung, or its node is unreachable): {text}")
    return f"rank {rank}: a collective failed {where} (a rank died, or its node is unreachable): {text}"


# ---- the launcher -----------------------------------------------------------------------------------

def _rendezvous(comm_timeout: float) -> dist.TCPStore:
    """The store the ranks meet at, served by the launcher on a loopback port the OS picks.

    The store is unauthenticated, and TCPStore's server listens on every interface whatever
    host it is given (torch 2.13: [::]:port): anyone who reached the port could join or upset
    the run. So the launcher binds the socket to 127.0.0.1 itself and hands it to the store
    (`master_listen_fd`; the store owns and closes it). It holds the port from the moment it is
    chosen until the world has ended, so no other process can take it in between: picking a
    free port, closing it and letting rank 0 bind it later (as `init_method="tcp://..."` does)
    leaves a window of a whole process start-up in which another run can bind it first.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=comm_timeout), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's now: closing it here too would close whatever next reuses the number
    return store


class _Unsendable(Exception):
    """A rank's result that pickle refuses: the caller's function returned it, a line of its own to say so."""
    bad_input = True


def _rank_main(rank: int, nproc: int, store_addr: tuple[str, int], backend: str, comm_timeout: float, progress,
               results, fn, args, environ: dict, output: None, lifeline: None) -> None:
    """`output` and `lifeline` are the launcher's `LaunchersOutput()` and `Lifeline`: unpickling them in the
    rank already took the launcher's output and started the thread that ends the rank with its launcher."""
    global _progress, _comm_timeout
    _progress, _comm_timeout = progress, comm_timeout
    _set_up_rank_process()
    code = 0
    try:
        # the launcher's environment as it is now: a fork server keeps the one it started with (cwd and
        # sys.path multiprocessing carries over itself)
        os.environ.clear()
        os.environ.update(environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
        timeout = datetime.timedelta(seconds=comm_timeout)
        store = dist.TCPStore(*store_addr, is_master=False, timeout=timeout)  # the launcher's (_rendezvous)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=timeout)
        result = fn(*args)
        try:  # pickled here, not in the queue's feeder thread, where a failure is printed and the result lost
            sent = bytes(ForkingPickler.dumps(result))
        except Exception as e:
            raise _Unsendable(f"its result ({type(result).__name__}) cannot be sent to the launcher: "
                              f"{type(e).__name__}: {e}") from e
        results.put((rank, True, sent, None, False))
    except BaseException as e:  # report anything, including KeyboardInterrupt, to the parent
        if is_comm_failure(e):
            results.put((rank, False, comm_failure_line(rank, e), None, False))
        elif isinstance(e, KeyboardInterrupt):
            results.put((rank, False, f"rank {rank}: interrupted during step {_step}", None, False))
        elif getattr(e, "bad_input", False):
            results.put((rank, False, f"rank {rank}: {e}".splitlines()[0], None, True))
        else:
            results.put((rank, False, f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0],
                         traceback.format_exc(), False))
        code = 1
    try:
        results.close()
        results.join_thread()  # flush the result before os._exit kills the queue's feeder thread
        if dist.is_initialized() and code == 0:  # after a failure the group may hang in teardown
            dist.destroy_process_group()
    finally:
        os._exit(code)


def _death(rank: int, proc, progress) -> str:
    """The line that says rank `rank` is gone (the others are stopped as the launcher ends)."""
    step = progress[rank]
    when = f"during step {step}" if step else "before its first step"
    server = server_death() if proc.exitcode == 255 else None  # 255: what a closed channel reads as
    if server:  # the ranks' exit codes are then unknown, and the ranks end with the launcher's lifeline
        return f"the fork server the ranks start from died ({server}) {when}; the ranks were stopped"
    code = proc.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"rank {rank} died ({how}) {when}; the other ranks were stopped"


def spawn(fn: Callable[..., Any], nproc: int, *args, backend: str = "gloo", timeout: Optional[float] = None,
          comm_timeout: float = DEFAULT_COMM_TIMEOUT_S) -> list[Any]:
    """Run `fn(*args)` on `nproc` local ranks; return their results in rank order.

    `timeout`: seconds for the whole run (None: no limit); `comm_timeout`: seconds any one
    collective may wait before it fails. A first SIGINT or SIGTERM to this process is
    forwarded to the ranks as SIGTERM; a second one (`stop_signals.REPEAT_S` later) stops them at once.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = start_method()
    results = ctx.Queue()
    progress = ctx.Array("q", nproc, lock=False)
    store = _rendezvous(comm_timeout)  # held until the ranks are gone
    lifeline = Lifeline()  # after the fork server started: it must not hold the pipe
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, nproc, ("127.0.0.1", store.port), backend, comm_timeout, progress, results,
                               fn, args, dict(os.environ), LaunchersOutput(), lifeline))
             for r in range(nproc)]
    requests = StopRequests()

    def forward(signum, frame):
        if requests.arrive(signum):
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

    main_thread = threading.current_thread() is threading.main_thread()
    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout

    def dead(but: int = -1) -> list[int]:
        return [r for r in range(nproc) if r not in out and r != but and procs[r].exitcode is not None]

    try:
        while len(out) < nproc:
            try:
                rank, ok, value, detail, bad_input = results.get(timeout=1.0)
            except queue.Empty:
                gone = dead()
                if gone and results.empty():
                    raise RankError(_death(gone[0], procs[gone[0]], progress)) from None
                if deadline is not None and time.monotonic() > deadline:
                    missing = [r for r in range(nproc) if r not in out]
                    raise RankError(f"ranks {missing} gave no result in {timeout:.0f} s") from None
                continue
            if not ok:
                if detail is None and not bad_input:  # a collective failed: name a rank that died as the cause
                    until = time.monotonic() + 2.0
                    while not dead(but=rank) and time.monotonic() < until:
                        time.sleep(0.05)
                    gone = dead(but=rank)
                    if gone and procs[gone[0]].exitcode != 1:  # 1: it reported a failure of its own
                        value = _death(gone[0], procs[gone[0]], progress)
                raise RankError(value, detail, bad_input)
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30 if len(out) == nproc else 1)
            if p.is_alive():
                p.kill()
        lifeline.cut(nproc)  # a rank this process cannot see (its fork server died) exits
        del store  # stop serving the rendezvous: every rank has ended
        for s, handler in saved.items():
            signal.signal(s, handler)
    return [out[r] for r in range(nproc)]
