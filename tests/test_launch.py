"""The launcher's fork server (zerofunc/fork_server.py): what ranks fork from must leave them able to use CUDA."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def test_the_ranks_fork_server_imports_without_asking_cuda_anything():
    """Ranks fork from a server that imports `PRELOAD` (zerofunc/fork_server.py). Once a process has asked
    CUDA anything (torch.cuda.is_available() included), a process forked from it cannot use CUDA:
    every rank of a GPU run would fail with "Cannot re-initialize CUDA in forked subprocess" (seen on
    the H100, docs/CUDA.md). On this CPU-only machine the question costs nothing, so the imports are
    watched instead: every torch.cuda call that reaches the driver is replaced by one that records it."""
    probe = """
import sys, torch
asked = []
for name in ("is_available", "device_count", "current_device", "init", "_lazy_init", "get_device_properties",
             "get_device_capability", "get_device_name", "set_device", "synchronize", "mem_get_info"):
    setattr(torch.cuda, name, lambda *a, _name=name, **k: asked.append(_name))
from zerofunc.fork_server import PRELOAD
for module in PRELOAD:
    __import__(module)
print(",".join(asked))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing the fork server's modules asked CUDA: {done.stdout.strip()}"


@contextlib.contextmanager
def busy_world(tmp_path, world: str):
    """A launcher of 2 ranks running `world`'s script in a session of its own, once both ranks have
    written their pid and their parent's (the fork server's) into a file each: (launcher, [(pid, ppid)])."""
    script, ready = tmp_path / "world.py", tmp_path / "ready"
    script.write_text(world)
    ready.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    launcher = subprocess.Popen([sys.executable, str(script), str(ready)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            ranks = [tuple(map(int, f.read_text().split())) for f in ready.iterdir() if f.read_text().endswith("\n")]
        assert len(ranks) == 2, launcher.communicate(timeout=30)[0]
        yield launcher, ranks
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid, _ in ranks:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ended_within(pids, seconds: float) -> list[int]:
    """Those of `pids` still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if running(p)]


STOPPING_WORLD = '''
import os, sys, time
from pathlib import Path
from zerofunc import launch
from zerofunc.stop_signals import stop_signal

def busy_rank(ready):
    Path(ready, os.environ["RANK"]).write_text(f"{os.getpid()} {os.getppid()}\\n")
    while stop_signal() is None:
        time.sleep(0.05)
    time.sleep(3.0)  # still busy (a compile) well after the signal; then at a step's end it stops
    return stop_signal()

if __name__ == "__main__":
    try:
        print(launch.spawn(busy_rank, 2, sys.argv[1]))
    except launch.RankError as e:
        print(f"error: {e}")
'''


def test_a_sigterm_to_the_whole_process_group_lets_the_ranks_stop_at_their_step(tmp_path):
    """GNU timeout and batch schedulers send SIGTERM to the launcher's whole process group, the fork
    server (zerofunc/fork_server.py) included. Each rank takes it as a request to stop at its next step,
    which may be minutes away (a compile): the launcher must wait for them, not report them dead because
    the server that reports their exit codes died, and leave them running without it (the seventh GPU
    run's hang)."""
    with busy_world(tmp_path, STOPPING_WORLD) as (launcher, _ranks):
        os.killpg(launcher.pid, signal.SIGTERM)  # its own session: the group is the launcher's alone
        out = launcher.communicate(timeout=60)[0]
    assert out.strip().splitlines()[-1] == "['SIGTERM', 'SIGTERM']", out


SLEEPING_WORLD = STOPPING_WORLD.replace("while stop_signal() is None:", "while True:")


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path):
    """A rank is its fork server's child, and the server outlives the launcher while any rank runs: a
    launcher killed by SIGKILL (or the OOM killer) left both ranks running, holding their memory until
    a collective timed out (zerofunc/fork_server.py, `Lifeline`). Ranks that sleep on are ended, with
    time for each to see its pipe close and exit."""
    with busy_world(tmp_path, SLEEPING_WORLD) as (launcher, ranks):
        launcher.kill()
        launcher.wait(timeout=30)
        assert ended_within([pid for pid, _ in ranks], 30) == []
        out = launcher.stdout.read()
    said = [line for line in out.splitlines() if line.startswith("rank ")]  # also: the resource tracker's warning
    assert sorted(said) == [f"rank {r}: its launcher is gone; exiting" for r in (0, 1)], out


def test_a_fork_server_killed_is_named_and_its_ranks_end(tmp_path):
    """With the fork server killed, the launcher reads exit code 255 for every rank, which are in fact
    running: it said `rank 0 died (exit code 255)`, claimed the other ranks stopped, and left both
    running. It must name the server's death and end the ranks."""
    with busy_world(tmp_path, SLEEPING_WORLD) as (launcher, ranks):
        (_, server), (_, other) = ranks
        assert server == other, "both ranks fork from one server"
        os.kill(server, signal.SIGKILL)
        out = launcher.communicate(timeout=60)[0]
        assert out.strip().splitlines()[-1] == ("error: the fork server the ranks start from died (killed by "
                                                "SIGKILL) before its first step; the ranks were stopped"), out
        # stopped by their launcher, which is alive: none may think it gone (the pipe's one byte for both)
        assert "its launcher is gone" not in out, out
        assert ended_within([pid for pid, _ in ranks], 30) == []


def test_gloo_s_timeouts_read_as_no_answer_within_the_timeout(monkeypatch):
    """Which words gloo's timeout comes in depends on which side of a pair gives up first; each must read as
    the run's timeout (tests/test_faults.py's hung rank, where this second form once surfaced instead of the
    first and was reported as a bug, with its traceback). Messages as gloo raised them on this CPU."""
    from zerofunc import launch
    monkeypatch.setattr(launch, "_comm_timeout", 3.0)
    monkeypatch.setattr(launch, "_step", 4)
    for said in ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 3000ms for recv "
                 "operation to complete", "Application timeout caused pair closure"):
        e = RuntimeError(said)
        assert launch.is_comm_failure(e), said
        assert launch.comm_failure_line(0, e).startswith(
            "rank 0: no answer from the other ranks within --timeout 3 s during step 4"), said


def _faults_of_a_step_s_buffers_made_again() -> tuple[int, int]:
    """Six 20 MB buffers allocated, written and freed eight times, as a step's gradients are: the fewest
    minor page faults of the last three times, and the buffers' pages."""
    import resource

    import torch
    faults = []
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffers = [torch.empty(5_000_000).fill_(1.0) for _ in range(6)]
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del buffers
    return min(faults[-3:]), 6 * 5_000_000 * 4 // 4096


def test_a_rank_keeps_the_memory_its_step_frees():
    """A rank the launcher starts keeps freed memory for the next step (zerofunc/host_memory.py): buffers
    made again fault none of their pages in, once the heap has settled. By default glibc gives the top of
    its heap back to the kernel once 64 MiB of it is free, so these 120 MB fault in every time, page by
    page (seen: 29,300 faults each of eight times); with the settings, seen here, one or two of the first
    times still fault some buffers in (a buffer's place in the heap moves until it settles), none from the
    fourth on. So the fewest of the last three: by default every page, here none; the bound, 1% of the
    pages, lies between (tests/plants.py: ranks_give_freed_memory_back)."""
    from tests.bare import in_world
    for faults, pages in in_world(2, _faults_of_a_step_s_buffers_made_again):
        assert faults <= pages // 100, f"{faults} page faults making {pages} pages again"


def _a_lock():
    return threading.Lock()


def test_a_result_pickle_refuses_is_named_not_taken_for_a_death():
    """A rank's function that returns what pickle refuses (a lock): the launcher says so in one line, naming
    the type, with no traceback. Pickled by the queue's feeder thread, the error was printed there and
    the result dropped; the rank then exited 0 and the launcher said "rank 0 died (exit code 0) before its
    first step" (tests/plants.py: ranks_leave_their_result_to_the_queue_to_pickle)."""
    import re

    from zerofunc.launch import RankError, spawn
    with pytest.raises(RankError) as e:
        spawn(_a_lock, 2, timeout=120)
    assert re.match(r"rank [01]: its result \(lock\) cannot be sent to the launcher: TypeError: cannot pickle",
                    str(e.value)), str(e.value)
    assert e.value.bad_input and e.value.detail is None


BAR_WORLD = '''
from zerofunc import launch

def rank_with_a_bar():
    from tqdm import tqdm
    with tqdm(total=1, disable=True):  # as torch.fx's interpreter makes one while torch.compile traces
        pass
    return 0

if __name__ == "__main__":
    print(launch.spawn(rank_with_a_bar, 2))
'''


def test_a_rank_that_made_a_progress_bar_leaves_no_semaphore_behind(tmp_path):
    """tqdm's default lock is a multiprocessing lock, a named semaphore, made by a process's first bar: in
    every rank compiled whole, where torch.fx's interpreter makes a disabled bar. A rank ends with
    `os._exit` (zerofunc/launch.py), which never unlinks it, and multiprocessing's resource tracker then
    printed "There appear to be 2 leaked semaphore objects" at the end of `python -m train --compile whole`.
    Each rank gives tqdm a thread lock first (`no_semaphores_left_behind`)."""
    script = tmp_path / "world.py"
    script.write_text(BAR_WORLD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0 and done.stdout.strip() == "[0, 0]", done.stdout + done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
