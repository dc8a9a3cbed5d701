"""Faults a long run meets, each injected: a second run in the same output directory, a step whose
gradients are not finite."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from train.cli import main
from zerofunc.checkpoint import consolidated

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


# ---- a step whose gradients are not finite ------------------------------------------------------

FLAGS = ["--seq", "32", "--micro-batch", "2", "--device", "cpu", "--stage", "2"]


def train_poisoned(args, bad_call):
    """train_rank, with the loss of the `bad_call`-th micro-step (from 0; None: none) made NaN: the
    gradients of that step are NaN on every rank."""
    import zerofunc.step
    from train.loop import train_rank
    real, calls = zerofunc.step.loss_of, [0]

    def loss_of(out):
        loss = real(out)
        calls[0] += 1
        return loss * float("nan") if calls[0] - 1 == bad_call else loss

    zerofunc.step.loss_of = loss_of
    return train_rank(args)


def run(argv, bad_call=None, nproc=2):
    from tests.bare import in_world
    from train.cli import parse
    return in_world(nproc, train_poisoned, parse(argv + ["--nproc", str(nproc)]), bad_call)[0]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_nonfinite_step_stops_with_the_weights_before_it_and_resumes_exactly(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run(FLAGS + ["--steps", "5", "--out", str(straight)])
    result = run(FLAGS + ["--steps", "5", "--out", str(stopped)], bad_call=2)  # step 3
    assert "step 3: the loss is nan" in result["stopped"] and "weights of step 2" in result["stopped"]
    assert (stopped / "checkpoints" / "latest").read_text() == "step-00000002"
    assert [r["step"] for r in rows(stopped)] == [1, 2, 3] and rows(stopped)[-1]["nonfinite"]
    run(FLAGS + ["--steps", "5", "--resume", "--out", str(stopped)])
    assert [r["loss"] for r in rows(stopped)] == [r["loss"] for r in rows(straight)]  # bit for bit


def test_skipping_nonfinite_steps_keeps_nan_out_of_the_weights(tmp_path):
    out = tmp_path / "run"
    run(FLAGS + ["--steps", "4", "--save-every", "4", "--on-nonfinite", "skip", "--out", str(out)], bad_call=1)
    losses = [r["loss"] for r in rows(out)]
    assert [r.get("nonfinite", False) for r in rows(out)] == [False, True, False, False]
    assert math.isnan(losses[1]) and all(math.isfinite(x) for x in losses[:1] + losses[2:])
    manifest = json.loads((out / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["optimizer_steps"] == 3  # the skipped step was not taken
    assert all(torch.isfinite(w).all() for w in consolidated(out).values())


def test_a_diverging_run_exits_3_with_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(FLAGS + ["--nproc", "1", "--steps", "5", "--lr", "1e30", "--out", str(out)]) == 3  # diverges at step 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: step 2: the loss is nan") and "\n" not in err
    assert all(torch.isfinite(w).all() for w in consolidated(out).values())  # step 1's weights, saved
