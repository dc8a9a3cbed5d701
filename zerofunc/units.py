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

from zerofunc.layout import FlatLayout, shard
from zerofunc.stages import Stage

InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]


@dataclass(eq=False)
class Unit:
    """One unit's state on one rank.

    `params` holds the fp32 weights this rank keeps: the full padded buffer (stages
    0-2) or the rank's shard (stage 3). `full` is what the forward takes views of: the
    same buffer as `params` for stages 0-2, and for stage 3 a gather buffer whose
    storage exists only while the unit is in use.
    """

    name: str
    module: nn.Module
    layout: FlatLayout
    params: torch.Tensor
    full: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    grad: Optional[torch.Tensor] = None        # what the optimizer consumes: full (stage 0) or shard
    local_grad: Optional[torch.Tensor] = None  # stages 0-1: this rank's unreduced full gradient
    gathered: bool = True
    bound: Optional[dict] = None  # stage 3: the model's own parameters, while the unit's views stand in

    @property
    def numel(self) -> int:
        return self.layout.numel


def partition(model: nn.Module, unit_names: list[str]) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Split the model's parameters into (name, module, named params): root first, then units.

    Parameter order inside a unit is registration order, so every rank builds the
    identical layout. A parameter shared by two modules (a tied head) appears once.
    """
    units = [(name, model.get_submodule(name)) for name in unit_names]
    owner: dict[str, str] = {}
    for uname, _ in units:
        for pname, _ in model.get_submodule(uname).named_parameters():
            owner[f"{uname}.{pname}"] = uname
    groups: dict[str, list] = {"": []} | {u: [] for u, _ in units}
    for pname, p in model.named_parameters():
        groups[owner.get(pname, "")].append((pname, p))
    ordered = [("", model, groups[""])] + [(u, m, groups[u]) for u, m in units]
    return [g for g in ordered if g[2]]


def materialize(name: str, module: nn.Module, named: list, world_size: int, rank: int,
                stage: Stage, device: torch.device, init: Optional[InitFn]) -> Unit:
    """Allocate one unit on `device` and fill only what this rank keeps.

    With sharded parameters a rank initializes only its own slice: each parameter is
    drawn whole (so its values do not depend on the world size) and all but the owned
    elements are dropped at once, so no rank ever holds a whole unit, let alone the
    model, in fp32. On the meta device nothing is initialized.
    """
    layout = FlatLayout.build([(n, p.shape) for n, p in named], world_size)
    shard_params = stage.shard_params
    size = layout.shard_numel if shard_params else layout.padded_numel
    params = torch.zeros(size, device=device)
    if init is not None and device.type != "meta":
        if shard_params:
            for slot, lo, hi, at in layout.owned_pieces(rank):
                params[at:at + hi - lo] = init(slot.name, slot.shape).reshape(-1)[lo:hi].to(device)
        else:
            for slot in layout.slots:
                params[slot.offset:slot.offset + slot.numel] = init(slot.name, slot.shape).reshape(-1).to(device)
    if shard_params:
        full = torch.empty(layout.padded_numel, device=device)
        full.untyped_storage().resize_(0)
        gathered = False
    else:
        full, gathered = params, True
    opt_size = layout.shard_numel if stage.shard_optimizer else layout.padded_numel
    return Unit(name, module, layout, params, full,
                m=torch.zeros(opt_size, device=device), v=torch.zeros(opt_size, device=device),
                gathered=gathered)


def owned_params(unit: Unit, rank: int) -> torch.Tensor:
    """The slice of the weights this rank's optimizer updates: as long as its m and v (a view)."""
    if unit.params.numel() == unit.m.numel():
        return unit.params
    return shard(unit.params, rank, unit.layout.world_size)
