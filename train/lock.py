"""One run per output directory: `DIR/.lock` names the process that owns it.

Two runs writing the same metrics and checkpoints would each resume from, and
overwrite, the other's. The lock is created exclusively (O_EXCL) and holds the owner's
pid and host. A lock whose owner is on this host and no longer running is stale (a run
killed with SIGKILL leaves one): it is taken over with a warning. A lock from another
host cannot be checked from here, so it is refused with the path to delete.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


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


class RunLock:
    def __init__(self, out: str | Path):
        self.path = Path(out) / ".lock"
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._take_over(self._holder())
            return self
        with os.fdopen(fd, "w") as f:
            json.dump(self.owner, f)
        return self

    def _holder(self) -> dict:
        try:
            holder = json.loads(self.path.read_text())
            int(holder["pid"]), str(holder["host"])
            return holder
        except (OSError, ValueError, KeyError, TypeError):
            return {}  # unreadable: a lock half-written by a run killed while taking it

    def _take_over(self, holder: dict) -> None:
        here = socket.gethostname()
        if holder and holder["host"] == here and _alive(int(holder["pid"])):
            raise LockError(f"{self.path.parent} is in use by another run (pid {holder['pid']}, started "
                            f"{holder.get('started', '?')}); give another --out, or wait for it to end")
        if holder and holder["host"] != here:
            raise LockError(f"{self.path.parent} is in use by a run on {holder['host']} (pid {holder['pid']}); "
                            f"if that run is gone, delete {self.path}")
        what = f"pid {holder['pid']}, no longer running" if holder else "unreadable"
        print(f"warning: taking over the stale lock {self.path} ({what})", file=sys.stderr)
        tmp = self.path.with_name(".lock.partial")
        tmp.write_text(json.dumps(self.owner))
        os.replace(tmp, self.path)

    def __exit__(self, *exc) -> None:
        if self._holder().get("pid") == self.owner["pid"]:
            self.path.unlink(missing_ok=True)
