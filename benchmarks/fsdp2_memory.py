"""What FSDP2 itself keeps live at a published run's configuration, beside the planner's peak and the
published figure: which part of a gap between plan and publication is the trainer, and which the allocator.

    python benchmarks/fsdp2_memory.py [--breakdown] [--device cuda] [--no-plan] [--json-out FILE]

For each published run that logged its memory (torchtitan's Llama-3.1-8B on 8 and 128 H100s), the run's
configuration is rebuilt with torch's own FSDP2 as torchtitan's `parallelize_llama` applied it at the
published commit (9dec370): each block `fully_shard`ed, resharded after forward but the last, then the root;
bf16 weights, gradients reduced in fp32; each block wrapped by `checkpoint_wrapper` under the run's policy
(selective-op: torchtitan's, keep attention and every second matmul, zerofunc.recompute's own, which also
names CPU's flash kernel); AdamW with foreach. One process stands for one rank, in a fake process group of
the run's size (this rank allocates what a rank of that world would; nothing is sent). Each run is taken
with two modules: Hugging Face's LlamaForCausalLM of the same shape, whose loss is torchtitan's (the
micro-batch's logits whole, in fp32), and zerofunc's Llama (its loss chunk by chunk). Beside it, the
planner's peak of live tensors for zerofunc's step on the same module (`benchmarks/published.py`), and the
published figure (torchtitan logs the allocator's peak reserved; its launcher set expandable segments).

`--device fake` (the default, any CPU): fake tensors, and torch's `FSDPMemTracker` counts the live tensors
of one step's forward and backward, after a first step made the optimizer's moments. The update is outside
the tracked window: under fake tensors the tracker counts foreach AdamW's temporaries on DTensors at several
times the moments (100 GiB at 8 GPUs), which no run could hold; the update's real live set (the shards of
weights, gradients, moments, and a shard of temporaries) is a quarter of the backward's peak at these shapes.

`--device cuda`: real tensors on GPU 0 (weights left uninitialised: values do not change what is allocated),
and the caching allocator's peaks, allocated and reserved, over two whole steps after a first, as
torchtitan logged them; set PYTORCH_CUDA_ALLOC_CONF as the run did (benchmarks/cuda_checks.sh part
`fsdp2-memory` runs both). transformers is needed (an optional extra).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from published import RUNS, Run, full_logits_gib, hf_model, planned  # noqa: E402
from zerofunc.api import default_units  # noqa: E402
from zerofunc.models import build_model, model_config  # noqa: E402
from zerofunc.recompute import ActivationCheckpointing, keep_attention_and_every_second_matmul  # noqa: E402

GIB = 2**30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, None: torch.bfloat16}


def zerofunc_module(run: Run) -> nn.Module:
    with torch.device("meta"):
        return build_model(model_config(run.model))


def hf_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels, use_cache=False).loss  # torchtitan's model keeps no cache


def zerofunc_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(ids, labels)


MODULES = {"Hugging Face LlamaForCausalLM (whole fp32 logits)": (hf_model, hf_loss, full_logits_gib),
           "zerofunc Llama (chunked loss)": (zerofunc_module, zerofunc_loss, lambda run: planned(run)["gib"])}


def _checkpointed(block: nn.Module, index: int, policy: ActivationCheckpointing) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    if not policy.on or not policy.recomputes(index):
        return block
    if policy.keeps_ops:
        return checkpoint_wrapper(block, context_fn=keep_attention_and_every_second_matmul, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False)


@contextlib.contextmanager
def fake_world(size: int):
    """A process group of `size` ranks in this one process whose collectives do nothing: this rank allocates
    what a rank of that world would, and nothing is sent."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(run: Run, build, device_type: str) -> nn.Module:
    """The run's module as torchtitan's `parallelize_llama` wraps it, built and sharded on meta (as
    torchtitan does: a module's set-up may read values) over the fake world's ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device_type, (run.gpus,))
    policy = ActivationCheckpointing(run.checkpointing)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[run.reduce_dtype])
    model = build(run)
    units = default_units(model)
    for i, name in enumerate(units):
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        owner.register_module(attr, _checkpointed(owner.get_submodule(attr), i, policy))
    for i, name in enumerate(units):  # torchtitan: the last block stays gathered for backward
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _trainer(run: Run, model: nn.Module, loss_of, device: str):
    """(forward_backward, update, batch) of torchtitan's step: AdamW with foreach, clipping at 1."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    vocab = model_config(run.model).vocab_size
    batch = tuple(torch.randint(0, vocab, (run.micro_batch, run.seq), device=device) for _ in range(2))

    def forward_backward():
        loss_of(model, *batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)

    def update():
        optimizer.step()
        optimizer.zero_grad()
    return forward_backward, update, batch, optimizer


def fsdp2_live_peak(run: Run, build, loss_of) -> dict:
    """One step of `run` under FSDP2 on fake tensors: the tracker's categories at the peak, GiB."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    with fake_world(run.gpus):
        model = sharded(run, build, "cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):  # the meta-built module enters it
            model.to_empty(device="cpu")
            forward_backward, update, batch, optimizer = _trainer(run, model, loss_of, "cpu")
            forward_backward()
            update()  # the moments exist from here on
            tracker = FSDPMemTracker(mod=model, optm=optimizer)
            tracker.track_inputs(batch)
            with tracker:
                forward_backward()
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return {str(getattr(k, "value", k)): v / GIB for k, v in snapshot.items()}


def fsdp2_cuda_peaks(run: Run, build, loss_of, steps: int = 2) -> dict:
    """`steps` whole steps of `run` under FSDP2 on this GPU, after one: the caching allocator's peaks, GiB.
    The weights are left uninitialised (the values do not change what is allocated)."""
    gc.collect()  # the last row's module and optimizer (FSDP2's hooks hold cycles)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with fake_world(run.gpus):
        model = sharded(run, build, "cuda")
        model.to_empty(device="cuda")
        forward_backward, update, _, _ = _trainer(run, model, loss_of, "cuda")
        forward_backward()
        update()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            forward_backward()
            update()
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
    return {"allocated": stats["allocated_bytes.all.peak"] / GIB, "reserved": stats["reserved_bytes.all.peak"] / GIB,
            "alloc_retries": stats["num_alloc_retries"], "allocated_before_gib": before / GIB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("fake", "cuda"), default="fake",
                    help="fake: fake tensors on this CPU, live tensors counted by FSDPMemTracker; cuda: real tensors on "
                         "GPU 0, the caching allocator's peaks over whole steps (set PYTORCH_CUDA_ALLOC_CONF as the run did)")
    ap.add_argument("--breakdown", action="store_true", help="fake: also print the tracker's categories at the peak")
    ap.add_argument("--no-plan", action="store_true", help="leave the planner's column out (another run printed it)")
    ap.add_argument("--json-out", default=None, help="also write the rows to this file as JSON")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        ap.error("needs transformers (in the test extra: pip install -c constraints.txt -e '.[test]')")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    runs = [r for r in RUNS if r.gib]
    measured = "FSDP2 live" if args.device == "fake" else "allocated  reserved"
    print(f"{'run':30} {'module':50} {'planned':>8} {measured:>10} {'published':>9}")
    rows = []
    for run in runs:
        for label, (build, loss_of, plan_gib) in MODULES.items():
            row = {"run": run.label, "module": label, "planned_gib": None if args.no_plan else plan_gib(run),
                   "published_gib": run.gib,
                   "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
            if args.device == "fake":
                row["fsdp2_live_gib"] = fsdp2_live_peak(run, build, loss_of)
                seen = f"{row['fsdp2_live_gib']['Total']:10.1f}"
            else:
                row.update(fsdp2_cuda_peaks(run, build, loss_of))
                seen = f"{row['allocated']:9.1f} {row['reserved']:9.1f}"
            rows.append(row)
            plan = "-" if row["planned_gib"] is None else f"{row['planned_gib']:.1f}"
            print(f"{run.label:30} {label:50} {plan:>8} {seen} {run.gib:9.1f}", flush=True)
            if args.breakdown and args.device == "fake":
                print("    " + ", ".join(f"{k} {v:.2f}" for k, v in row["fsdp2_live_gib"].items()
                                         if k != "Total" and v >= 0.005))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    print("\nGiB per GPU. planned: the planner's peak of live tensors for zerofunc's step on the module; "
          + ("FSDP2 live: torch's FSDPMemTracker over FSDP2's forward and backward at the run's configuration "
             "(fake tensors)" if args.device == "fake" else
             f"allocated, reserved: the caching allocator's peaks over whole FSDP2 steps on this GPU, one rank of "
             f"a fake world (PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r})")
          + "; published: the run's log (torchtitan: the caching allocator's peak reserved, with expandable segments)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
