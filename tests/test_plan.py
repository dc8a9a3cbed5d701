"""The planner predicts what the trainer does: same collectives, same bytes, same memory."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sim.memory import MemoryTracker
from tests.bare import in_world
from tests.steps import agreed_max
from tests.worlds import IN_RANK, global_batches, small_cases
from train.cli import main as train_main
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.layout import ALIGN, FlatLayout
from zerofunc.lora import LoRA, WithAdapters, apply_lora
from zerofunc.models import GPTConfig, build_model
from zerofunc.optim import AdamWConfig
from zerofunc.plan import MAX_MICRO_BATCH, Plan, simulate
from zerofunc.plan.__main__ import main as plan_main
from zerofunc.plan.report import EAGER_NOTE
from zerofunc.stages import STAGES
from zerofunc.step import train_step
from zerofunc.units import PRECISIONS, partition

STATES = ("params", "grads", "optimizer")


def executed_step(case, stage, grad_accum=1, lora=None):
    """One real train_step of `grad_accum` micro-steps on this rank, watched by the same tracker the
    planner uses; with `lora`, of the model's adapters (zerofunc/lora.py)."""
    comm = DistCommunicator()
    tracker = MemoryTracker()
    with torch.device("meta"):
        model = build_model(case.cfg)
    init = lambda n, s: model.init_param(n, s, case.seed)  # noqa: E731
    if lora is not None:
        apply_lora(model, lora)
        init = WithAdapters(init, case.seed)
    engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(), memory=tracker, grad_accum=grad_accum,
                        init=init)
    mb, world = case.micro_batch, comm.world_size
    x, y, _ = global_batches(case, world * grad_accum, 1)[0]
    batches = [(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for i in range(world * grad_accum)]
    with tracker:
        train_step(engine, batches[comm.rank::world])
    return comm.ledger.entries, tracker.report()


def check_simulation_matches_execution(max_examples, lora=None):
    world = torch.distributed.get_world_size()

    @settings(IN_RANK, max_examples=max_examples)
    @given(case=small_cases(), grad_accum=st.integers(1, 3))
    def prop(case, grad_accum):
        if isinstance(case.cfg, GPTConfig):  # dropout masks are random: the planner sees none
            case = replace(case, cfg=replace(case.cfg, dropout=0.0))
        for stage in STAGES:
            executed, measured = executed_step(case, stage, grad_accum, lora)
            sim = simulate(Plan(world_size=world, stage=stage, model=case.cfg, precision="fp32",
                                micro_batch=case.micro_batch, grad_accum=grad_accum, seq=case.seq,
                                hardware="cpu-gloo", lora=lora))
            assert agreed_max(float(sim.ledger != executed)) == 0, f"stage {stage}: simulated ledger differs"
            for c in STATES:
                err = agreed_max(abs(sim.memory.max_by_category[c] - measured.max_by_category[c])
                                 / measured.max_by_category[c])
                assert err <= 0.01, f"stage {stage}: {c} simulated off by {err:.1%} on some rank"
            err = agreed_max(abs(sim.memory.peak - measured.peak) / measured.peak)
            assert err <= 0.05, f"stage {stage}: peak simulated off by {err:.1%} on some rank"

    prop()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_simulated_step_is_the_executed_step(world_size):
    assert all(in_world(world_size, check_simulation_matches_execution, 3))


@pytest.mark.slow
def test_a_lora_plan_is_the_lora_step():
    """LoRA (issue 32), on 3 ranks, 2 drawn models, stages 0-3: the planner, which builds the same adapted model,
    issues the trainer's collectives to the byte (gathers of the frozen weights, reduce-scatters of the
    adapters alone) and counts its memory as the test above holds it (the frozen weights in params, no
    optimizer state or gradient for them)."""
    lora = LoRA(2, targets="c_fc,q_proj,down_proj")  # a layer of each family (zerofunc's GPT-2, Llama)
    assert all(in_world(3, check_simulation_matches_execution, 2, lora))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 10**7), world=st.integers(1, 1024), stage=st.sampled_from([0, 1, 2, 3]),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]))
def test_params_only_plan_is_the_closed_form(n, world, stage, precision):
    """--params: bytes per parameter 2+2+12 in mixed precision, 4+4+8 in fp32, sharded as the stage says."""
    sim = simulate(Plan(world_size=world, stage=stage, model=None, params=n, precision=precision))
    shard = -(-n // (world * ALIGN)) * ALIGN  # ceil(n / world), rounded up to 16 elements (zerofunc.layout)
    padded = shard * world  # the flat buffer, padded to split evenly into such shards
    weight, opt = (4, 8) if precision == "fp32" else (2, 12)
    expected = {"params": weight * (shard if stage >= 3 else padded),
                "grads": weight * (shard if stage >= 2 else padded),
                "optimizer": opt * (shard if stage >= 1 else padded)}
    assert {c: sim.memory.max_by_category[c] for c in STATES} == expected


@pytest.mark.parametrize("stage, per_param", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n),
                                              (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
def test_params_only_plan_matches_the_paper(stage, per_param):
    """DESIGN.md's formulas, exactly, in Ψp: Ψ padded so that each of N shards is a multiple of 16
    elements. For Ψ = 10^9 that adds nothing at 1 and 8 ranks (10^9 / 128 is whole) and 512
    elements at 64 (15625008 a rank instead of 15625000), 5e-7 of Ψ."""
    psi = 10**9
    for world, padding in ((1, 0), (8, 0), (64, 512)):
        psi_p = psi + padding
        assert FlatLayout.build([("weight", (psi,))], world).padded_numel == psi_p
        sim = simulate(Plan(world_size=world, stage=stage, model=None, params=psi, precision="bf16"))
        assert sim.memory.model_states == per_param(world) * psi_p
        factor = 3 if stage == 3 else 2
        zero_traffic = sum(e.volume_bytes for e in sim.ledger if e.tag not in ("metrics", "grad_norm"))
        assert zero_traffic == factor * 2 * psi_p  # besides the logged loss and the squared norm's 4 bytes


def full_gradient_bytes(plan: Plan) -> int:
    """One whole local gradient of the model, from the layout (each unit padded to split evenly), not
    from a simulation: what stages 0 and 1 keep."""
    model = plan.build()
    units = partition(model, model.shard_units() if hasattr(model, "shard_units") else [])
    padded = sum(FlatLayout.build([(n, p.shape) for n, p in named], plan.world_size).padded_numel
                 for _, _, named in units)
    return padded * PRECISIONS[plan.precision].itemsize


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_stage_1_counts_its_whole_gradient_as_grads(model, precision, world):
    """The paper's table: stage 1 keeps the whole gradient (4Ψ in fp32, 2Ψ in 16-bit), as stage 0 does.
    It is reduce-scattered into its own slice, so the reduced shard is part of it, not more; what the
    planner puts under buffers at stage 1 is no more than a shard of it (the collective's output)."""
    plan = Plan(world_size=world, stage=1, model=model, precision=precision, seq=16)
    full = full_gradient_bytes(plan)
    stage1 = simulate(plan, timing=False).memory
    stage0 = simulate(replace(plan, stage=0), timing=False).memory
    assert stage1.max_by_category["grads"] == stage0.max_by_category["grads"] == full
    assert stage1.max_by_category["buffers"] <= full // world


def test_plan_reports_stage_1_gradient_as_grads_in_table_and_json(capsys):
    """gpt2-small: a gradient of 0.23 GiB, large enough for the table's two decimals to tell."""
    argv = ["--model", "gpt2-small", "--world-size", "4", "--seq", "64", "--levers", "none"]
    full = full_gradient_bytes(Plan(world_size=4, stage=1, model="gpt2-small", seq=64))
    code, out, _ = run_plan(capsys, *argv, "--json")
    assert code == 0
    memory = {s["stage"]: s["memory_bytes"] for s in json.loads(out)["stages"]}
    assert memory[0]["grads"] == memory[1]["grads"] == full and memory[2]["grads"] == memory[3]["grads"] == full // 4
    psi = full // 2  # bf16; padded elements
    assert memory[1]["model_states"] == 2 * psi + 2 * psi + 12 * psi // 4  # the paper's (2 + 2 + K/N) Ψ
    code, out, _ = run_plan(capsys, *argv)
    assert code == 0
    header = next(line.split() for line in out.splitlines() if line.startswith("stage"))
    rows = {int(r[0]): r for r in (line.split() for line in out.splitlines()) if r and r[0] in ("0", "1", "2", "3")}
    at = header.index("grads")
    assert rows[1][at] == rows[0][at] == f"{full / 2**30:.2f}"


def run_plan(capsys, *argv):
    code = plan_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_schema_and_recommendation(capsys):
    # 0.075 GiB (80.5 MB): one sequence fits every stage (73.5-76.4 MB at micro-batch 1), a few more do
    code, out, _ = run_plan(capsys, "--model", "gpt2-tiny", "--world-size", "2", "--seq", "64", "--json",
                            "--gpu-memory", "0.075", "--levers", "none")
    assert code == 0
    doc = json.loads(out)
    assert [s["stage"] for s in doc["stages"]] == [0, 1, 2, 3]
    for s in doc["stages"]:
        m = s["memory_bytes"]
        assert m["model_states"] == m["params"] + m["grads"] + m["optimizer"]
        categories = [m[c] for c in ("params", "grads", "optimizer", "activations", "buffers", "other")]
        assert max(categories) <= m["peak"] <= sum(categories)  # categories peak at different moments
        assert s["fits"] == (m["peak"] <= doc["capacity_bytes"])
        assert s["comm"]["volume_bytes"] > 0
    fitting = [s for s in doc["stages"] if s["fits"]]
    if fitting:
        best = min(fitting, key=lambda s: (s["step_time_s"], s["memory_bytes"]["peak"]))
        assert doc["recommended_stage"] == best["stage"]
    else:
        assert doc["recommended_stage"] is None
    # The largest micro-batch that fits really fits, and one more does not.
    assert all(1 < s["max_micro_batch"] < MAX_MICRO_BATCH for s in doc["stages"])  # else the check is vacuous
    for s in doc["stages"]:
        mb = s["max_micro_batch"]
        if mb:
            plan = Plan(world_size=2, stage=s["stage"], model="gpt2-tiny", seq=64, micro_batch=mb)
            assert simulate(plan).memory.peak <= doc["capacity_bytes"] < simulate(replace(plan, micro_batch=mb + 1)).memory.peak


def test_plan_table_and_plot(capsys, tmp_path):
    png = tmp_path / "timeline.png"
    code, out, _ = run_plan(capsys, "--model", "gpt2-tiny", "--world-size", "4", "--stage", "1", "--stage", "3",
                            "--seq", "32", "--plot", str(png), "--levers", "none")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"] and "recommended: stage" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5", "--world-size", "2"], "unknown model 'gpt5'"),
    (["--world-size", "0"], "world size must be at least 1"),
    (["--world-size", "2", "--seq", "2048"], "does not fit the model's context of 1024"),
    (["--world-size", "2", "--gpu-memory", "-3"], "--gpu-memory must be positive"),
    (["--world-size", "2", "--stage", "5"], "stage must be one of 0, 1, 2, 3"),
    (["--world-size", "2", "--precision", "fp8"], "precision must be one of"),
    (["--world-size", "2", "--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["--world-size", "2", "--params", "0"], "--params must be at least 1"),
])
def test_plan_bad_input(capsys, tmp_path, argv, message):
    png = tmp_path / "never.png"
    code, out, err = run_plan(capsys, *argv, "--plot", str(png))
    assert code == 2 and out == "" and not png.exists()
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("stage, grad_accum", [(0, 1), (1, 1), (2, 1), (3, 1), (1, 3), (3, 2)])
def test_trainer_reports_what_the_planner_predicts(capsys, tmp_path, stage, grad_accum, tiny_data):
    """python -m train's logged volume and peak against python -m zerofunc.plan's, with accumulation too."""
    out = tmp_path / "run"
    assert train_main(["--model", "gpt2-tiny", "--stage", str(stage), "--nproc", "2", "--steps", "2",
                       "--micro-batch", "2", "--grad-accum", str(grad_accum), "--seq", "32", "--out", str(out),
                       "--device", "cpu", "--data", tiny_data]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    code, doc, _ = run_plan(capsys, "--model", "gpt2-tiny", "--world-size", "2", "--stage", str(stage),
                            "--micro-batch", "2", "--grad-accum", str(grad_accum), "--seq", "32", "--precision",
                            "fp32", "--hardware", "cpu-gloo", "--json", "--levers", "none")
    planned = json.loads(doc)["stages"][0]
    for row in rows:
        assert row["comm_volume_bytes"] == planned["comm"]["volume_bytes"]
        assert abs(row["peak_bytes"] - planned["memory_bytes"]["peak"]) <= 0.05 * row["peak_bytes"]


def test_world_size_auto_finds_the_fewest_ranks_that_fit(capsys):
    """For each stage the answer fits and the candidate below it does not, checked by simulating both;
    the recommendation is the fewest ranks over all stages."""
    # llama-tiny at 64 tokens: model states of ~7 MiB must be spread over several ranks, beside the
    # default GPU's matmul workspaces (sim/kernel_memory.py), which every rank keeps whatever its share
    ws = Plan(world_size=1, stage=0, model="llama-tiny", seq=64).profile.matmul_workspace
    capacity = 3 * 2**20 + 2 * ws.cublas + ws.cublaslt
    code, out, _ = run_plan(capsys, "--model", "llama-tiny", "--world-size", "auto", "--gpus-per-node", "4",
                            "--max-world-size", "64", "--seq", "64", "--gpu-memory", str(capacity / 2**30), "--json",
                            "--levers", "none")
    assert code == 0
    doc = json.loads(out)
    candidates = [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64]
    found = {}
    for s in doc["stages"]:
        n = s["world_size"]
        peak = lambda k: simulate(Plan(world_size=k, stage=s["stage"], model="llama-tiny", seq=64)).memory.peak
        if s["none_fit_up_to_this_world_size"]:
            assert n == 64 and not s["fits"] and peak(64) > capacity
            continue
        assert n in candidates and s["fits"] and peak(n) <= capacity
        if n > 1:
            assert peak(candidates[candidates.index(n) - 1]) > capacity
        found[s["stage"]] = n
    assert found.get(3, 0) > 1, "the capacity should make stage 3 need several ranks"
    row = {s["stage"]: s for s in doc["stages"]}
    best = min(found, key=lambda st: (found[st], round(row[st]["step_time_s"], 9), row[st]["memory_bytes"]["peak"]))
    assert (doc["recommended_stage"], doc["recommended_world_size"]) == (best, found[best])


def test_world_size_list_plans_every_size(capsys):
    code, out, _ = run_plan(capsys, "--model", "llama-tiny", "--world-size", "3,1", "--stage", "2", "--stage", "3",
                            "--seq", "16", "--levers", "none")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "1"), ("3", "1"), ("2", "3"), ("3", "3")]
    assert "recommended: stage" in out and "on 1 ranks" in out


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "2,x"], "--world-size takes a number, a comma-separated list or auto"),
    (["--world-size", "auto", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--world-size", "auto", "--max-world-size", "0"], "--max-world-size must be at least 1"),
    (["--world-size", "4,0"], "world size must be at least 1"),
])
def test_world_size_bad_input(capsys, argv, message):
    code, out, err = run_plan(capsys, "--model", "llama-tiny", *argv)
    assert code == 2 and out == "" and err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("hardware, says_eager", [("h100-sxm", True), ("cpu-gloo", False)])
def test_plan_says_it_planned_eager_where_the_trainer_compiles(capsys, hardware, says_eager):
    """The trainer compiles by default on CUDA and a plan simulates the eager step: a GPU's plan says so."""
    argv = ["--model", "gpt2-tiny", "--world-size", "2", "--stage", "0", "--hardware", hardware]
    code, out, _ = run_plan(capsys, *argv)
    assert code == 0 and (EAGER_NOTE in out) == says_eager
    code, out, _ = run_plan(capsys, *argv, "--json")
    assert code == 0 and json.loads(out)["compiled"] is False
