"""Where the planner's searches run their simulations: plans are independent, so a search maps them over
forked processes, one pool per command (`shared_workers`) where the command maps more than once."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from zerofunc.plan import Plan


_shared: dict[int, ProcessPoolExecutor] = {}  # by the pid that made it: a forked worker has its parent's dict


@contextlib.contextmanager
def shared_workers(workers: int):
    """Within: every map over processes in this process uses one pool of `workers` forked processes, not a
    pool of its own. A process's first simulation costs about a second more than the next ones (torch's lazy
    imports and registrations), so a command that maps three times (the fewest ranks, the stages, the
    levers) paid it three times in every worker; with one pool, once. For one command (python -m
    zerofunc.plan): the workers keep what the process was when they forked."""
    if workers <= 1 or os.getpid() in _shared:
        yield
        return
    with forked(workers) as pool:
        _shared[os.getpid()] = pool
        try:
            yield
        finally:
            del _shared[os.getpid()]


@contextlib.contextmanager
def mapper(workers: int, plans: list[Plan]):
    """A map over `workers` forked processes (the plans are independent): the shared pool where one is open
    (`shared_workers`), else a pool of its own; or this process's own where one worker or a model callable
    (which need not pickle) says so."""
    if workers <= 1 or any(p.foreign for p in plans):
        yield lambda fn, *args: list(map(fn, *args))
        return
    shared = _shared.get(os.getpid())
    if shared is not None:
        yield lambda fn, *args: list(shared.map(fn, *args))
        return
    with forked(workers) as pool:
        yield lambda fn, *args: list(pool.map(fn, *args))


def forked(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_one_thread)


def _one_thread() -> None:
    """A forked worker computes on the host on one thread: the parent's OpenMP team does not exist in it, and
    GNU OpenMP, asked for one of more threads there, waits for it forever. A simulation's host work is small
    (the batch's token ids, the twins of what a forward reads: sim/known_values.py)."""
    import torch
    torch.set_num_threads(1)
