"""How each implementation of benchmarks/peers.py trains: zerofunc (eager or compiled whole), DeepSpeed, DDP,
DDP with ZeroRedundancyOptimizer, FSDP2; each built on one rank of the running world from the same model."""
from __future__ import annotations

import os

import torch


def torch_step(module, opt):
    """One plain PyTorch training step (DDP, ZeroRedundancyOptimizer, FSDP2 all train this way)."""
    def step(x, y):
        loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def training(family: str, stage, model: torch.nn.Module, dev: torch.device, micro_batch: int, opt: dict,
             shard_group=None, checkpointing: str = "none"):
    """(What a probe inspects: zerofunc's or DeepSpeed's engine, else the module; a step `train_step(x, y) ->
    loss`) for `family` at `stage` (FSDP2: reshard after forward), with AdamW `opt` on `dev`."""
    import torch.distributed as dist
    if family in ("zerofunc", "zerofunc-whole"):
        import zerofunc
        from zerofunc.step import train_step as whole_step
        engine = zerofunc.initialize(model, {
            "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, **({"shard_group_size": shard_group} if shard_group else {})},
            "optimizer": {"type": "AdamW", "params": {**opt, "betas": list(opt["betas"])}},
            **({"activation_checkpointing": {"mode": checkpointing}} if checkpointing != "none" else {}),
            # eager as the peers are (on CUDA zerofunc would compile its blocks by default), or compiled whole
            "compile": "whole" if family == "zerofunc-whole" else False}, device=dev)

        def train_step(x, y):
            if engine.whole is not None:  # the first step compiles: a warm-up step
                return whole_step(engine, [(x, y)])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
        return engine, train_step
    if checkpointing != "none":
        raise ValueError(f"{family}: activation checkpointing is set for zerofunc's rows only")
    model.to(dev)
    if family == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", dev.type)
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        import deepspeed
        zero = {"stage": stage}
        if stage == 3:
            zero["memory_efficient_linear"] = False  # else it swaps F.linear process-wide (different rounding)
        config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
                  "zero_optimization": zero, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **opt),
                                               config=config)

        def train_step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
        return engine, train_step
    if family in ("ddp", "zro"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[0] if dev.type == "cuda" else None)
        if family == "zro":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **opt)
        else:
            optimizer = torch.optim.AdamW(ddp.parameters(), **opt)
        return model, torch_step(ddp, optimizer)
    if family == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        world = dist.get_world_size()
        mesh = shard_group and init_device_mesh(dev.type, (world // shard_group, shard_group),
                                                mesh_dim_names=("replicate", "shard"))
        for block in model.h:
            fully_shard(block, reshard_after_forward=stage, mesh=mesh)
        fully_shard(model, reshard_after_forward=stage, mesh=mesh)
        return model, torch_step(model, torch.optim.AdamW(model.parameters(), **opt))
    raise ValueError(f"unknown implementation family {family}")
