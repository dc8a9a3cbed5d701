"""The planner against published runs: each run's configuration planned, side by side with what
its authors measured (tokens/s per GPU, memory), and the weak scaling between runs that differ only
in GPU count.

    python benchmarks/published.py [--json]

Nothing here is fitted: the profiles' figures come from datasheets and nccl-tests (their sources
are in sim/profiles.json), and these runs are the test of them. Where a figure of a run's hardware
is only known between bounds (the 500 W H100's peak), the row is also planned at each bound.

Every run is FSDP (ZeRO stage 3) in bf16 with AdamW; "published GiB" is the memory the run logged
(torchtitan: the allocator's peak reserved), against the planner's peak of live tensors. Where
transformers is installed, torchtitan's rows are also planned with its loss (whole fp32 logits).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.hardware import PROFILES_ENV, use_profiles  # noqa: E402
from zerofunc.models import model_config  # noqa: E402
from zerofunc.models.gpt2 import GPTConfig  # noqa: E402
from zerofunc.models.hf_config import hf_config_dict  # noqa: E402
from zerofunc.models.llama import LlamaConfig  # noqa: E402
from zerofunc.plan import Plan, simulate  # noqa: E402

TITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_A100 = "torchtitan docs/performance.md (64 A100 80GB; network not published)"
FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
# Llama 2's published shapes (their config.json), which zerofunc has no preset for
LLAMA2_13B = LlamaConfig(n_layer=40, n_head=40, n_embd=5120, intermediate_size=13824, vocab_size=32000,
                         block_size=4096, rms_norm_eps=1e-5, rope_theta=10000.0)
LLAMA2_70B = LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                         vocab_size=32000, block_size=4096, rms_norm_eps=1e-5, rope_theta=10000.0)

# MPT as llm-foundry benchmarked it: its benchmark configs (scripts/train/yamls/pretrain/mpt-*.yaml) set d_model,
# n_heads, n_layers, expansion_ratio 4, vocab_size 50368 and max_seq_len, and leave the rest at MPTConfig's defaults:
# learned positions (no ALiBi), biases on (no_bias false), LayerNorm, GELU, tied embeddings. That is GPT-2's
# architecture; the table's NumParams column says so to the parameter (tests/test_published.py).
MPT_7B = GPTConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=50368, block_size=2048)
MPT_13B = GPTConfig(n_layer=40, n_head=40, n_embd=5120, vocab_size=50368, block_size=2048)
MPT_70B = GPTConfig(n_layer=80, n_head=64, n_embd=8192, vocab_size=50368, block_size=2048)
# NumParams as the README's tables give them, at seq 2048
MPT_PARAMS = {MPT_7B: 6658859008, MPT_13B: 12853954560, MPT_70B: 64862437376}

# The published bounds of a peak known only between two parts (sim/profiles.json says why)
FLOPS_BOUNDS = {"h100-sxm-96gb-500w": {"H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
                                       "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}}}


@dataclass(frozen=True)
class Run:
    source: str
    label: str
    model: object
    hardware: str
    gpus: int
    micro_batch: int
    seq: int
    checkpointing: str      # zerofunc's: none, full, selective (one block in ac_every), selective-op
    tokens_per_s: float     # per GPU, published
    gib: Optional[float] = None
    unmodelled: tuple[str, ...] = field(default=())  # what the run did that the planner does not model
    grad_accum: int = 1
    reduce_dtype: Optional[str] = None  # gradients reduced in it (None: bf16, as the weights)

    def plan(self) -> Plan:
        return Plan(world_size=self.gpus, stage=3, model=self.model, precision="bf16", micro_batch=self.micro_batch,
                    grad_accum=self.grad_accum, seq=self.seq, hardware=self.hardware,
                    activation_checkpointing=self.checkpointing, reduce_dtype=self.reduce_dtype)

    @property
    def tokens_per_step(self) -> int:  # per GPU
        return self.micro_batch * self.grad_accum * self.seq


FOUNDRY_ATTENTION = ("llm-foundry runs its own FlashAttention (attn_impl flash), zerofunc's GPT PyTorch's SDPA "
                     "flash kernel: the same FLOPs, both priced at the profile's flash efficiency")
# torchtitan reduced gradients in fp32: its config of the time offered `--training.mixed_precision_reduce`
# float32 only (torchtitan/config_manager.py, choices=["float32"]); set 2026-11-27, after the rows had been
# planned with bf16 reductions (a run's configuration, not a profile's constant: the table says both)
TITAN_REDUCE = "fp32"
RUNS = [
    Run(TITAN_H100, "Llama-3.1-8B FSDP, 8 GPUs", "llama3-8b", "h100-sxm-96gb-500w", 8, 2, 8192, "selective-op",
        5762, 82.4),
    Run(TITAN_H100, "Llama-3.1-8B FSDP, 128 GPUs", "llama3-8b", "h100-sxm-96gb-500w", 128, 2, 8192, "selective-op",
        5605, 67.0),
    Run(TITAN_A100, "Llama-3-8B, selective layer AC", "llama3-8b", "a100-sxm", 64, 1, 8192, "selective", 2904),
    Run(TITAN_A100, "Llama-3-8B, selective op AC", "llama3-8b", "a100-sxm", 64, 1, 8192, "selective-op", 2973),
    Run(TITAN_A100, "Llama-3-70B, full AC", "llama3-70b", "a100-sxm", 64, 1, 8192, "full", 331),
    Run(TITAN_A100, "Llama-2-13B, no AC", LLAMA2_13B, "a100-sxm", 64, 2, 4096, "none", 2162),
    Run(TITAN_A100, "Llama-2-13B, selective layer AC", LLAMA2_13B, "a100-sxm", 64, 2, 4096, "selective", 1914),
    Run(TITAN_A100, "Llama-2-70B, full AC", LLAMA2_70B, "a100-sxm", 64, 2, 4096, "full", 353),
    # llm-foundry: A100 80GB nodes with 1600 Gbps between them (8 x 200 Gb/s, as a100-sxm), H100 80GB
    Run(FOUNDRY, "MPT-7B, no AC", MPT_7B, "a100-sxm", 8, 6, 2048, "none", 4641, None, (FOUNDRY_ATTENTION,), 2),
    Run(FOUNDRY, "MPT-7B, no AC", MPT_7B, "h100-sxm", 8, 6, 2048, "none", 10643, None, (FOUNDRY_ATTENTION,)),
    Run(FOUNDRY, "MPT-13B, no AC", MPT_13B, "a100-sxm", 8, 2, 2048, "none", 2262, None, (FOUNDRY_ATTENTION,), 3),
    Run(FOUNDRY, "MPT-13B, no AC", MPT_13B, "h100-sxm", 8, 2, 2048, "none", 4792, None, (FOUNDRY_ATTENTION,)),
    Run(FOUNDRY, "MPT-70B, full AC", MPT_70B, "a100-sxm", 64, 8, 2048, "full", 410, None, (FOUNDRY_ATTENTION,), 4),
    Run(FOUNDRY, "MPT-70B, full AC", MPT_70B, "h100-sxm", 64, 8, 2048, "full", 1039, None, (FOUNDRY_ATTENTION,), 4),
]
RUNS = [dataclasses.replace(r, reduce_dtype=TITAN_REDUCE) if r.source in (TITAN_H100, TITAN_A100) else r
        for r in RUNS]
# (label of the smaller run, label of the larger): runs that differ only in GPU count
WEAK_SCALING = [("Llama-3.1-8B FSDP, 8 GPUs", "Llama-3.1-8B FSDP, 128 GPUs")]


@contextlib.contextmanager
def flops_of(hardware: str, flops: dict):
    """Plan on `hardware` with its peak FLOP/s replaced: a user profiles file of one field, for now."""
    was = os.environ.get(PROFILES_ENV)
    mine = json.loads(Path(was).read_text()) if was and Path(was).is_file() else {}  # a measured profile stays
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "profiles.json"
        path.write_text(json.dumps({**mine, hardware: {**mine.get(hardware, {}), "flops": flops}}))
        os.environ[PROFILES_ENV] = str(path)
        try:
            yield
        finally:
            os.environ.pop(PROFILES_ENV) if was is None else os.environ.__setitem__(PROFILES_ENV, was)


def planned(run: Run) -> dict:
    sim = simulate(run.plan())
    return {"tokens_per_s": run.tokens_per_step / sim.step_s, "gib": sim.memory.peak / 2**30,
            "step_s": sim.step_s, "compute_s": sim.compute_s, "comm_s": sim.comm_s,
            "exposed_comm_s": sim.exposed_comm_s, "comm_slowed_s": sim.comm_slowed_s,
            "compute_by_bound": sim.compute_by_bound}


def hf_model(run: Run) -> torch.nn.Module:
    """The run's model as Hugging Face's LlamaForCausalLM of the same shape, on meta (transformers needed)."""
    import transformers
    config = transformers.AutoConfig.for_model(**hf_config_dict(model_config(run.model)))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def full_logits_gib(run: Run) -> Optional[float]:
    """The run's planned peak (GiB) with torchtitan's loss: the whole micro-batch's logits, their
    cross-entropy taken in fp32 (`cross_entropy(pred.flatten(0, 1).float(), ...)`), where zerofunc's models
    compute it chunk by chunk (zerofunc/lm_head.py). Planned on Hugging Face's LlamaForCausalLM of the
    same shape (`hf_model`), whose loss is computed so; None without transformers (an optional extra)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    return planned(dataclasses.replace(run, model=functools.partial(hf_model, run)))["gib"]


def row(run: Run) -> dict:
    out = {"source": run.source, "run": run.label, "hardware": run.hardware, "gpus": run.gpus,
           "published_tokens_per_s": run.tokens_per_s, "published_gib": run.gib,
           "unmodelled": list(run.unmodelled), **planned(run)}
    out["ratio"] = out["tokens_per_s"] / run.tokens_per_s
    out["published_step_s"] = run.tokens_per_step / run.tokens_per_s
    out["gib_full_logits"] = full_logits_gib(run) if run.gib and run.source == TITAN_H100 else None
    out["bounds"] = {}
    for part, flops in FLOPS_BOUNDS.get(run.hardware, {}).items():
        with flops_of(run.hardware, flops):
            out["bounds"][part] = planned(run)["tokens_per_s"] / run.tokens_per_s
    return out


def print_table(rows: list[dict]) -> None:
    head = (f"{'run':32} {'hardware':19} {'GPUs':>4} {'planned':>8} {'published':>9} {'ratio':>6} "
            f"{'at bounds':>11} {'step s':>6} {'compute':>7} {'published':>9} {'planned GiB':>11} {'published GiB':>13}")
    print(head)
    for r in rows:
        bounds = "-".join(f"{v:.2f}" for v in r["bounds"].values()) or "-"
        pub_gib = f"{r['published_gib']:.1f}" if r["published_gib"] else "-"
        print(f"{r['run']:32} {r['hardware']:19} {r['gpus']:>4} {r['tokens_per_s']:8,.0f} "
              f"{r['published_tokens_per_s']:9,.0f} {r['ratio']:6.2f} {bounds:>11} "
              f"{r['step_s']:6.2f} {r['compute_s']:7.2f} {r['published_step_s']:9.2f} {r['gib']:11.1f} {pub_gib:>13}")
    print("\ntokens/s per GPU; ratio = planned / published; at bounds: the ratio with the hardware's peak at "
          "each published bound;\nstep s: the planned step, of which compute (the roofline's, recomputation included), "
          "and the published step (its tokens over its tokens/s)")
    for small, large in WEAK_SCALING:
        a, b = (next(r for r in rows if r["run"] == label) for label in (small, large))
        print(f"weak scaling {a['gpus']} -> {b['gpus']} GPUs: planned {b['tokens_per_s'] / a['tokens_per_s']:.1%}, "
              f"published {b['published_tokens_per_s'] / a['published_tokens_per_s']:.1%}")
    for r in rows:
        if r["gib_full_logits"] is not None:
            print(f"memory, {r['run']}, with torchtitan's loss (the micro-batch's logits whole, in fp32; planned on "
                  f"Hugging Face's LlamaForCausalLM): {r['gib_full_logits']:.1f} GiB, published {r['published_gib']:.1f}")
    unmodelled = sorted({u for r in rows for u in r["unmodelled"]})
    for u in unmodelled:
        print(f"not modelled: {u}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    ap.add_argument("--profiles", default=None,
                    help="plan with this profiles file's figures over the shipped ones (a measured profile, e.g. "
                         "from benchmarks/op_constants.py --profiles-out)")
    args = ap.parse_args(argv)
    if args.profiles:
        use_profiles(args.profiles)
    rows = [row(run) for run in RUNS]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
