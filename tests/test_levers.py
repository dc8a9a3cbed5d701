"""The memory levers: activation checkpointing and optimizer offload, planned as they train, and chosen.

That each lever trains exactly like training without it is a property in
tests/test_equivalence.py; here, that the planner sees what the trainer does with each
lever on, that offload moves the optimizer off the device, and that `--levers auto`
chooses well and says what it chose.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sim.memory import MemoryTracker
from tests.bare import in_world
from tests.steps import agreed_max
from tests.worlds import Case, global_batches
from train.cli import main as train_main
from zerofunc.comm import DistCommunicator
from zerofunc.config import ConfigError, parse
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPTConfig, LlamaConfig, build_model
from zerofunc.offload import OptimizerOffload
from zerofunc.optim import AdamWConfig
from zerofunc.plan import Plan, simulate
from zerofunc.plan.__main__ import main as plan_main
from zerofunc.recompute import ActivationCheckpointing
from zerofunc.stages import STAGES
from zerofunc.step import train_step

CASES = [Case(GPTConfig(n_layer=3, n_head=2, n_embd=10, vocab_size=23, block_size=12), seed=3, micro_batch=2, seq=11),
         Case(LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=16, intermediate_size=11, vocab_size=29,
                          block_size=12), seed=5, micro_batch=3, seq=9)]
LEVERS = [("full", 2, False), ("selective", 2, False), ("selective-op", 2, False), ("none", 2, True), ("full", 2, True)]


def executed(case: Case, stage: int, ac: str, every: int, offload: bool):
    comm = DistCommunicator()
    tracker = MemoryTracker(keep_timeline=True)
    with torch.device("meta"):
        model = build_model(case.cfg)
    engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(), memory=tracker,
                        init=lambda n, s: model.init_param(n, s, case.seed),
                        checkpointing=ActivationCheckpointing(ac, every), offload_optimizer=offload)
    mb = case.micro_batch
    x, y, _ = (t[comm.rank * mb:(comm.rank + 1) * mb] for t in global_batches(case, comm.world_size, 1)[0])
    with tracker:
        train_step(engine, [(x, y)])
    return comm.ledger.entries, tracker.report()


def check_levers_planned_as_trained() -> int:
    world, checked = torch.distributed.get_world_size(), 0
    for case in CASES:
        for stage in STAGES:
            plain_ledger, plain = executed(case, stage, "none", 2, False)
            for ac, every, offload in LEVERS:
                if offload and stage == 0:
                    continue
                what = f"{type(case.cfg).__name__} stage {stage} AC {ac} offload {offload}"
                ledger, measured = executed(case, stage, ac, every, offload)
                sim = simulate(Plan(world_size=world, stage=stage, model=case.cfg, precision="fp32", seq=case.seq,
                                    micro_batch=case.micro_batch, hardware="cpu-gloo", activation_checkpointing=ac,
                                    ac_every=every, offload_optimizer=offload), timeline=True)
                assert agreed_max(float(sim.ledger != ledger)) == 0, f"{what}: simulated ledger differs"
                err = agreed_max(abs(sim.memory.peak - measured.peak) / measured.peak)
                assert err <= 0.05, f"{what}: device peak simulated off by {err:.1%}"
                assert sim.memory.host_peak == measured.host_peak, f"{what}: host peak simulated wrong"
                # by what the weights' gathers move, whatever op carries them (on gloo, broadcasts)
                gathers = lambda entries: sorted((e.tag, e.op, e.nbytes) for e in entries  # noqa: E731
                                                 if e.tag.startswith("params."))
                assert gathers(ledger) == gathers(plain_ledger), f"{what}: the levers changed the gathers"
                assert stage == 0 or gathers(plain_ledger), f"{what}: no gathers to compare"
                if ac != "none":  # recomputation is marked in the timeline, for the plot
                    assert any(label == "recompute" for label, _, _ in sim.memory.timeline), what
                if offload:  # the optimizer leaves the device: m and v (fp32: the master was the weights)
                    assert measured.max_by_category["optimizer"] == 0 and measured.host_max_by_category["optimizer"] > 0
                    states = measured.host_max_by_category["optimizer"]  # master, m, v: 3 x 4 bytes per element
                    # "other" left out: the step's scalar all-reduces (the 8-byte token count) may still be held by a
                    # gloo worker at the peak in one run and not the other (seen: 8 B, 1 run in ~15)
                    fell = (plain.peak - plain.at_peak["other"]) - (measured.peak - measured.at_peak["other"])
                    assert fell >= 2 * states // 3, f"{what}: the device peak did not fall"
                checked += 1
    return checked


@pytest.mark.slow
def test_each_lever_is_planned_as_it_trains():
    """2 gloo ranks, a GPT and a Llama of odd sizes, every stage with each lever on: the same
    collectives to the byte, the device peak within 5%, the host peak to the byte; checkpointing
    gathers no more than without (one gather serves recompute and backward); offload's device
    peak falls by at least m and v."""
    assert in_world(2, check_levers_planned_as_trained) == [2 * (4 * 3 + 3 * 2)] * 2


def _ops_and_gradients(ac: str, stage: int):
    """One step of CASES[0]'s GPT (3 blocks of 4 matmuls and one attention each) with `ac`: how many matmuls
    and attention forwards ran, and the gradients."""
    case = CASES[0]
    comm = DistCommunicator()
    with torch.device("meta"):
        model = build_model(case.cfg)
    engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(), init=lambda n, s: model.init_param(n, s, case.seed),
                        checkpointing=ActivationCheckpointing(ac))
    x, y, _ = global_batches(case, 1, 1)[0]
    with _Ops() as ops:
        loss = engine(x, y)
        engine.backward(loss)
    grads = engine.full_gradients()
    matmuls = sum(ops.names.count(n) for n in ("mm.default", "addmm.default"))
    attention = sum(n.startswith("_scaled_dot_product") and "backward" not in n for n in ops.names)
    return matmuls, attention, grads


def op_selective_counts():
    """Per (mode, stage): the matmuls, the attention forwards, and whether the gradients are those without
    checkpointing to the bit (compared here: tensors do not come back from a rank)."""
    runs = {(ac, stage): _ops_and_gradients(ac, stage) for ac in ("none", "full", "selective-op") for stage in (0, 3)}
    return {key: (mm, att, all(torch.equal(g[n], runs["none", key[1]][2][n]) for n in g))
            for key, (mm, att, g) in runs.items()}


def test_op_selective_checkpointing_recomputes_all_but_the_attention_and_every_second_matmul():
    """One rank, stages 0 and 3, a GPT of 3 blocks, each: the qkv matmul, attention, its projection, the MLP's
    two matmuls. Recomputation stops once backward has what it needs (torch's non-reentrant checkpoint), and
    no backward needs a block's last matmul's output: full checkpointing runs 3 matmuls and the attention of
    each block again, selective-op, keeping the attention's output and the 1st and 3rd matmuls', runs only
    the 2nd (torchtitan's policy); both recompute the head's logits chunk (zerofunc/lm_head.py: one chunk
    here). The gradients are those without checkpointing, bit for bit (the same ops on the same values)."""
    blocks = CASES[0].cfg.n_layer
    got = in_world(1, op_selective_counts)[0]
    for stage in (0, 3):
        (none_mm, none_att, _), (full_mm, full_att, _), (op_mm, op_att, same) = (
            got[ac, stage] for ac in ("none", "full", "selective-op"))
        assert (full_mm - none_mm, full_att - none_att) == (3 * blocks + 1, blocks), (stage, got)
        assert (op_mm - none_mm, op_att - none_att) == (blocks + 1, 0), (stage, got)
        assert same, f"stage {stage}: the gradients differ from those without checkpointing"


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_offloaded_update_is_one_fused_pass_and_matches_the_reference():
    """The host update is torch's fused AdamW over the flat shard, not the reference's separate
    passes, and agrees with the reference to a few ulps (the 1e-6 of tests/bare.close)."""
    from tests.bare import close
    from zerofunc.fused import adamw_reference_
    cfg, n = AdamWConfig(lr=1e-2, weight_decay=0.1), 1001
    gen = torch.Generator().manual_seed(0)
    master, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = [t.clone() for t in (master, m, v)]
    offload = OptimizerOffload(torch.device("cpu"), MemoryTracker())
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        staging = grad.clone()
        with _Ops() as ops:
            offload.update(master, staging, m, v, step, cfg, None, 0.5, out)
        adamw_reference_(ref[0], grad, ref[1], ref[2], step, cfg, grad_scale=0.5)
        assert ops.names.count("_fused_adamw_.default") == 1
        assert not {"lerp_.Scalar", "addcdiv_.default", "sqrt.default"} & set(ops.names), ops.names
    for ours, theirs in zip((master, m, v), ref):
        ok, diff, tol = close(ours, theirs)
        assert ok, f"offloaded AdamW differs by {diff:.2e} (tolerance {tol:.2e})"
    assert torch.equal(out, master.to(torch.bfloat16))  # the new weights went up, rounded


def test_plan_chooses_levers_and_says_what_they_cost(capsys):
    """--levers auto: the recommendation fits, has the most tokens/s of the rows that fit, runs the largest
    power-of-two micro-batch that fits, and the same plan without each of its levers uses more memory."""
    capacity = 8.9e6  # at 256 tokens: nothing fits without a lever
    code = plan_main(["--model", "llama-tiny", "--world-size", "2", "--seq", "256", "--gpu-memory",
                      str(capacity / 2**30), "--hardware", "cpu-gloo", "--precision", "fp32", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    best, rows = doc["recommended"], doc["stages"]
    assert {(r["activation_checkpointing"], r["offload_optimizer"]) for r in rows} >= {("full", "cpu"), ("none", "none")}
    assert best is not None and best["fits"]
    levers = (best["activation_checkpointing"] != "none") + (best["offload_optimizer"] == "cpu")
    assert levers and len(doc["lever_costs"]) == levers
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in rows if r["fits"])
    assert not any(r["fits"] for r in rows if (r["activation_checkpointing"], r["offload_optimizer"]) == ("none", "none"))
    plan = Plan(world_size=2, stage=best["stage"], model="llama-tiny", seq=256, precision="fp32", hardware="cpu-gloo",
                micro_batch=best["micro_batch"], activation_checkpointing=best["activation_checkpointing"],
                ac_every=best["ac_every"] or 2, offload_optimizer=best["offload_optimizer"] == "cpu")
    assert simulate(plan).memory.peak <= capacity < simulate(replace(plan, micro_batch=2 * plan.micro_batch)).memory.peak
    assert best["micro_batch"] & (best["micro_batch"] - 1) == 0
    assert doc["lever_costs"] and all(c["without_it"]["memory_bytes"]["peak"] > best["memory_bytes"]["peak"]
                                      for c in doc["lever_costs"])
    code = plan_main(["--model", "llama-tiny", "--world-size", "2", "--seq", "256", "--gpu-memory",
                      str(capacity / 2**30), "--hardware", "cpu-gloo", "--precision", "fp32"])
    out = capsys.readouterr().out
    assert code == 0 and f"levers: {plan.levers}" in out and "what its levers cost" in out


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "does not offload parameters"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "does not offload to NVMe"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "needs stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "offload_optimizer.ratio"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "cpu_checkpointing"),
    ({"activation_checkpointing": {"mode": "some"}}, "must be one of none, full, selective"),
    ({"activation_checkpointing": {"every": 0}}, "K >= 1"),
    ({"activation_checkpointing": {"partition": True}}, "unknown config key 'activation_checkpointing.partition'"),
])
def test_lever_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        parse({"train_batch_size": 2, **config}, 2)


def test_lever_config_is_read_as_deepspeed_writes_it():
    cfg = parse({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                 "pin_memory": True}}, "activation_checkpointing": {"partition_activations": False}}, 2)
    assert cfg.offload_optimizer and cfg.checkpointing == ActivationCheckpointing("full")
    assert set(cfg.ignored) == {"zero_optimization.offload_optimizer.pin_memory",
                                "activation_checkpointing.partition_activations"}
    assert parse({"train_batch_size": 2, "zero_optimization": {"stage": 1, "cpu_offload": True}}, 2).offload_optimizer
    plain = parse({"train_batch_size": 2, "zero_optimization": {"offload_param": {"device": "none"}}}, 2)
    assert not plain.offload_optimizer and not plain.checkpointing.on


@pytest.mark.parametrize("argv, message", [
    (["--stage", "0", "--offload-optimizer", "cpu"], "needs stage 1, 2 or 3"),
    (["--ac-every", "0"], "--ac-every must be at least 1"),
    (["--activation-checkpointing", "full", "--ac-every", "3"], "--ac-every chooses the blocks of selective"),
])
def test_train_lever_bad_input(capsys, tmp_path, argv, message):
    code = train_main([*argv, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
