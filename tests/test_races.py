"""Races between processes that start at the same time: the output directory's lock (train/lock.py) and
the launcher's rendezvous port (zerofunc/launch.py).

- A lock is never seen half-written, and one met half-written (an owner that creates it and then
  writes it: an older version, or a filesystem without hard links) is not taken for a stale one.
- Of several runs that find the same stale lock at once, exactly one takes it over.
- The port the launcher hands its ranks is held from the moment it is chosen: another process that
  tries to take it before the ranks start cannot.

Every race is made to happen, or given many chances to, in a few seconds.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.lock import GRACE_S, LockError, RunLock

ROOT = Path(__file__).resolve().parents[1]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hold_lock(out: Path, pid: int, host: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": host, "started": "2026-11-22 00:00:00"}))
    return lock


def python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---- a lock being written ----------------------------------------------------------------------------

# An owner that creates the lock exclusively and only then writes it, pausing in between.
SLOW_WRITER = """
import json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
print("created", flush=True)
time.sleep(float(sys.argv[2]))
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}).encode())
os.close(fd)
print("written", flush=True)
time.sleep(60)
"""


def test_a_lock_met_half_written_by_a_live_owner_is_not_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    owner = python(SLOW_WRITER, str(out / ".lock"), "0.4")  # writes it 0.4 s after creating it
    try:
        assert owner.stdout.readline() == "created\n"
        started = time.monotonic()
        with pytest.raises(LockError, match=rf"in use by another run \(pid {owner.pid},"):
            RunLock(out).__enter__()
        assert time.monotonic() - started < GRACE_S  # it answered once the lock was written, not after the grace
        assert json.loads((out / ".lock").read_text())["pid"] == owner.pid  # the owner's lock is untouched
    finally:
        owner.kill()
        owner.wait()


def test_a_lock_left_unreadable_is_taken_over_with_a_warning(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / ".lock"
    lock.write_text('{"pid": 12')  # a run killed while writing it, long ago
    os.utime(lock, (time.time() - 10 * GRACE_S,) * 2)
    with RunLock(out):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err == f"warning: taking over the stale lock {lock} (unreadable)\n"
    assert not lock.exists() and [p.name for p in out.iterdir()] == []  # no temporary file left behind


# A run that takes and lets go of the lock as fast as it can, for `seconds`.
CHURN = """
import sys, time
from train.lock import RunLock
end = time.monotonic() + float(sys.argv[2])
print("go", flush=True)
n = 0
while time.monotonic() < end:
    with RunLock(sys.argv[1]):
        n += 1
print(n, flush=True)
"""


def test_a_lock_is_never_seen_half_written(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / ".lock"
    churn = python(CHURN, str(out), "1.5")
    assert churn.stdout.readline() == "go\n"
    seen, bad = 0, []
    while churn.poll() is None:
        try:
            text = lock.read_text()
        except FileNotFoundError:
            continue
        seen += 1
        try:
            assert json.loads(text)["pid"] == churn.pid
        except (ValueError, KeyError, AssertionError):
            bad.append(text)
    said = churn.stdout.read()
    assert churn.returncode == 0, said
    rounds = int(said.split()[-1])
    assert rounds > 100 and seen > 100, f"{rounds} rounds, {seen} reads: too few chances to see it half-written"
    assert bad == [], f"{len(bad)} of {seen} reads found the lock half-written, e.g. {bad[0]!r}"


# ---- two takers of a stale lock ------------------------------------------------------------------------

TAKERS, ROUNDS = 3, 5


def _taker(out: str, start, done, results) -> None:
    """Each round: take the lock at the same moment as the others, say who won, hold it until all
    have tried, then let go. Asking whether the stale owner lives takes 50 ms here, so that every
    taker has judged the lock stale before any of them replaces it: the race happens every round."""
    import train.lock

    alive = train.lock._alive
    train.lock._alive = lambda pid: time.sleep(0.05) or alive(pid)
    for _ in range(ROUNDS):
        start.wait(timeout=30)
        lock = RunLock(out)
        try:
            lock.__enter__()
        except Exception as e:  # LockError: refused; anything else fails the test
            results.put((os.getpid(), f"{type(e).__name__}: {e}"))
            done.wait(timeout=30)
        else:
            results.put((os.getpid(), None))
            done.wait(timeout=30)
            lock.__exit__(None, None, None)
        done.wait(timeout=30)  # the winner has let go


def test_of_two_takers_of_a_stale_lock_one_wins(tmp_path, capfd):
    out = tmp_path / "run"
    ctx = multiprocessing.get_context("spawn")
    start, done, results = ctx.Barrier(TAKERS + 1), ctx.Barrier(TAKERS + 1), ctx.Queue()
    procs = [ctx.Process(target=_taker, args=(str(out), start, done, results), daemon=True) for _ in range(TAKERS)]
    for p in procs:
        p.start()
    stale = dead_pid()
    try:
        for r in range(ROUNDS):
            lock = hold_lock(out, stale, socket.gethostname())
            start.wait(timeout=30)
            said = dict(results.get(timeout=30) for _ in range(TAKERS))
            winners = [pid for pid, refusal in said.items() if refusal is None]
            assert len(winners) == 1, f"round {r}: {len(winners)} of {TAKERS} runs took over the stale lock"
            assert json.loads(lock.read_text())["pid"] == winners[0]
            for pid, refusal in said.items():
                assert refusal is None or refusal.startswith("LockError: ") and \
                    f"in use by another run (pid {winners[0]}," in refusal, f"round {r}: {refusal}"
            done.wait(timeout=30)
            done.wait(timeout=30)
            assert not lock.exists()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert capfd.readouterr().err.count("warning: taking over the stale lock") == ROUNDS
    assert [p.name for p in out.iterdir()] == []  # no temporary file left behind


# ---- the launcher's port -------------------------------------------------------------------------------

def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def test_another_process_cannot_take_the_port_before_the_ranks_start(monkeypatch):
    """Just before each rank starts, a thief tries to listen on the (host, port) the launcher hands it
    (the launcher passes ranks their rendezvous address as one argument): it must find it taken, and the
    world must start all the same."""
    from zerofunc.fork_server import start_method
    from zerofunc.launch import spawn

    Process = start_method().Process  # the launcher's kind (forkserver, or spawn)

    tries, held = [], []
    real_start = Process.start

    def start(self):
        for addr in [a for a in self._args if isinstance(a, tuple) and len(a) == 2
                     and isinstance(a[0], str) and isinstance(a[1], int)]:
            tries.append(addr)
            thief = socket.socket()
            try:
                thief.bind(addr)
                thief.listen()
                held.append(thief)  # keep it, as a process that took the port would
            except OSError:
                thief.close()
        real_start(self)

    monkeypatch.setattr(Process, "start", start)
    try:
        assert spawn(_rank_and_size, 2, timeout=60) == [(0, 2), (1, 2)]
        assert len(tries) == 2 and not held, f"the launcher handed out {tries}, and another process took it"
    finally:
        for s in held:
            s.close()
