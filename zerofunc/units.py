"""Units: groups of parameters that travel together in one flat buffer.

A model is cut into its stage-3 gather units (for GPT-2, each transformer block) plus
a root unit holding every parameter outside them (embeddings, final norm). Every stage
uses the same units: for stages 0-2 they are the buckets in which gradients are
reduced as backward produces them; for stage 3 they are also what is gathered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from zerofunc.comm import Handle
from zerofunc.layout import FlatLayout
from zerofunc.stages import Stage

InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]
"""A parameter's initial value, whole, from its name and shape. An init may also offer
`read_into(name, shape, lo, hi, out, memory)`, copying only elements [lo, hi) of the flattened
parameter into `out`: pretrained weights (zerofunc/pretrained.py) read just a rank's shard that way."""


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reduced_dtype(weights: torch.dtype, reduce: torch.dtype) -> torch.dtype:
    """The dtype a unit's gradients are accumulated and reduced in: the configured `reduce` dtype, never below
    the weights' own (fp32 adapters under a 16-bit base reduce in fp32)."""
    return torch.promote_types(weights, reduce)


def check_reduce_dtype(reduce_dtype: Optional[str], precision: str) -> None:
    """Gradients reduce in the compute dtype or, under bf16 and fp16, in fp32 (None: the compute dtype's).
    ValueError otherwise: a narrower reduction than the gradients would only lose bits."""
    if reduce_dtype is None or reduce_dtype == precision or (reduce_dtype == "fp32" and precision in ("bf16", "fp16")):
        return
    raise ValueError(f"gradients computed in {precision} reduce in {precision}"
                     f"{' or fp32' if precision != 'fp32' else ''}, not {reduce_dtype!r}")


@dataclass(eq=False)
class FrozenPart:
    """A unit's parameters that do not train (`requires_grad=False`: a base model under an adapter), beside its
    trainable ones, in a flat buffer of their own: they get no gradient, no reduction, no fp32 master and no
    moments, and are stored in the compute dtype only. `params` is the whole buffer (stages 0-2) or this rank's
    shard (stage 3), which stage 3 gathers into `full` with the trainable shard and releases with it. Their
    views need no gradient, so autograd computes none for them (as DeepSpeed's ZeRO-3 and FSDP2 do)."""

    layout: FlatLayout
    params: torch.Tensor
    full: torch.Tensor
    secondary: Optional[torch.Tensor] = None  # hpZ: this rank's 1/k of them, kept from forward to backward

    def views(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.full)


@dataclass(eq=False)
class Unit:
    """One unit's state on one rank.

    `params` holds the weights the forward uses, in the compute dtype: the full padded
    buffer (stages 0-2) or the rank's shard (stage 3). `full` is what the forward takes
    views of: `params` itself for stages 0-2, and for stage 3 a gather buffer whose
    storage exists only while the unit is in use. `master` is the fp32 copy of what
    this rank's optimizer updates (all of it for stage 0, its shard otherwise); in fp32
    training it is `params` itself, or a view of it, so nothing is stored twice, unless
    the optimizer is offloaded: then master, m and v are host tensors (zerofunc.offload).
    """

    name: str
    module: nn.Module
    layout: FlatLayout
    params: torch.Tensor
    full: torch.Tensor
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    grad: Optional[torch.Tensor] = None        # what the optimizer consumes: full (stage 0) or shard
    local_grad: Optional[torch.Tensor] = None  # stages 0-1: this rank's unreduced full gradient
    staging: Optional[torch.Tensor] = None  # optimizer offload: the host buffer gradients come down into
    gathered: bool = True      # stage 3: the gather buffer has storage (its gather may still be running)
    gathering: Optional[Handle] = None  # stage 3: the prefetch that fills it, until waited on
    bound: Optional[dict] = None  # stage 3: the model's own parameters, while the unit's views stand in
    secondary: Optional[torch.Tensor] = None  # hpZ: this rank's 1/k of the weights, kept from forward to backward
    weights: Optional[torch.Tensor] = None  # `full` as the autograd leaf the forward's views are taken of
    frozen: Optional[FrozenPart] = None  # the unit's parameters with requires_grad=False, if any

    def __post_init__(self) -> None:
        if self.weights is None:  # shares `full`'s storage (and its release), not its autograd history
            self.weights = self.full.detach().requires_grad_()

    @property
    def numel(self) -> int:
        """Trainable parameter elements (the frozen part's are `frozen.layout.numel`)."""
        return self.layout.numel

    def views(self) -> dict[str, torch.Tensor]:
        """Every parameter of the unit as a view: the trainable ones of the autograd leaf, the frozen ones of
        their own buffer."""
        views = self.layout.views(self.weights)
        return views if self.frozen is None else views | self.frozen.views()


def partition(model: nn.Module, unit_names: list[str]) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Split the model's parameters into (name, module, named params): root first, then units.

    Parameter order inside a unit is registration order, so every rank builds the
    identical layout. A parameter shared by two modules (a tied head) appears once, and
    must not be shared across units: a unit is gathered alone (a ValueError says which).
    """
    units = [(name, model.get_submodule(name)) for name in unit_names]
    owner: dict[str, str] = {}
    for uname, _ in units:
        for pname, _ in model.get_submodule(uname).named_parameters():
            owner[f"{uname}.{pname}"] = uname
    groups: dict[str, list] = {"": []} | {u: [] for u, _ in units}
    for pname, p in model.named_parameters():
        groups[owner.get(pname, "")].append((pname, p))
    group_of = {id(p): g for g, named in groups.items() for _, p in named}
    for uname, module in units:
        for pname, p in module.named_parameters():
            if group_of[id(p)] != uname:
                theirs = f"unit '{group_of[id(p)]}'" if group_of[id(p)] else "the root unit"
                raise ValueError(f"unit '{uname}' shares its parameter '{pname}' with {theirs}: a unit is gathered "
                                 f"alone, so leave modules that share a weight out of the units (to the root)")
    ordered = [("", model, groups[""])] + [(u, m, groups[u]) for u, m in units]
    return [g for g in ordered if g[2]]


def materialize(name: str, module: nn.Module, named: list, world_size: int, rank: int, stage: Stage,
                device: torch.device, init: Optional[InitFn], dtype: torch.dtype, memory, offload=None,
                grad_dtype: Optional[torch.dtype] = None, trained_dtype: Optional[torch.dtype] = None) -> Unit:
    """Allocate one unit on `device` and fill only what this rank keeps.

    Each parameter is drawn whole from `init` (so its values do not depend on the
    world size) and all but the elements this rank keeps are dropped at once: under
    stage 3 no rank ever holds a whole unit, let alone the model, in fp32. The master
    copy is filled from the fp32 values, not from their 16-bit rounding. On the meta
    device nothing is initialized. With `offload` (a zerofunc.offload.OptimizerOffload),
    the optimizer's state and a staging buffer (of `grad_dtype`, the reduced gradient's; default
    `dtype`) are allocated in host memory. `trained_dtype` (default `dtype`, the compute dtype) is the
    trainable weights' own, fp32 for LoRA's adapters under a 16-bit base (zerofunc/lora.py); frozen
    weights are kept in `dtype`.
    """
    trained = trained_dtype or dtype
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    layout = FlatLayout.build([(n, p.shape) for n, p in named if p.requires_grad], world_size)
    whole = (0, layout.padded_numel)
    kept = layout.shard_range(rank) if stage.shard_params else whole
    owned = layout.shard_range(rank) if stage.shard_optimizer else whole

    read_into = getattr(init, "read_into", None)

    def filled(buf: torch.Tensor, span: tuple[int, int], layout: FlatLayout = layout) -> torch.Tensor:
        if init is not None and buf.device.type != "meta":
            for slot, lo, hi, at in layout.pieces(*span):
                if read_into is not None:
                    read_into(slot.name, slot.shape, lo, hi, buf[at:at + hi - lo], memory)
                else:
                    buf[at:at + hi - lo] = init(slot.name, slot.shape).reshape(-1)[lo:hi].to(buf.device, buf.dtype)
        return buf

    def allocated(category: str, make) -> torch.Tensor:  # counted as what it is from the start, not as "other"
        with memory.category(category):
            t = make()
        memory.track(t, category)
        return t

    params = filled(allocated("params", lambda: torch.zeros(kept[1] - kept[0], device=device, dtype=trained)), kept)
    staging = None
    if offload is not None:
        master = filled(offload.zeros(owned[1] - owned[0], torch.float32, "optimizer"), owned)
        m, v = (offload.zeros(master.numel(), torch.float32, "optimizer") for _ in range(2))
        staging = offload.zeros(master.numel(), reduced_dtype(trained, grad_dtype or dtype), "grads")
    elif trained != torch.float32:
        master = filled(allocated("optimizer", lambda: torch.zeros(owned[1] - owned[0], device=device,
                                                                   dtype=torch.float32)), owned)
    else:
        master = params[owned[0] - kept[0]:owned[1] - kept[0]]
    def gather_buffer(layout: FlatLayout, params: torch.Tensor) -> torch.Tensor:
        if not stage.shard_params:
            return params
        full = allocated("buffers", lambda: torch.empty(layout.padded_numel, device=device, dtype=params.dtype))
        full.untyped_storage().resize_(0)
        memory.resized(full)
        return full

    full = gather_buffer(layout, params)
    if offload is None:
        m, v = (allocated("optimizer", lambda: torch.zeros_like(master)) for _ in range(2))
    part = None
    if frozen:  # kept in the compute dtype only, sharded as the weights are
        frozen_layout = FlatLayout.build([(n, p.shape) for n, p in frozen], world_size)
        span = frozen_layout.shard_range(rank) if stage.shard_params else (0, frozen_layout.padded_numel)
        frozen_params = filled(allocated("params", lambda: torch.zeros(span[1] - span[0], device=device,
                                                                       dtype=dtype)), span, frozen_layout)
        part = FrozenPart(frozen_layout, frozen_params, gather_buffer(frozen_layout, frozen_params))
    return Unit(name, module, layout, params, full, master, m, v, staging=staging, gathered=not stage.shard_params,
                frozen=part)
