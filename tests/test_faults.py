"""Faults a long run meets, each injected: a second run in the same output directory."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from train.cli import main

QUICK = ["--seq", "32", "--micro-batch", "2", "--device", "cpu", "--nproc", "1", "--steps", "1"]


def hold_lock(out: Path, pid: int, host: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": host, "started": "2026-11-22 00:00:00"}))
    return lock


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_in_the_same_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    lock = hold_lock(out, os.getpid(), socket.gethostname())  # this very process: alive
    assert main(QUICK + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"in use by another run (pid {os.getpid()}" in err and "\n" not in err
    assert lock.exists() and not (out / "metrics.jsonl").exists()  # the owner's lock and files are untouched


def test_a_lock_from_another_host_is_refused_with_the_path_to_delete(tmp_path, capsys):
    out = tmp_path / "run"
    lock = hold_lock(out, 1, "some-other-node")
    assert main(QUICK + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "some-other-node" in err and str(lock) in err and "\n" not in err


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    out = tmp_path / "run"
    lock = hold_lock(out, dead_pid(), socket.gethostname())
    assert main(QUICK + ["--out", str(out)]) == 0
    assert "warning: taking over the stale lock" in capsys.readouterr().err
    assert (out / "metrics.jsonl").exists() and not lock.exists()  # trained, and let go of the lock


def test_a_run_lets_go_of_its_directory(tmp_path):
    out = tmp_path / "run"
    assert main(QUICK + ["--out", str(out)]) == 0
    assert not (out / ".lock").exists()
    assert main(QUICK + ["--out", str(out)]) == 0  # a run after it may use the directory
