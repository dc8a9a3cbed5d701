"""The Llama family: published shapes, Hugging Face's parameter counts, names and logits, config.json loading.

Hugging Face's models are built from configs on the meta device or with random
weights (nothing is downloaded); the tests that need transformers skip without it,
and say so.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.bare import in_world
from zerofunc.models import MODELS, LlamaConfig, build_model, hf_config_dict, model_config, read_hf_config
from zerofunc.models.hf_config import from_hf_dict
from zerofunc.models.llama import RopeScaling

# The parameter counts the model cards publish (to the parameter): an expectation from
# outside this code base, so a wrong shape in a preset cannot pass by agreeing with itself.
PUBLISHED = {
    "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648, "gpt2-small": 124_439_808, "gpt2-xl": 1_557_611_200,
}


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter, counted once


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    with torch.device("meta"):
        assert count(build_model(model_config(name))) == PUBLISHED[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_preset_counts_like_hugging_face(name):
    transformers = pytest.importorskip("transformers")
    cfg = model_config(name)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)))
        ours = build_model(cfg)
    assert count(ours) == count(theirs)
    if isinstance(cfg, LlamaConfig):  # the same names, so a consolidated checkpoint loads into theirs strictly
        assert set(dict(ours.named_parameters())) <= set(theirs.state_dict())


@pytest.mark.parametrize("name", list(MODELS))
def test_config_json_round_trips(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_dict(model_config(name))))
    assert read_hf_config(path) == model_config(name) == model_config(str(path))


def variants() -> dict[str, LlamaConfig]:
    base = model_config("llama-tiny")
    return {
        "llama-tiny (GQA 6:2, odd MLP)": base,
        "llama3.1 rope scaling": replace(base, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16)),
        "qwen2 q/k/v biases, tied head": replace(base, qkv_bias=True, tie_word_embeddings=True, model_type="qwen2"),
        "mistral sliding window": replace(base, sliding_window=5, model_type="mistral"),
        "llama attention and MLP biases": replace(base, qkv_bias=True, o_bias=True, mlp_bias=True),
    }


def test_mistral_and_qwen2_have_no_bias_switches():
    """Hugging Face's Mistral and Qwen2 ignore attention_bias and mlp_bias (their layers' biases are fixed), so
    they change nothing here either (planted: reading them for every type gave Mistral biases it has not)."""
    for name in ("mistral-7b", "qwen2.5-7b"):
        assert from_hf_dict({**hf_config_dict(MODELS[name]), "attention_bias": True, "mlp_bias": True}) == MODELS[name]


@pytest.mark.parametrize("variant", list(variants()))
def test_logits_equal_hugging_face(variant):
    """Hugging Face's model with random weights, ours loaded with its state dict: the same logits."""
    transformers = pytest.importorskip("transformers")
    cfg = variants()[variant]
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_config_dict(cfg)), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)  # large enough that every component matters to the logits
    ours = build_model(cfg).eval()
    ours.load_state_dict({n: t for n, t in theirs.state_dict().items() if n != "lm_head.weight" or not
                          cfg.tie_word_embeddings}, strict=True)
    x = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(input_ids=x).logits
        diff = (ours(x) - ref).abs().max().item()
    # Sized, not derived: the same fp32 ops in another order differ by ulps (measured 0.0, bit for bit, in every
    # variant, 2026-11-26). A field our config writer drops, left at Hugging Face's default, moves them by
    # 1.25e-4 of the largest (rms_norm_eps 1e-6 for 1e-5: tests/plants.py config_writer_drops_rms_eps).
    assert diff <= 1e-5 * ref.abs().max().item(), f"{variant}: logits differ by {diff / ref.abs().max().item():.2e} of the largest"


@pytest.mark.parametrize("doc, message", [
    ({"model_type": "phi3"}, "model_type 'phi3' is not supported"),
    ({"model_type": "llama", "hidden_size": 64}, "missing field 'num_attention_heads'"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope type 'yarn' is not supported"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "num_key_value_heads": 4}, "not a multiple of n_kv_head 4"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "hidden_size": "wide"}, "'hidden_size' must be a positive integer"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "rope_scaling": "x"}, "'rope_scaling' must be an object"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "rope_theta": [1]}, "'rope_theta' must be a positive number"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "rms_norm_eps": None}, "'rms_norm_eps' must be a positive number"),
    # booleans are JSON's: "false" read as true tied the head and added biases; ints, not strings
    ({**hf_config_dict(MODELS["llama-tiny"]), "tie_word_embeddings": "false"},
     "'tie_word_embeddings' must be true or false, got 'false'"),
    ({**hf_config_dict(MODELS["llama-tiny"]), "attention_bias": "false"}, "'attention_bias' must be true or false"),
    ({**hf_config_dict(MODELS["gpt2-tiny"]), "tie_word_embeddings": 0}, "'tie_word_embeddings' must be true or false"),
    ({**hf_config_dict(MODELS["mistral-7b"]), "sliding_window": "4096"}, "'sliding_window' must be a positive integer"),
    # fields the builder does not read, at other than Hugging Face's default: refused, never built unfaithfully
    ({**hf_config_dict(MODELS["gpt2-tiny"]), "layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06 is not supported"),
    ({**hf_config_dict(MODELS["gpt2-tiny"]), "scale_attn_by_inverse_layer_idx": True},
     "scale_attn_by_inverse_layer_idx true is not supported"),
    ({**hf_config_dict(MODELS["gpt2-tiny"]), "reorder_and_upcast_attn": True}, "reorder_and_upcast_attn true is not"),
    ({**hf_config_dict(MODELS["gpt2-tiny"]), "scale_attn_weights": False}, "scale_attn_weights false is not supported"),
    ({**hf_config_dict(MODELS["gpt2-tiny"]), "layer_norm_epsilon": "1e-5"}, "'layer_norm_epsilon' must be a positive"),
    ({**hf_config_dict(MODELS["qwen2.5-7b"]), "use_sliding_window": True}, "use_sliding_window true is not supported"),
    ([1, 2], "holds a JSON list"),
])
def test_bad_config_json_is_one_line_in_the_planner_and_the_trainer(tmp_path, capsys, doc, message):
    from train.cli import main as train_main
    from zerofunc.plan.__main__ import main as plan_main
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    for main, argv in ((plan_main, ["--world-size", "2"]), (train_main, ["--steps", "1", "--out", str(tmp_path)])):
        assert main(["--model", str(path), *argv]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith("error: ") and message in out.err and out.err.count("\n") == 1
    assert list(tmp_path.iterdir()) == [path]  # nothing written


def engine_logits(run_dir: str, x: torch.Tensor) -> torch.Tensor:
    """The logits of the trainer's own engine, restored from the run's checkpoint on one rank."""
    import zerofunc
    from zerofunc import checkpoint
    with torch.device("meta"):
        model = build_model(model_config("llama-tiny"))
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                                 device="cpu")
    checkpoint.load(engine, run_dir)
    with torch.no_grad():
        return engine(x).numpy()  # by value: a tensor would travel as shared memory of a rank that has exited


@pytest.mark.slow
def test_a_trained_llama_consolidates_into_hugging_face_strictly(tmp_path, tiny_data):
    """python -m train --model llama-tiny at stage 3 on 2 ranks, then python -m zerofunc.consolidate:
    Hugging Face's LlamaForCausalLM loads the file with strict=True and gives the trainer's logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from train.cli import main as train_main
    from zerofunc.consolidate import main as consolidate

    run, out = tmp_path / "run", tmp_path / "llama.safetensors"
    assert train_main(["--model", "llama-tiny", "--stage", "3", "--nproc", "2", "--steps", "3", "--micro-batch", "2",
                       "--seq", "32", "--save-every", "3", "--out", str(run), "--device", "cpu",
                       "--data", tiny_data]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert consolidate([str(run), str(out)]) == 0
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in hf_config_dict(model_config("llama-tiny")).items() if k != "model_type"}))
    theirs.load_state_dict(load_file(str(out)), strict=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    ours = torch.from_numpy(in_world(1, engine_logits, str(run), x)[0])
    with torch.no_grad():
        ref = theirs.eval()(input_ids=x).logits
    diff = (ours - ref).abs().max().item()  # sized as in test_logits_equal_hugging_face (measured 0.0)
    assert diff <= 1e-5, f"the exported model's logits differ from the engine's by {diff:.2e}"
