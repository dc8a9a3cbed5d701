"""Multi-node through torchrun: two "nodes" on this machine (one torchrun agent each, joined by c10d
rendezvous) train like one process, save a checkpoint together, and exit 0 (ranks end with os._exit after the
group is destroyed: gloo could otherwise abort at interpreter exit, see DESIGN.md)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from train.cli import main, parse

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--seq", "32", "--device", "cpu", "--stage", "3", "--steps", "4", "--save-every", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(argv: list[str], run_id: str) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2 --nproc_per_node 1` twice, as two nodes would each start it."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
           "-m", "train", *argv]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = []
    for p in nodes:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return done


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_under_torchrun_the_world_is_torchrun_s(monkeypatch, tmp_path):
    """In torchrun's environment --nproc is ignored (so is this machine's bound on ranks per core), and the
    global batch is the micro-batch times torchrun's WORLD_SIZE."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "64", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    args = parse(FLAGS + ["--micro-batch", "2", "--nproc", "1000", "--out", str(tmp_path / "run")])
    assert args.config.train_batch_size == 2 * 64


@pytest.mark.slow
def test_two_nodes_train_like_one_process(tmp_path, tiny_data):
    one, two = tmp_path / "one", tmp_path / "two"
    data = ["--data", tiny_data]
    assert main(FLAGS + data + ["--nproc", "1", "--micro-batch", "4", "--out", str(one)]) == 0
    nodes = two_nodes(FLAGS + data + ["--micro-batch", "2", "--out", str(two)], "zerofunc-test")
    assert [n.returncode for n in nodes] == [0, 0], [n.stderr[-2000:] for n in nodes]
    assert not any("Traceback" in n.stderr for n in nodes)
    assert (two / "checkpoints" / "latest").read_text() == "step-00000004"  # each node wrote its shard
    reference, curve = losses(one), losses(two)
    assert len(curve) == 4 and curve[-1] < curve[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(curve, reference)) <= 1e-5
