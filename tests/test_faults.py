"""Faults a long run meets, each injected: a second run in the same output directory, a step whose
gradients are not finite, a rank that dies or hangs, a signal to stop, a save that cannot be written.

Faults inside the ranks are injected by test code only: `train_with_fault` replaces the
trainer's rank function (through the launcher, `main` is run as a user runs it) and acts
in the forward pass of a chosen step on a chosen rank, as told by the environment
variable FAULT, which the spawned ranks inherit. Every such test checks how fast the run
ended after the fault, that the message is one line, that the newest checkpoint loads
and, where a run can go on, that `--resume` gives the losses of the run never interrupted
(once per kind of checkpoint a fault leaves: a save that fails leaves the very checkpoint
a killed rank does).
"""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train.cli import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_RANK_FAILED, EXIT_SAVE_FAILED, main
from zerofunc.checkpoint_files import consolidated

QUICK = ["--seq", "32", "--micro-batch", "2", "--device", "cpu", "--nproc", "1", "--steps", "1"]


@pytest.fixture(scope="module")
def quick(tiny_data) -> list[str]:
    """QUICK on tests/conftest.py's tiny_data: the built-in corpus is read before the lock is even looked at."""
    return QUICK + ["--data", tiny_data]


def hold_lock(out: Path, pid: int, host: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": host, "started": "2026-11-22 00:00:00"}))
    return lock


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_in_the_same_directory_is_refused(tmp_path, capsys, quick):
    out = tmp_path / "run"
    lock = hold_lock(out, os.getpid(), socket.gethostname())  # this very process: alive
    assert main(quick + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"in use by another run (pid {os.getpid()}" in err and "\n" not in err
    assert lock.exists() and not (out / "metrics.jsonl").exists()  # the owner's lock and files are untouched


def test_a_lock_from_another_host_is_refused_with_the_path_to_delete(tmp_path, capsys, quick):
    out = tmp_path / "run"
    lock = hold_lock(out, 1, "some-other-node")
    assert main(quick + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "some-other-node" in err and str(lock) in err and "\n" not in err


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys, quick):
    out = tmp_path / "run"
    lock = hold_lock(out, dead_pid(), socket.gethostname())
    assert main(quick + ["--out", str(out)]) == 0
    assert "warning: taking over the stale lock" in capsys.readouterr().err
    assert (out / "metrics.jsonl").exists() and not lock.exists()  # trained, and let go of the lock


# ---- a step whose gradients are not finite ------------------------------------------------------

# Stage 1: these runs also prove its bit-exact resume (tests/test_checkpoint.py does the other stages).
FLAGS = ["--seq", "32", "--micro-batch", "2", "--device", "cpu", "--stage", "1"]


@pytest.fixture(scope="module")
def flags(tiny_data) -> list[str]:
    return FLAGS + ["--data", tiny_data]


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


@pytest.fixture(scope="module")
def straight(tmp_path_factory, flags) -> list[float]:
    """The losses of 5 steps never interrupted, which every resumed run below must repeat."""
    out = tmp_path_factory.mktemp("straight")
    run(flags + ["--steps", "5", "--out", str(out)])
    return [r["loss"] for r in rows(out)]


@pytest.mark.slow
def test_a_nonfinite_step_stops_with_the_weights_before_it_and_resumes_exactly(tmp_path, straight, flags):
    stopped = tmp_path / "stopped"
    result = run(flags + ["--steps", "5", "--out", str(stopped)], bad_call=2)  # step 3
    kind, line = result["stopped"]
    assert kind == "nonfinite" and "step 3: the loss is nan" in line and "weights of step 2" in line
    assert (stopped / "checkpoints" / "latest").read_text() == "step-00000002"
    assert [r["step"] for r in rows(stopped)] == [1, 2, 3] and rows(stopped)[-1]["nonfinite"]
    run(flags + ["--steps", "5", "--resume", "--out", str(stopped)])
    assert [r["loss"] for r in rows(stopped)] == straight  # bit for bit


@pytest.mark.slow
def test_skipping_nonfinite_steps_keeps_nan_out_of_the_weights_and_resumes_exactly(tmp_path, flags):
    """Step 2 skipped: 3 optimizer steps in 4. Resumed from step 4, the run repeats one that never stopped
    bit for bit, which needs the optimizer's own count (3) back, not the training step (4): bias
    correction and the schedule read it."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    run(flags + ["--steps", "4", "--save-every", "4", "--on-nonfinite", "skip", "--out", str(out)], bad_call=1)
    losses = [r["loss"] for r in rows(out)]
    assert [r.get("nonfinite", False) for r in rows(out)] == [False, True, False, False]
    assert math.isnan(losses[1]) and all(math.isfinite(x) for x in losses[:1] + losses[2:])
    manifest = json.loads((out / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["optimizer_steps"] == 3  # the skipped step was not taken
    assert all(torch.isfinite(w).all() for w in consolidated(out).values())
    run(flags + ["--steps", "6", "--on-nonfinite", "skip", "--out", str(straight)], bad_call=1)
    run(flags + ["--steps", "6", "--on-nonfinite", "skip", "--resume", "--out", str(out)])
    assert [r["lr"] for r in rows(out)] == [r["lr"] for r in rows(straight)]
    assert [r["loss"] for r in rows(out)][4:] == [r["loss"] for r in rows(straight)][4:]  # bit for bit


@pytest.mark.slow
def test_a_diverging_run_exits_3_with_one_line(tmp_path, capsys, flags):
    out = tmp_path / "run"
    assert main(flags + ["--nproc", "1", "--steps", "5", "--lr", "1e30", "--out", str(out)]) == 3  # diverges at step 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: step 2: the loss is nan") and "\n" not in err
    assert all(torch.isfinite(w).all() for w in consolidated(out).values())  # step 1's weights, saved


# ---- a rank that dies or hangs, a signal to stop, a save that fails ------------------------------

def train_with_fault(args):
    """train_rank, with FAULT = "RANK STEP ACTION" done in that step's forward pass on that rank.
    The moment of the fault goes to the file FAULT_AT."""
    import zerofunc.step
    from train.loop import train_rank
    rank, step, action = os.environ["FAULT"].split()
    real, calls = zerofunc.step.loss_of, [0]

    def loss_of(out):
        calls[0] += 1  # one micro-step per step here
        if torch.distributed.get_rank() == int(rank) and calls[0] in (int(step), int(step) + 1):
            act(action, first=calls[0] == int(step))
        return real(out)

    zerofunc.step.loss_of = loss_of
    return train_rank(args)


def act(action: str, first: bool) -> None:
    if first:
        Path(os.environ["FAULT_AT"]).write_text(repr(time.time()))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if action == "kill" and first:
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang" and first:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "term" and first:  # to the launcher, as a cluster's scheduler does
        os.kill(int(os.environ["LAUNCHER_PID"]), signal.SIGTERM)
    elif action == "int-int" and first:  # Ctrl-C, then Ctrl-C again a while later
        os.kill(int(os.environ["LAUNCHER_PID"]), signal.SIGINT)
        time.sleep(1.5)
        os.kill(int(os.environ["LAUNCHER_PID"]), signal.SIGINT)
        time.sleep(60)
    elif action in ("quota", "quota-once"):  # a 1 KiB file-size quota from this step; "once": for one step
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024 if first or action == "quota" else limit[1], limit[1]))


def launch(argv: list[str], fault: str, tmp_path: Path, monkeypatch, capfd) -> tuple[int, list[str], float]:
    """main(argv) with the fault; (exit code, stderr's lines, seconds from the fault to the exit)."""
    at = tmp_path / "fault-at"
    monkeypatch.setenv("FAULT", fault)
    monkeypatch.setenv("FAULT_AT", str(at))
    monkeypatch.setenv("LAUNCHER_PID", str(os.getpid()))  # not getppid(): ranks are forked from a fork server
    monkeypatch.setattr("train.cli.train_rank", train_with_fault)
    code = main(argv)
    took = time.time() - float(at.read_text())
    return code, capfd.readouterr().err.strip().splitlines(), took


@pytest.mark.slow
def test_a_killed_rank_is_named_and_the_run_resumes_exactly(tmp_path, straight, monkeypatch, capfd, flags):
    out = tmp_path / "run"
    argv = flags + ["--nproc", "2", "--steps", "5", "--save-every", "2", "--out", str(out)]
    code, err, took = launch(argv + ["--timeout", "30"], "1 4 kill", tmp_path, monkeypatch, capfd)
    assert code == EXIT_RANK_FAILED and took < 30
    assert err[-1] == "error: rank 1 died (killed by SIGKILL) during step 4; the other ranks were stopped"
    assert (out / "checkpoints" / "latest").read_text() == "step-00000002"
    assert not (out / ".lock").exists()
    run(flags + ["--steps", "5", "--resume", "--out", str(out)])
    assert [r["loss"] for r in rows(out)] == straight


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_after_the_timeout(tmp_path, monkeypatch, capfd, flags):
    out = tmp_path / "run"
    argv = flags + ["--nproc", "2", "--steps", "5", "--save-every", "2", "--timeout", "3", "--out", str(out)]
    code, err, took = launch(argv, "1 4 hang", tmp_path, monkeypatch, capfd)
    assert code == EXIT_RANK_FAILED and 3 <= took < 3 + 10
    assert err[-1].startswith("error: rank 0: no answer from the other ranks within --timeout 3 s during step 4")
    assert "Traceback" not in "".join(err)
    assert all(torch.isfinite(w).all() for w in consolidated(out).values())  # step 2's, checksums checked


@pytest.mark.slow
def test_sigterm_stops_at_a_step_with_a_checkpoint_and_resumes_exactly(tmp_path, straight, monkeypatch, capfd,
                                                                       flags):
    out = tmp_path / "run"
    argv = flags + ["--nproc", "2", "--steps", "5", "--out", str(out)]
    code, err, took = launch(argv, "1 3 term", tmp_path, monkeypatch, capfd)
    last = int((out / "checkpoints" / "latest").read_text().removeprefix("step-"))
    assert code == EXIT_PREEMPTED and took < 10 and last in (3, 4)  # the step in flight, or the next
    assert err[-1] == (f"stopped: SIGTERM received; stopped after step {last}, its checkpoint is "
                       f"{out / 'checkpoints' / f'step-{last:08d}'}; continue with --resume")
    run(flags + ["--steps", "5", "--resume", "--out", str(out)])
    assert [r["loss"] for r in rows(out)] == straight


@pytest.mark.slow
def test_a_second_sigint_stops_at_once(tmp_path, monkeypatch, capfd, flags):
    out = tmp_path / "run"
    argv = flags + ["--nproc", "2", "--steps", "5", "--save-every", "2", "--out", str(out)]
    code, err, took = launch(argv, "1 3 int-int", tmp_path, monkeypatch, capfd)
    assert code == EXIT_INTERRUPTED and took < 1.5 + 5  # the rank itself sleeps on for a minute
    assert err[-1] == "error: interrupted"
    assert (out / "checkpoints" / "latest").read_text() == "step-00000002" and not (out / ".lock").exists()
    assert all(torch.isfinite(w).all() for w in consolidated(out).values())


@pytest.mark.slow
def test_a_save_that_fails_stops_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capfd, flags):
    out = tmp_path / "run"
    argv = flags + ["--nproc", "2", "--steps", "5", "--save-every", "2", "--out", str(out)]
    code, err, took = launch(argv, "1 3 quota", tmp_path, monkeypatch, capfd)  # rank 1 can no longer write
    assert code == EXIT_SAVE_FAILED and took < 10
    step4 = out / "checkpoints" / "step-00000004"
    assert err[-1].startswith(f"error: could not save the checkpoint of step 4 to {step4}: rank 1: ")
    assert err[-1].endswith(f"; stopped, the newest checkpoint is {out / 'checkpoints' / 'step-00000002'}")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000002"]  # no debris
    assert (out / "checkpoints" / "latest").read_text() == "step-00000002"
    # What is left is what test_a_killed_rank_is_named_and_the_run_resumes_exactly resumes from: the same
    # flags' step-2 checkpoint (the fault comes at step 3), byte for byte, and metrics past it; so its resume is
    # not run again here.


@pytest.mark.slow
def test_a_save_that_fails_can_be_passed_over(tmp_path, straight, monkeypatch, capfd, flags):
    out = tmp_path / "run"
    argv = flags + ["--nproc", "2", "--steps", "5", "--save-every", "1", "--on-save-error", "continue",
                    "--out", str(out)]
    code, err, _ = launch(argv, "1 3 quota-once", tmp_path, monkeypatch, capfd)
    assert code == 0 and [r["loss"] for r in rows(out)] == straight
    assert [line.split(": rank 1")[0] for line in err if line.startswith("warning")] == [
        f"warning: could not save the checkpoint of step 3 to {out / 'checkpoints' / 'step-00000003'}"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest", "step-00000001", "step-00000002", "step-00000004", "step-00000005"]


def test_ranks_agree_on_the_step_to_stop_after():
    """The first rank signalled at the top of step t stops everyone after t: a rank still at the top
    of t runs it, and so does one that was signalled later; none runs t + 1."""
    from train.preempt import StopAgreement
    store = torch.distributed.HashStore()
    signals = {0: None, 1: None, 2: None}
    ranks = {r: StopAgreement(store, signalled=lambda r=r: signals[r]) for r in signals}
    assert not any(ranks[r].stop_before(4) for r in ranks)  # no signal yet
    signals[1] = "SIGTERM"
    assert not ranks[1].stop_before(5)  # rank 1 proposes: stop after step 5, the one it is starting
    signals[2] = "SIGINT"
    assert not ranks[0].stop_before(5) and not ranks[2].stop_before(5)  # rank 2's later request changes nothing
    assert all(ranks[r].stop_before(6) for r in ranks)
    assert {ranks[r].agreed for r in ranks} == {(5, "SIGTERM")}
