"""python -m zerofunc.check: the planner against real steps in simulated worlds of 1 to 64 ranks, on CPU.

A simulated world needs a process without a process group, so each check runs in a
fresh process: the command itself, or a spawned worker.
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path

import pytest
import torch

from sim.hardware import get_profile, profile_for_device
from zerofunc.check.__main__ import calibrate, main as check_main
from zerofunc.check.cells import Cell

ROOT = Path(__file__).resolve().parent.parent


def run_check(*argv: str, cwd: Path = ROOT) -> tuple[int, str, str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}  # as on a machine where zerofunc is not installed
    done = subprocess.run([sys.executable, "-m", "zerofunc.check", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=900)
    return done.returncode, done.stdout, done.stderr


def in_fresh_process(fn, *args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def assert_plan_holds(cells: list[dict], tolerance: float) -> None:
    for c in cells:
        where = f"stage {c['stage']} x {c['world_size']} ranks"
        assert c["ledger_equal"] and c["planned_comm"] == c["measured_comm"], f"{where}: communication differs"
        assert abs(c["planned_peak"] / c["measured_peak"] - 1) <= tolerance, f"{where}: peak ratio {c['peak_ratio']}"
        assert all(math.isfinite(x) for x in c["losses"]), f"{where}: losses {c['losses']}"


@pytest.mark.slow
def test_gpt2_tiny_at_1_8_64_ranks_is_planned_to_the_byte_and_within_2_percent(tmp_path):
    saved = tmp_path / "check.json"
    code, out, err = run_check("--model", "gpt2-tiny", "--world-sizes", "1,8,64", "--json", "--json-out", str(saved))
    assert code == 0, err
    doc = json.loads(out)
    assert json.loads(saved.read_text()) == doc
    cells = doc["cells"]
    assert [(c["stage"], c["world_size"]) for c in cells] == [(s, n) for s in range(4) for n in (1, 8, 64)]
    assert doc["failures"] == [] and doc["environment"]["torch"] == torch.__version__
    assert_plan_holds(cells, 0.02)
    # The simulated worlds really are N ranks: stage 3 keeps 1/N of the states, so its peak falls with N.
    stage3 = {c["world_size"]: c["measured_peak"] for c in cells if c["stage"] == 3}
    assert stage3[64] < stage3[8] < stage3[1]


@pytest.mark.slow
def test_compiled_stage_3_is_planned_to_the_byte_and_within_2_percent():
    """The compiled step regathers a stage-3 block before its compiled backward runs; the plan (the step
    on meta tensors, eager) gathers it as its backward first unpacks it. Both must come after the head's
    backward, which regathers the root: the same collectives in the same order, the same peak."""
    code, out, err = run_check("--model", "gpt2-tiny", "--stage", "3", "--world-sizes", "1,3", "--compile", "--json")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert [(c["stage"], c["world_size"]) for c in cells] == [(3, 1), (3, 3)]
    assert_plan_holds(cells, 0.02)


@pytest.mark.slow
def test_lora_is_planned_to_the_byte_and_within_2_percent_step_after_step():
    """--lora 4 at stages 1 and 3: the frozen weights gathered without their reduce-scatter. Each measured step
    (two) must send the plan's collectives: a unit whose weights are all frozen (gpt2-tiny's root under LoRA)
    gets no gradient, and must still be released after backward, or the next step finds it gathered and
    skips its gather (and holds it between steps)."""
    code, out, err = run_check("--model", "gpt2-tiny", "--stage", "1", "--stage", "3", "--world-sizes", "1,3",
                               "--lora", "4", "--json")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert [(c["stage"], c["world_size"]) for c in cells] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    assert_plan_holds(cells, 0.02)


@pytest.mark.slow
def test_hybrid_worlds_of_8_and_64_with_groups_of_8_are_planned_to_the_byte_and_within_2_percent():
    """--shard-group 8: at 8 ranks the group is the world (no replicas); at 64, 8 replicas of 8, whose
    gradient shards are all-reduced across the groups: the executed ledger (each entry with its group)
    must be the planned one, which has those all-reduces."""
    from zerofunc.plan import Plan, simulate
    code, out, err = run_check("--world-sizes", "8,64", "--shard-group", "8", "--stage", "1", "--stage", "2",
                               "--stage", "3", "--seq", "32", "--json")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert [(c["stage"], c["world_size"], c["shard_group"]) for c in cells] == [
        (s, n, 8) for s in (1, 2, 3) for n in (8, 64)]
    assert_plan_holds(cells, 0.02)
    for stage in (1, 2, 3):
        groups = {n: {e.group for e in simulate(Plan(world_size=n, stage=stage, model="gpt2-tiny", seq=32, micro_batch=4,
                                                     precision="fp32", hardware="cpu-gloo", shard_group=8)).ledger}
                  for n in (8, 64)}
        assert groups == {8: {"world"}, 64: {"shard", "replicas"}}


@pytest.mark.slow
def test_checkpointed_worlds_are_planned_to_the_byte_and_within_2_percent():
    """--activation-checkpointing full and selective-op at stages 0 and 3: each recomputed block runs again in
    backward (under stage 3 gathered again: the ledger's regathers), and its peak is planned with it. At 16 x 64
    tokens the activations make the peak: each mode's lies below the one without checkpointing, full's lowest."""
    peaks = {}
    for mode in ("none", "full", "selective-op"):
        code, out, err = run_check("--world-sizes", "1,3", "--stage", "0", "--stage", "3", "--seq", "64",
                                   "--micro-batch", "16", "--activation-checkpointing", mode, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["activation_checkpointing"] == mode
        assert_plan_holds(doc["cells"], 0.02)
        peaks[mode] = {(c["stage"], c["world_size"]): c["measured_peak"] for c in doc["cells"]}
    for cell in peaks["none"]:
        assert peaks["full"][cell] < peaks["selective-op"][cell] < peaks["none"][cell], (cell, peaks)


@pytest.mark.slow
def test_fp16_is_planned_with_its_loss_scaler():
    """fp16 unscales and all-reduces [sum of squares, found_inf] at the boundary; the plan must too."""
    code, out, err = run_check("--world-sizes", "8", "--stage", "1", "--stage", "3", "--precision", "fp16", "--json")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert_plan_holds(cells, 0.02)


def test_profiles_are_found_by_device_name_and_calibration_is_recorded(tmp_path, monkeypatch, capsys):
    """--calibrate (its measurement stood in for: no GPU here) writes the device's figures into the user's
    profiles file, over the shipped profile of that name; the package's profiles.json stays as shipped."""
    assert profile_for_device("NVIDIA H200").name == "h200-sxm"
    assert profile_for_device("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    with pytest.raises(ValueError, match="no hardware profile matches 'Tesla T4'"):
        profile_for_device("Tesla T4")
    shipped = Path(str(resources.files("sim").joinpath("profiles.json")))
    digest = hashlib.sha256(shipped.read_bytes()).hexdigest()
    before = get_profile("h200-sxm")
    user = tmp_path / "config" / "zerofunc" / "profiles.json"  # not there yet: --calibrate makes it
    monkeypatch.setenv("ZEROFUNC_PROFILES", str(tmp_path / "elsewhere.json"))  # --profiles must win
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr("zerofunc.check.calibrate.measure",
                        lambda device: {"flops": {"bf16": 7.9e14}, "memory_bandwidth": 4.3e12})
    assert check_main(["--calibrate", "--device", "cpu", "--profiles", str(user)]) == 2  # no GPU: nothing measured
    assert "measures a CUDA GPU" in capsys.readouterr().err and not user.exists()
    assert calibrate(torch.device("cuda", 0), None) == 0
    assert json.loads(capsys.readouterr().out)["file"] == str(user)
    written = json.loads(user.read_text())
    assert list(written) == ["h200-sxm"] and written["h200-sxm"]["flops"] == {"bf16": 7.9e14}
    assert "measured: flops, memory_bandwidth" in written["h200-sxm"]["sources"]
    after = get_profile("h200-sxm")
    assert after.flops == {**before.flops, "bf16": 7.9e14} and after.memory_bandwidth == 4.3e12
    assert after.memory_bytes == before.memory_bytes and after.intra_node == before.intra_node
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == digest


def _wide_gpt_cells():
    from zerofunc.check.cells import run_cell
    from zerofunc.models import GPTConfig
    from zerofunc.plan import Plan

    cfg = GPTConfig(n_layer=2, n_head=8, n_embd=512, vocab_size=256, block_size=128)
    return [run_cell(Plan(world_size=64, stage=s, model=cfg, precision="fp32", micro_batch=2, hardware="cpu-gloo"),
                     torch.device("cpu")).as_json() for s in range(4)]


@pytest.mark.slow
def test_a_wider_gpt_at_64_ranks():
    assert_plan_holds(in_fresh_process(_wide_gpt_cells), 0.02)


def _twin_world_collectives():
    """What the collectives leave behind in a simulated world of 4, through the project's communicator:
    by the rates of gloo it stands in for, and with every collective issued as an all-reduce."""
    from tests.worlds import COLLECTIVE_RULES
    from zerofunc.check.world import simulated_world

    out = []
    with simulated_world(4) as comm:
        stood_in = comm.link
        for link in (stood_in, COLLECTIVE_RULES["all-reduce"], COLLECTIVE_RULES["broadcast"]):
            comm.link = link
            comm.ledger.clear()
            gathered, scattered, summed = torch.zeros(8), torch.zeros(2), torch.arange(3.0)
            comm.all_gather(gathered, torch.tensor([1.0, 2.0]))
            comm.reduce_scatter(scattered, torch.arange(8.0))
            comm.all_reduce(summed)
            out.append((gathered.tolist(), scattered.tolist(), summed.tolist(),
                        [(e.op, e.nbytes, e.group_size) for e in comm.ledger]))
        try:
            with simulated_world(2):
                nested = "no error"
        except RuntimeError as e:
            nested = str(e)
    return out, nested, stood_in == get_profile("cpu-gloo").link(4)


def test_a_simulated_world_is_rank_0_among_twins():
    """Every rank holds rank 0's data: gathers tile its shard, a mean-reduce-scatter keeps its slice,
    on every torch (2.11's fake group leaves the reduce-scatter's output untouched; the world writes it),
    whichever op each collective is issued as. A CPU world chooses them by gloo's rates."""
    from sim.cost import issued_as
    from tests.worlds import COLLECTIVE_RULES
    runs, nested, gloo_rates = in_fresh_process(_twin_world_collectives)
    assert gloo_rates
    links = [get_profile("cpu-gloo").link(4), COLLECTIVE_RULES["all-reduce"], COLLECTIVE_RULES["broadcast"]]
    assert len(runs) == len(links)
    for link, (gathered, scattered, summed, ledger) in zip(links, runs):
        assert gathered == [1.0, 2.0] * 4
        assert scattered == [0.0, 1.0]
        assert summed == [0.0, 1.0, 2.0]
        gather, scatter = (issued_as(op, 32, 4, link) for op in ("all_gather", "reduce_scatter"))
        gathers = [("broadcast", 8, 4)] * 4 if gather == "broadcast" else [(gather, 32, 4)]
        assert ledger == [*gathers, (scatter, 32, 4), ("all_reduce", 12, 4)]
    assert "already running" in nested


def test_failures_name_what_disagrees():
    cell = Cell(stage=2, world_size=8, shard_group=8, planned_peak=1000, measured_peak=1000, planned_comm=64, measured_comm=64,
                ledger_equal=True, planned_step_s=0.0, planned_compute_s=0.0, losses=[1.0])
    assert cell.failures(0.05) == []
    cell.measured_peak = 940
    assert cell.failures(0.05) == ["peak planned/measured 1.0638, outside 5%"]
    cell.measured_peak, cell.measured_comm, cell.ledger_equal = 1000, 72, False
    assert cell.failures(0.05) == ["communication planned 64 B, executed 72 B"]
    cell.measured_comm, cell.losses = 64, [1.0, float("nan")]
    assert cell.failures(0.05) == ["the collectives differ (same bytes)", "non-finite loss [1.0, nan]"]


@pytest.mark.slow
def test_a_failing_cell_exits_1_and_is_named():
    """With no tolerance, the residual few kilobytes (the loss ops' CPU kernels against their meta ones) fail."""
    code, out, err = run_check("--world-sizes", "2", "--stage", "1", "--tolerance", "0")
    assert code == 1
    assert err.startswith("check failed: stage 1 x 2 ranks: peak planned/measured") and err.count("\n") == 1
    assert "stage" in out and "measured peak MiB" in out


def test_help_runs_from_a_checkout_anywhere(tmp_path):
    code, out, _ = run_check("--help", cwd=tmp_path)
    assert code == 0 and out.startswith("usage: python -m zerofunc.check")


@pytest.mark.parametrize("argv, message", [
    (["--world-sizes", "0,8"], "--world-sizes takes positive integers"),
    (["--activation-checkpointing", "some"], "argument --activation-checkpointing: invalid choice: 'some'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--world-sizes", "eight"], "--world-sizes takes positive integers"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--seq", "4096"], "does not fit the model's context of 256"),
    (["--micro-batch", "0"], "micro-batch must be at least 1"),
    (["--stage", "4"], "stage must be one of 0, 1, 2, 3"),
    (["--precision", "fp8"], "precision must be one of"),
    (["--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["--steps", "0"], "need --steps >= 1"),
    (["--shard-group", "0"], "--shard-group must be at least 1"),
    (["--shard-group", "3"], "a shard group of 3 ranks does not divide the world of 1"),
    (["--json-out", "/nonexistent/dir/x.json"], "its directory does not exist"),
    (["--lora", "4", "--lora-targets", "q_proj"], "selects no Linear or Conv1D layer"),
    pytest.param(["--device", "cuda"], "no CUDA device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    pytest.param(["--calibrate"], "--calibrate measures a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code = check_main(argv)  # in this process: bad input is refused before any world starts
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
