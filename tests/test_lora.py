"""LoRA with PEFT's semantics (zerofunc/lora.py): which layers it adapts, how the adapters start, that a LoRA
model trains like one device at every stage, and `python -m train --lora` (issue 32)."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import zerofunc
from tests.bare import in_world
from tests.steps import check_steps, ignore_some, record_step, recorded_steps
from tests.modules import OPTIM, TokenMLP, batches
from zerofunc.layout import ALIGN
from zerofunc.lora import LoRA, WithAdapters, adapter_value, apply_lora, targets
from zerofunc.models import build_model, model_config


def test_the_targets_are_peft_s():
    """all-linear: every Linear but the output head (Llama's lm_head; our GPT-2's head is tied, no Linear);
    layer names match a module name's last part; a regex matches whole names; none matching is refused."""
    with torch.device("meta"):
        llama = build_model(model_config("llama-tiny"))
        gpt = build_model(model_config("gpt2-tiny"))
    every = targets(llama, LoRA(4))
    assert every and "lm_head" not in every
    assert {n.rsplit(".", 1)[-1] for n in every} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"}
    assert {n.rsplit(".", 1)[-1] for n in targets(llama, LoRA(4, targets="q_proj,v_proj"))} == {"q_proj", "v_proj"}
    assert targets(llama, LoRA(4, targets=r"layers\.0\..*_proj")) == [n for n in every if n.startswith("layers.0.")]
    assert {n.rsplit(".", 1)[-1] for n in targets(gpt, LoRA(4))} == {"c_attn", "c_fc", "c_proj"}
    with pytest.raises(ValueError, match="selects no Linear or Conv1D"):
        apply_lora(gpt, LoRA(4, targets="q_proj"))


def test_an_adapted_model_starts_as_its_base_with_peft_s_adapters():
    """lora_A [r, in] drawn uniform within 1/sqrt(in) (kaiming-uniform with a = sqrt(5), PEFT's and
    nn.Linear's), lora_B [out, r] zeros: the adapted model's output is the base's to the last bit; every
    parameter but the adapters is frozen. Hugging Face's GPT-2 too, whose Conv1D stores its weight [in, out]."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=31,
                                                                 n_positions=16))
    ids = torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(0))
    model.eval()
    base = model(ids).logits
    names = apply_lora(model, LoRA(4, alpha=16))
    assert len(names) == 2 * 4  # c_attn, c_proj, c_fc, mlp.c_proj in each of 2 blocks
    assert torch.equal(model(ids).logits, base)
    attn = model.transformer.h[0].attn.c_attn
    assert attn.lora_A.weight.shape == (4, 16) and attn.lora_B.weight.shape == (48, 4)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    a = adapter_value("h.0.attn.c_attn.lora_A.weight", (64, 1024), seed=0)
    bound = 1 / math.sqrt(1024)
    assert a.abs().max() <= bound and a.abs().max() > 0.99 * bound and abs(a.mean()) < 0.05 * bound
    assert torch.equal(adapter_value("x.lora_B.weight", (3, 4), 0), torch.zeros(3, 4))
    assert adapter_value("x.weight", (3, 4), 0) is None


def test_an_adapted_layer_adds_its_scaled_low_rank_path():
    """PEFT's forward: base(x) + lora_B(lora_A(x)) * alpha / r, here on a Linear with A and B set at random
    (r 2, alpha 6: scaling 3), against the formula written out; dropout off in eval, on in training."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    apply_lora(model, LoRA(2, alpha=6, dropout=0.5))
    layer, x = model[0], torch.randn(4, 5)
    with torch.no_grad():
        layer.lora_A.weight.normal_()
        layer.lora_B.weight.normal_()
    model.eval()
    by_hand = x @ layer.weight.T + layer.bias + (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T) * 3
    assert torch.allclose(model(x), by_hand, rtol=1e-6, atol=1e-6)  # fp32, the same products summed apart
    model.train()
    assert not torch.allclose(model(x), by_hand)  # dropout on the adapter's input


def _lora_trains(stage: int, bf16: bool = False):
    torch.manual_seed(0)
    model = TokenMLP()
    apply_lora(model, LoRA(3, alpha=6, targets="1"))  # the blocks' Linear layers (blocks.K.1)
    reference = copy.deepcopy(model)
    if bf16:  # PEFT's model in bf16: the base in bf16, the adapters in fp32 (autocast_adapter_dtype)
        reference.to(torch.bfloat16)
        for name, p in reference.named_parameters():
            if p.requires_grad:
                p.data = p.data.float()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                         "zero_optimization": {"stage": stage}, "optimizer": OPTIM,
                                         "bf16": {"enabled": bf16}})
    steps = recorded_steps(engine, lambda rows, gen: batches("tokens", rows, gen), steps=2, seed=3)
    check_steps(reference, steps, f"LoRA, stage {stage}{', bf16' if bf16 else ''}")
    after = engine.full_parameters()
    moved = {n for n in after if n not in base and not torch.equal(after[n], steps[0].params[n])}
    kept = all(torch.equal(after[n], t.to(engine.units[-1].frozen.params.dtype).float()) for n, t in base.items())
    dtypes = {(u.params.dtype, u.frozen.params.dtype) for u in engine.units if u.numel}, {g.dtype for g in steps[0].grads.values()}
    return kept, moved, dtypes


def lora_at_every_stage():
    return [_lora_trains(stage) for stage in range(4)] + [_lora_trains(stage, bf16=True) for stage in (0, 3)]


@pytest.mark.slow
def test_lora_trains_like_one_device_at_every_stage():
    """3 gloo ranks, stages 0-3, 2 steps of 2 micro-steps: the adapters' gradients, AdamW and moments within
    tests/steps.py's budgets of one device training the same adapters, the base to the last bit, and both
    adapters of every target moved (lora_B from zero by the first step, lora_A from the second).

    And under bf16 at stages 0 and 3, PEFT's mixed precision: one device runs the base in bf16 and the
    adapters in fp32, so its gradient of each micro-batch is bit for bit the engine's only if the engine
    keeps the adapters in fp32 too (their weights, gradients, and their reduction: bf16 would round the
    reduced gradient far outside the fp32 budget)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    for per_stage in in_world(3, lora_at_every_stage):
        for (stage, half), (kept, moved, dtypes) in zip([(s, False) for s in range(4)] + [(0, True), (3, True)],
                                                        per_stage):
            assert kept, f"stage {stage}{', bf16' if half else ''}: a base weight changed"
            assert moved == {f"blocks.{i}.1.lora_{ab}.weight" for i in range(2) for ab in "AB"}, (stage, moved)
            # (trainable, frozen) weights' dtypes of each block (the root unit trains none); the gradients'
            assert dtypes == (({(fp32, bf16)}, {fp32}) if half else ({(fp32, fp32)}, {fp32})), (stage, half, dtypes)


@pytest.mark.slow
def test_the_trainer_trains_lora(tmp_path, tiny_data, monkeypatch):
    """`python -m train --lora 4` on 2 ranks at stage 3: it trains (the loss falls over 8 steps) and sends per
    step what the full fine-tune sends less the reduce-scatters of the frozen weights: its gathers are the
    whole model's plus the adapters', its reduce-scatters the adapters' alone (fp32, gpt2-tiny).

    With `--compile whole` (traced with aot_eager, as tests/test_whole_step.py's trainer test) it sends what
    the eager step sends, step for step, and its losses are the eager step's within that file's derived
    1e-5 (8 steps here, not 3: lr 1e-2 on adapters B that start at zero, and Adam's eps of 1e-8, amplify
    nothing the three steps there do not: measured 2026-11-28, 1.0e-07 on the default data)."""
    from train.cli import main

    monkeypatch.setenv("ZEROFUNC_COMPILE_BACKEND", "aot_eager")
    common = ["--model", "gpt2-tiny", "--steps", "8", "--nproc", "2", "--stage", "3", "--seq", "32",
              "--data", tiny_data]
    rows = {}
    lora_flags = ["--lora", "4", "--lr", "1e-2"]
    for name, extra in (("full", []), ("lora", lora_flags), ("lora-whole", lora_flags + ["--compile", "whole"])):
        assert main(common + extra + ["--out", str(tmp_path / name)]) == 0
        rows[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert rows["lora"][-1]["loss"] < rows["lora"][0]["loss"]
    for eager, whole in zip(rows["lora"], rows["lora-whole"], strict=True):
        assert whole["comm_volume_bytes"] == eager["comm_volume_bytes"], (eager, whole)
        assert abs(whole["loss"] - eager["loss"]) <= 1e-5 * abs(eager["loss"]), (eager, whole)
    with torch.device("meta"):
        model = build_model(model_config("gpt2-tiny"))
    everything = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoRA(4))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    full, lora = rows["full"][0]["comm_volume_bytes"], rows["lora"][0]["comm_volume_bytes"]
    # the ZeRO-paper volume of stage 3 is 3 x (the weights' bytes) per step (two gathers and one reduce-scatter,
    # each (N-1)/N of the bytes): LoRA's is 2 x (all weights) + 1 x (the adapters), up to the units' padding
    expected = (2 * (everything + adapters) + adapters) / (3 * everything)
    # each of the 1 + n_layer units' two buffers (trainable, frozen) pads to ALIGN x 2 ranks at most, in 3 volumes
    padding = 3 * 2 * (1 + model.cfg.n_layer) * ALIGN * 2 / (3 * everything)
    assert abs(lora / full - expected) <= padding, (lora, full, expected)


@pytest.mark.parametrize("flags, message", [
    (["--lora", "0"], "the LoRA rank must be at least 1"),
    (["--lora", "4", "--lora-targets", "q_proj"], "selects no Linear or Conv1D layer"),
    (["--lora", "4", "--lora-dropout", "1"], "the LoRA dropout must be in [0, 1)"),
])
def test_bad_lora_flags_are_one_line_and_write_nothing(tmp_path, capsys, flags, message):
    from train.cli import main

    out = tmp_path / "out"
    assert main(flags + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not out.exists()


def test_adapters_are_drawn_where_the_base_is_read():
    """The trainer's init with adapters: the adapters' values from (seed, name), the rest from the base init,
    by shard too (pretrained files read with read_into)."""
    class Base:
        def __call__(self, name, shape):
            return torch.full(shape, 7.0)

        def read_into(self, name, shape, lo, hi, out, memory):
            out.fill_(7.0)

    init = WithAdapters(Base(), seed=1)
    assert torch.equal(init("h.0.mlp.c_fc.weight", (2, 3)), torch.full((2, 3), 7.0))
    out = torch.empty(5)
    init.read_into("h.0.mlp.c_fc.lora_A.weight", (4, 3), 2, 7, out, None)
    assert torch.equal(out, adapter_value("h.0.mlp.c_fc.lora_A.weight", (4, 3), 1).reshape(-1)[2:7])


def test_the_planner_plans_lora_and_says_how_to_train_it(capsys):
    """`python -m zerofunc.plan --lora 4`: the JSON names the adapters and their count (those of apply_lora on
    the same model), the recommended command trains them, the frozen weights hold no optimizer state (the
    adapters' m and v, 8 bytes a parameter, are all there is: under bf16 the adapters are fp32 weights, their
    own master); bad LoRA flags are one line."""
    from zerofunc.plan.__main__ import main as plan_main

    argv = ["--model", "gpt2-tiny", "--world-size", "2", "--stage", "3", "--levers", "none", "--micro-batch", "1"]
    assert plan_main(argv + ["--lora", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = build_model(model_config("gpt2-tiny"))
    apply_lora(model, LoRA(4))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert out["lora"] == {"r": 4, "alpha": 8.0, "targets": "all-linear", "trained_params": trained}
    assert out["params"] == sum(p.numel() for p in model.parameters())
    assert out["recommended_command"][-7:-1] == ["--lora", "4", "--lora-alpha", "8.0", "--lora-targets", "all-linear"]
    units = 1 + model.cfg.n_layer  # each unit's adapters pad to ALIGN x 2 ranks at most
    assert 8 * trained / 2 <= out["stages"][0]["memory_bytes"]["optimizer"] <= 8 * (trained + units * ALIGN * 2) / 2
    for flags, message in ((["--lora", "4", "--lora-targets", "q_proj"], "selects no Linear or Conv1D"),
                           (["--lora", "0"], "the LoRA rank must be at least 1")):
        assert plan_main(argv + flags) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err


def _peft_model_trains(family: str, stage: int, checkpointing: bool):
    import peft

    from tests.test_hf import hf_model

    torch.manual_seed(0)
    targets = ["c_attn", "c_fc"] if family == "gpt2" else ["q_proj", "v_proj", "down_proj"]
    model = peft.get_peft_model(hf_model(family), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    reference = copy.deepcopy(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
              "zero_optimization": {"stage": stage}, "optimizer": OPTIM}
    if checkpointing:
        config["activation_checkpointing"] = {"mode": "full"}
    engine = zerofunc.initialize(model, config)
    rank, world = engine.comm.rank, engine.comm.world_size
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):
        ids = torch.randint(0, 53, (2 * world, 11), generator=gen)
        labels = ignore_some(ids, gen)
        everyone = [{"input_ids": ids[j:j + 1], "labels": labels[j:j + 1]} for j in range(2 * world)]
        steps.append(record_step(engine, everyone[rank::world], everyone))
    check_steps(reference, steps, f"PEFT {family}, stage {stage}")
    after = engine.full_parameters()
    moved = {n for n in after if n not in base and not torch.equal(after[n], steps[0].params[n])}
    return all(torch.equal(after[n], t) for n, t in base.items()), len(moved), len(after) - len(base)


def peft_models():
    return {(family, stage): _peft_model_trains(family, stage, stage == 3)
            for family in ("gpt2", "llama") for stage in (1, 3)}


@pytest.mark.slow
def test_a_peft_model_trains_through_initialize_like_peft_on_one_device():
    """Hugging Face's GPT-2 (Conv1D, fan_in_fan_out) and Llama wrapped by PEFT's get_peft_model, through
    zerofunc.initialize on 2 gloo ranks, stage 1 and stage 3 with full activation checkpointing, clipped, 2
    micro-steps: each step within tests/steps.py's budgets of one device running PEFT's model with exact AdamW
    (the adapters' gradients, update and moments), PEFT's base to the last bit, and every adapter moved."""
    pytest.importorskip("peft")
    for per_rank in in_world(2, peft_models):
        for (family, stage), (kept, moved, trained) in per_rank.items():
            assert kept, f"{family}, stage {stage}: a base weight changed"
            assert trained > 0 and moved == trained, (family, stage, moved, trained)
