"""DeepSpeed's four-line change: engine = zerofunc.initialize(model, config); engine(batch);
engine.backward(loss); engine.step()."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerofunc.comm import Communicator, DistCommunicator, hybrid_communicators, secondary_communicator
from zerofunc.config import Config, compile_mode, parse
from zerofunc.engine import ZeroEngine
from zerofunc.recompute import ActivationCheckpointing, model_checkpoints
from zerofunc.stages import get_stage
from zerofunc.units import InitFn


def initialize(model: nn.Module, config: dict | str | Path | Config, *, device: Optional[torch.device | str] = None,
               comm: Optional[Communicator] = None, init: Optional[InitFn] = None,
               unit_names: Optional[list[str]] = None, memory=None, compile: Optional[bool | str] = None,
               replicas: Optional[Communicator] = None, secondary: Optional[Communicator] = None) -> ZeroEngine:
    """Wrap `model` (any nn.Module) in a ZeRO engine configured by a DeepSpeed-style `config`.

    Without a process group, a single-rank gloo group is started, so the same script
    runs alone or under torchrun. A model with real weights starts from them, and its
    own copies are then released (only the engine's flat buffers hold weights); a model
    on the meta device needs `init`, or an `init_param(name, shape, seed)` method. The
    module is otherwise left as it was: the engine's hooks and forwards are in it only while
    the engine's forward or backward runs (zerofunc/binding.py), so `model.eval()` and `model.train()`
    still set what the engine runs.
    `compile` (else the config's `compile` key): "blocks" (or True) runs each block's compute through
    torch.compile, "whole" compiles the whole step with its collectives (zerofunc/whole_step.py), False
    neither; by default blocks on CUDA only (on CPU inductor emits C++, and a first compile costs more than
    a short run saves).
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # its forward would trace the engine's hooks
        raise ValueError("initialize takes the model itself, not torch.compile(model): set compile= or the config's "
                         "\"compile\" (\"blocks\" or \"whole\") to compile the step")
    world = comm.world_size if comm is not None else dist.get_world_size() if dist.is_initialized() else 1
    cfg = config if isinstance(config, Config) else parse(config, world)  # bad input fails before any set-up
    if comm is None and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    given = comm is not None
    hybrid = cfg.shard_group is not None and cfg.stage > 0  # stage 0 shards nothing: no groups
    if hybrid and comm is None:
        comm, replicas = hybrid_communicators(cfg.shard_group)
    elif hybrid and (replicas is None or comm.world_size != cfg.shard_group):
        raise ValueError("zero_optimization.shard_group_size with a given comm: give it the shard group's, and "
                         "replicas= the replicas' (the planner's recording communicators)")
    elif not hybrid:
        replicas = None
    comm = comm if comm is not None else DistCommunicator()
    if cfg.hpz is not None and secondary is None:
        if given:
            raise ValueError("zero_optimization.zero_hpz_partition_size with a given comm: give secondary= too")
        secondary = secondary_communicator(cfg.hpz, comm.ledger)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    real = [p for p in model.parameters() if p.device.type != "meta"]
    if init is None:
        if real:
            weights = {n: p.detach() for n, p in model.named_parameters()}
            init = lambda name, shape: weights[name].float().cpu()  # noqa: E731
        elif hasattr(model, "init_param"):
            init = lambda name, shape: model.init_param(name, shape, 0)  # noqa: E731
        else:
            raise ValueError("the model is on the meta device: pass init=, or give it init_param(name, shape, seed)")
    units = unit_names if unit_names is not None else default_units(model)
    checkpointing = cfg.checkpointing
    if not checkpointing.on and units and model_checkpoints(model):  # Hugging Face's gradient_checkpointing_enable()
        checkpointing = ActivationCheckpointing("full")
    engine = ZeroEngine(model, get_stage(cfg.stage), comm, cfg.optimizer, device, init, units, precision=cfg.precision,
                        memory=memory, grad_accum=cfg.grad_accum, clip=cfg.clip, loss_scaler=cfg.loss_scaler(),
                        overlap=cfg.overlap, compile=compile_mode(compile, cfg.compile, torch.device(device).type),
                        checkpointing=checkpointing, offload_optimizer=cfg.offload_optimizer, replicas=replicas,
                        secondary=secondary if cfg.hpz is not None else None, reduce_dtype=cfg.reduce_dtype)
    engine.optimizer.lr_schedule = cfg.lr
    engine.config = cfg
    if real:
        _release_module_weights(model)
    return engine


def default_units(model: nn.Module) -> list[str]:
    """Stage 3's gather units: the model's own `shard_units()`, else the children of its stacks of blocks
    below the root, in the modules' order; else none. The stacks: its largest ModuleList or Sequential (the
    stack of blocks: a ModuleList in most models, Hugging Face's among them, an nn.Sequential in others,
    timm's vision transformers), and every other one whose children are blocks of one class (at least two
    modules of modules) in a sub-model of its own: an encoder's layers beside a decoder's (T5, BART,
    Whisper), a vision tower's beside a text model's (CLIP). Left in the root unit, each of those would stay
    gathered all step. A stack beside the blocks' own, or above them, is not taken: its blocks may run inside
    theirs (adapters a layer is handed), and a unit cannot run inside another.

    A child without parameters (an activation between blocks) is no unit; nor is one that shares a
    parameter with any other module of the model (a head tied to an embedding, one layer listed twice):
    a unit is gathered alone, so a weight two units used would be missing from one of them. Their
    parameters stay in the root unit."""
    if hasattr(model, "shard_units"):
        return list(model.shard_units())
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    stacks = sorted(((name, m) for name, m in model.named_modules()
                     if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)),
                    key=lambda nm: -size(nm[1]))  # stable: the modules' order among equals
    if not stacks:
        return []
    chosen = [stacks[0]]
    for name, m in stacks[1:]:
        if all(_apart(name, c) for c, _ in chosen) and _blocks_of_one_class(m):
            chosen.append((name, m))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    chosen.sort(key=lambda nm: order[nm[0]])

    def holder(pname: str) -> str:  # the stacks' child that holds the parameter, or "" outside them
        stack = next((name for name, _ in chosen if pname.startswith(f"{name}.")), None)
        return "" if stack is None else f"{stack}.{pname[len(stack) + 1:].split('.')[0]}"

    holders: dict[int, set[str]] = defaultdict(set)
    for pname, p in model.named_parameters(remove_duplicate=False):
        holders[id(p)].add(holder(pname))
    return [f"{name}.{child}" for name, stack in chosen for child, m in stack.named_children()
            if any(True for _ in m.parameters()) and all(holders[id(p)] == {f"{name}.{child}"} for p in m.parameters())]


def _apart(a: str, b: str) -> bool:
    """Whether stacks `a` and `b` lie in sub-models of their own: neither's parent module holds the other."""
    pa, pb = a.rpartition(".")[0], b.rpartition(".")[0]
    return bool(pa and pb) and not (f"{pa}.".startswith(f"{pb}.") or f"{pb}.".startswith(f"{pa}."))


def _blocks_of_one_class(stack: nn.Module) -> bool:
    """Whether the stack's children with parameters are two or more modules of modules, all of one class."""
    blocks = [m for m in stack.children() if any(True for _ in m.parameters())]
    return len(blocks) >= 2 and len({type(m) for m in blocks}) == 1 and all(any(True for _ in m.children())
                                                                             for m in blocks)


def _release_module_weights(model: nn.Module) -> None:
    """Swap the module's parameters for meta tensors: the engine's buffers hold the weights now.

    A parameter shared by two modules (a tied output head) gets one replacement, so the
    tie survives and the engine binds both names (zerofunc/binding.py, `with_ties`).
    """
    replacement: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and p.device.type != "meta":
                if id(p) not in replacement:
                    replacement[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                module._parameters[key] = replacement[id(p)]
