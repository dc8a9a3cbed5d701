"""Multi-node through torchrun: two "nodes" on this machine (one torchrun agent each, joined by c10d
rendezvous) train like one process, save a checkpoint together, and exit 0 (ranks end with os._exit after the
group is destroyed: gloo could otherwise abort at interpreter exit, see DESIGN.md). Without torchrun, the
launcher's own rendezvous store is reachable from this machine only."""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from train.cli import main, parse
from zerofunc.launch import _rendezvous

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


def listening(port: int) -> list[str]:
    """The local addresses listening on `port`, from Linux's socket tables (hex, as the kernel writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:] if os.path.exists(table) else []:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:  # 0A: LISTEN
                found.append(local.split(":")[0])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_the_launcher_s_store_listens_on_loopback_only():
    """It is unauthenticated: on every interface ([::], TCPStore's own choice whatever host it is given),
    anyone who reached the port could join or upset the run (planted: TCPStore("127.0.0.1", 0, ...)
    listens on [::])."""
    store = _rendezvous(10.0)
    assert listening(store.port) == ["0100007F"]  # 127.0.0.1
    rank = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    rank.set("reached", "yes")
    assert store.get("reached") == b"yes"


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
    # sized, not derived: the same global batch summed over 2 ranks differs by 2.0e-7 (measured 2026-11-26);
    # ranks that all take the global batch's first rows, by 4.4e-2 (tests/plants.py: ranks_take_the_same_rows)
    worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
    assert worst <= 1e-5, f"two nodes differ from one process by {worst:.2e}"
