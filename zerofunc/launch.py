"""Start N ranks on this machine, or join the ranks torchrun started.

`spawn(fn, nproc, *args)` runs `fn(*args)` in `nproc` fresh processes joined in one
process group and returns each rank's return value, in rank order. A rank that raises
makes `spawn` raise `RankError` with that rank's traceback; the other ranks are
stopped rather than left waiting on a collective that will never come.

Ranks end with `os._exit` right after destroying the group: torch 2.13 with gloo can
otherwise abort at interpreter exit after all work is done (see DESIGN.md).
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank failed; the message carries its traceback."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_torchrun(backend: str) -> None:
    """Join the process group torchrun set up through the environment."""
    if not dist.is_initialized():
        dist.init_process_group(backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, nproc: int, port: int, backend: str, results, fn, args) -> None:
    code = 0
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nproc, timeout=datetime.timedelta(seconds=300))
        results.put((rank, True, fn(*args)))
    except BaseException as e:  # report anything, including KeyboardInterrupt, to the parent
        results.put((rank, False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        code = 1
    try:
        results.close()
        results.join_thread()  # flush the result before os._exit kills the queue's feeder thread
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(code)


def spawn(fn: Callable[..., Any], nproc: int, *args, backend: str = "gloo",
          timeout: float = 1800.0) -> list[Any]:
    """Run `fn(*args)` on `nproc` local ranks; return their results in rank order."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, backend, results, fn, args), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < nproc:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                missing = [r for r in range(nproc) if r not in out]
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead and results.empty():
                    raise RankError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result") from None
                if time.monotonic() > deadline:
                    raise RankError(f"ranks {missing} gave no result in {timeout:.0f} s") from None
                continue
            if not ok:
                raise RankError(value)
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(out) == nproc else 1)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(nproc)]
