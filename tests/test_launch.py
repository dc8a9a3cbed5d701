"""The launcher's fork server (zerofunc/fork_server.py): what ranks fork from must leave them able to use CUDA."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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


STOPPING_WORLD = '''
import os, sys, time
from pathlib import Path
from zerofunc import launch

def busy_rank(ready):
    Path(ready, os.environ["RANK"]).touch()
    while launch.stop_signal() is None:
        time.sleep(0.05)
    time.sleep(3.0)  # still busy (a compile) well after the signal; then at a step's end it stops
    return launch.stop_signal()

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
    script, ready = tmp_path / "world.py", tmp_path / "ready"
    script.write_text(STOPPING_WORLD)
    ready.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    launcher = subprocess.Popen([sys.executable, str(script), str(ready)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(ready.iterdir())) == 2, launcher.communicate(timeout=30)[0]
        os.killpg(launcher.pid, signal.SIGTERM)  # its own session: the group is the launcher's alone
        out = launcher.communicate(timeout=60)[0]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert out.strip().splitlines()[-1] == "['SIGTERM', 'SIGTERM']", out
