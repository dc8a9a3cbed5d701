"""One run per output directory: `DIR/.lock` names the process that owns it.

Two runs writing the same metrics and checkpoints would each resume from, and
overwrite, the other's. The lock holds the owner's pid and host. A lock whose owner is
on this host and no longer running is stale (a run killed with SIGKILL leaves one): it
is taken over with a warning. A lock from another host cannot be checked from here, so
it is refused with the path to delete.

Races, and why they cannot happen here:
- The lock is never seen half-written: its contents go to a file of a unique name
  first, and that file becomes the lock in one step that fails if a lock is already
  there (a hard link). A lock created empty and then written (a run of an older
  version, or a filesystem without hard links) may still be met half-written, so an
  unreadable lock is judged only after it has stayed unreadable for `GRACE_S`.
- A stale lock has one taker: each takes an exclusive `flock` on the stale lock file
  itself, then checks that the path still names that file before replacing it, so a
  taker that waited finds the winner's lock instead. A taker that dies lets go of the
  flock with its last descriptor; nothing is left behind.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

# How long an unreadable lock may be a run still writing it before it counts as left
# half-written by a run that died: a writer needs microseconds, a loaded machine may stall it.
GRACE_S = 2.0
_TRIES = 100  # rounds of "create it, or judge what is there" before giving up on a lock that keeps changing


class LockError(RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _parse(data: bytes) -> dict:
    try:
        holder = json.loads(data)
        int(holder["pid"]), str(holder["host"])
        return holder
    except (ValueError, KeyError, TypeError):
        return {}  # unreadable: a lock half-written, or by a run killed while writing it


class RunLock:
    def __init__(self, out: str | Path):
        self.path = Path(out) / ".lock"
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._ino: int | None = None  # the inode of the lock this process made: only that one is removed on exit

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".lock.", suffix=".tmp", dir=self.path.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(self.owner, f)
            self._ino = tmp.stat().st_ino
            for _ in range(_TRIES):
                if self._create(tmp) or self._take_over(tmp):
                    return self
            raise LockError(f"{self.path} keeps changing: another run is starting in {self.path.parent}; "
                            f"give another --out")
        finally:
            tmp.unlink(missing_ok=True)

    def _create(self, tmp: Path) -> bool:
        """Make the written `tmp` the lock unless there is one (False)."""
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                raise
        # a filesystem without hard links: create, then write (takers wait out GRACE_S for the write)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            self._ino = os.fstat(fd).st_ino
            f.write(tmp.read_bytes())
        return True

    def _holder(self) -> dict:
        try:
            return _parse(self.path.read_bytes())
        except OSError:
            return {}

    def _take_over(self, tmp: Path) -> bool:
        """Refuse the lock that is there (LockError), or replace it with `tmp` if it is stale
        (True); False if it went away or changed while it was being judged: look again."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            holder = self._judge(fd)
            if holder is None:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # one taker at a time; a waiting one then finds it replaced
            except OSError as e:
                raise LockError(f"cannot take over the stale lock {self.path} ({e}); "
                                f"if its run is gone, delete {self.path}") from None
            if not self._names(fd) or _parse(os.pread(fd, 1 << 16, 0)) != holder:
                return False
            what = f"pid {holder['pid']}, no longer running" if holder else "unreadable"
            print(f"warning: taking over the stale lock {self.path} ({what})", file=sys.stderr)
            os.replace(tmp, self.path)
            return True
        finally:
            os.close(fd)  # lets go of the flock

    def _names(self, fd: int) -> bool:
        """Whether the lock's path still names the file open at `fd`."""
        try:
            st, here = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)

    def _judge(self, fd: int) -> dict | None:
        """The stale lock's holder ({} if unreadable), or LockError if its owner may be running;
        None if the lock was replaced while an unreadable one was given time to be written."""
        first = time.monotonic()
        while True:
            holder = _parse(os.pread(fd, 1 << 16, 0))
            waited = time.monotonic() - first
            age = time.time() - os.fstat(fd).st_mtime
            if holder or max(age, waited) >= GRACE_S:  # readable, or unreadable for GRACE_S by either clock
                break
            if not self._names(fd):
                return None
            time.sleep(min(0.05, GRACE_S - max(age, waited)))
        here = socket.gethostname()
        if holder and holder["host"] == here and _alive(int(holder["pid"])):
            raise LockError(f"{self.path.parent} is in use by another run (pid {holder['pid']}, started "
                            f"{holder.get('started', '?')}); give another --out, or wait for it to end")
        if holder and holder["host"] != here:
            raise LockError(f"{self.path.parent} is in use by a run on {holder['host']} (pid {holder['pid']}); "
                            f"if that run is gone, delete {self.path}")
        return holder

    def __exit__(self, *exc) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_ino == self._ino and self._holder().get("pid") == self.owner["pid"]:
            self.path.unlink(missing_ok=True)
