"""The planner's searches simulate in forked workers (zerofunc/plan/workers.py): they must compute whatever
their parent computed before it forked them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

FORKS_AFTER_COMPUTING = """
import os, sys, torch
torch.ones(1 << 24).sum()  # the process's OpenMP team started, as a caller's (or a test session's) work leaves it
os.cpu_count = lambda: 2   # the CLI forks one worker a core: two, on any machine
from zerofunc.plan.__main__ import main
sys.exit(main(["--model", "gpt2-tiny", "--world-size", "2", "--micro-batch", "512", "--seq", "128"]))
"""


def test_forked_workers_compute_on_the_host_after_their_parent_did():
    """A simulation computes on the host (the batch's token ids, 64K of them here, past OpenMP's grain). GNU
    OpenMP in a forked child waits forever for its parent's team, which the child does not have: the README's
    fine-tune test hung so inside the suite. Seconds, not the 60 s this allows."""
    run = subprocess.Popen([sys.executable, "-c", FORKS_AFTER_COMPUTING], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        out, err = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)  # the workers too, hung in their group
        run.communicate()
        raise AssertionError("the plan's forked workers hung") from None
    assert run.returncode == 0, err[-2000:]
    assert "stage" in out
